"""The database going away and coming back, as one process sees it (issue #25).

While PostgreSQL has no primary (a failover, a restart) every query fails the
same way, thousands of times a minute on a busy ingress. A traceback each
time buries the one fact that matters, so:

- ``OUTAGE.failed(exc)`` notes a failure; the first one of an outage logs
  one ERROR line (when it started, and why); the rest log nothing here
  (ingress logs one short line per ``451``, without a traceback);
- ``OUTAGE.recovered()`` after a query worked again logs one line when an
  outage ends (how long it lasted, how many failures it cost);
- ``waits_for_database(task)``: a Celery task that finds the database away
  waits for it (polling, with a backoff) and runs again, instead of failing
  with a traceback; it gives up quietly after ``TASK_WAIT_SECONDS`` (the work
  is in the database: the sweep rings for it once it is back).

Nothing here changes a message: a claim held across the outage is kept or
taken back by the lease rule (``delivery.qmgr.ownership``), never marked failed.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Callable
from typing import Any, ParamSpec, TypeVar

from django.db import InterfaceError, OperationalError, connection

from queues.dberrors import drop_connection

log = logging.getLogger(__name__)

P = ParamSpec("P")
T = TypeVar("T")

# How long a task waits for the database before it leaves the work to the sweep.
TASK_WAIT_SECONDS = 120.0


def is_unavailable(exc: BaseException) -> bool:
    """A database that is away (connection refused, lost, read-only standby), not a bug."""
    return isinstance(exc, (OperationalError, InterfaceError))


def first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"


class Outage:
    """Whether this process's database is away, logged once as it starts and ends."""

    def __init__(self, monotonic: Callable[[], float] = time.monotonic) -> None:
        self._monotonic = monotonic
        self._lock = threading.Lock()
        self.since: float | None = None
        self.failures = 0

    @property
    def active(self) -> bool:
        return self.since is not None

    def failed(self, exc: BaseException) -> None:
        with self._lock:
            self.failures += 1
            if self.since is not None:
                return
            self.since = self._monotonic()
            self.failures = 1
        log.error("database unavailable: %s (logged once until it is back)", first_line(exc))

    def recovered(self) -> None:
        if self.since is None:  # the hot path: one attribute read
            return
        with self._lock:
            if self.since is None:
                return
            lasted, failures = self._monotonic() - self.since, self.failures
            self.since, self.failures = None, 0
        log.warning(
            "database available again after %.1f s (%d operations failed meanwhile)",
            lasted,
            failures,
        )


OUTAGE = Outage()


def wait_for_database(deadline: float, sleep: Callable[[float], None] = time.sleep) -> bool:
    """Poll until a connection opens (to the primary, with a multi-host
    DATABASE_URL), with a backoff of 0.2 s to 2 s; False at ``deadline``."""
    delay = 0.2
    while True:
        try:
            connection.ensure_connection()
            return True
        except (OperationalError, InterfaceError) as exc:
            OUTAGE.failed(exc)
            drop_connection()
        if time.monotonic() + delay > deadline:
            return False
        sleep(delay)
        delay = min(delay * 2, 2.0)


def waits_for_database(
    task: Callable[P, T] | None = None, *, wait: float = TASK_WAIT_SECONDS
) -> Any:
    """Run ``task``; while the database is away, wait for it (up to ``wait``
    seconds) and run it again. ``@waits_for_database`` or ``(wait=0)``: a
    periodic task that only logs one line and leaves it to its next run."""

    def decorate(task: Callable[P, T]) -> Callable[P, T | None]:
        @functools.wraps(task)
        def run(*args: P.args, **kwargs: P.kwargs) -> T | None:
            deadline = time.monotonic() + wait
            while True:
                try:
                    result = task(*args, **kwargs)
                except (OperationalError, InterfaceError) as exc:
                    OUTAGE.failed(exc)
                    drop_connection()
                    if not wait_for_database(deadline):
                        log.warning(
                            "%s: the database is away (%s); its work waits in the database",
                            task.__name__,
                            first_line(exc),
                        )
                        return None
                    continue
                OUTAGE.recovered()
                return result

        return run

    return decorate if task is None else decorate(task)
