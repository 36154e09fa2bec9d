"""Claims that follow liveness: a live owner renews its lease while it works.

A categorizer batch, a delivery round and a link's delivery task each hold
rows under a lease (``queues.transitions``). The lease is short
(``MAILRELAY_DELIVERY_LEASE``, 30 s by default) and the owner renews it every
third of it from the thread that does the work and holds its database
connection, whatever it is waiting for (a slow peer, a DNS answer, a
10-minute reply to the final dot: the SMTP exchange runs in an event-loop
thread of its own while the owner's thread renews and serves it message
bodies, see ``delivery.smtp.deliver``). So:

- a process killed with -9, OOM-killed or cut off from PostgreSQL stops
  renewing, its leases run out, and the sweep's reclaim hands the rows on
  within one lease and one reclaim interval;
- a live owner is never robbed by a timer, however long its work takes;
- a claim is a lease in time, not a belief: ``Claim.held()`` is True only
  while the monotonic time since the *start* of the last successful renewal
  is below the lease less a safety margin (``MAILRELAY_DELIVERY_LEASE_MARGIN``,
  for clock drift between hosts and the time a send takes). A frozen
  (SIGSTOP, VM pause) or cut-off owner therefore stops by itself — before
  MAIL FROM and before the final dot — without waiting to hear that it lost,
  and before anyone else may take its rows over (the sweep takes them back
  only once the lease in the database has run out). A renewal that fails or
  is slow counts the same as a lost one. This is the fencing rule of lease
  systems (Chubby's lease with a local timeout that starts before the
  request; etcd leases; Kafka's zombie fencing): the holder's own clock ends
  its lease no later than everyone else's;
- an owner that found its rows taken knows it at once; its writes are fenced
  by its owner token anyway.

Renewal runs on the owner's own connection, so ownership is tied to the
process that does the work; after a database error the connection is
replaced, so a PostgreSQL restart costs a renewal, not the claim.

The outage tracker (``OUTAGE``, ``waits_for_database``) is here too: what an
owner, a task and the ingress do while the database is away.
"""

from __future__ import annotations

import concurrent.futures
import functools
import logging
import threading
import time
from collections.abc import Callable
from datetime import datetime, timedelta
from typing import Any, ParamSpec, TypeVar

from django.conf import settings
from django.db import InterfaceError, OperationalError, connection

from queues.dberrors import drop_connection, is_outage
from queues.lib import clock

log = logging.getLogger(__name__)

# renew(until) -> False when the claim is gone (taken back by the sweep)
Renew = Callable[[datetime], bool]
T = TypeVar("T")


def renewal_interval(lease: timedelta) -> float:
    """A third of the lease: two renewals may fail before the lease runs out."""
    return max(0.05, lease.total_seconds() / 3)


def valid_for(lease: timedelta, margin: timedelta | None = None) -> float:
    """How long after the start of a successful renewal the owner may still act:
    the lease less the safety margin (at most a third of the lease, so that short
    leases in tests keep two renewals' worth of validity)."""
    if margin is None:
        margin = settings.MAILRELAY_DELIVERY_LEASE_MARGIN
    seconds = lease.total_seconds()
    return seconds - min(margin.total_seconds(), seconds / 3)


class Claim:
    """One owner's hold on some rows, renewed by the owner while it works.

    ``acquired_at``: the monotonic time at which the request that took the
    rows was sent (their lease runs from then); default now. ``monotonic``:
    the clock (tests move it)."""

    def __init__(
        self,
        name: str,
        renew: Renew,
        lease: timedelta | None = None,
        *,
        acquired_at: float | None = None,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        self.name = name
        self._renew = renew
        self._monotonic = monotonic
        self.lease = lease or settings.MAILRELAY_DELIVERY_LEASE
        self.interval = renewal_interval(self.lease)
        self.valid_for = valid_for(self.lease)
        self.renewed_at = monotonic() if acquired_at is None else acquired_at
        self._lost = threading.Event()

    def held(self) -> bool:
        """Cheap and thread-safe, for the hot loop: False once the claim is lost,
        or once the time since the start of its last successful renewal reached
        the lease less the margin (then it stays lost)."""
        if self._lost.is_set():
            return False
        age = self._monotonic() - self.renewed_at
        if age >= self.valid_for:
            self.lose(f"not renewed for {age:.1f}s (valid for {self.valid_for:.1f}s)")
            return False
        return True

    def lose(self, why: str) -> None:
        if not self._lost.is_set():
            log.warning("lost the claim %s: %s", self.name, why)
            self._lost.set()

    def seconds_to_renewal(self) -> float:
        return max(0.0, self.renewed_at + self.interval - self._monotonic())

    def renew_if_due(self) -> None:
        """Renew when a third of the lease has passed since the last renewal."""
        if self.held() and self.seconds_to_renewal() <= 0:
            self.renew()

    def renew(self) -> None:
        """Extend the lease. Its validity counts from the start of this request:
        a renewal that took long bought less time, one that failed bought none."""
        started = self._monotonic()
        try:
            still = self._renew(clock.now() + self.lease)
        except Exception as exc:  # noqa: BLE001 - the database may be restarting
            log.warning("could not renew the claim %s: %s", self.name, exc)
            drop_connection()
            self.held()  # loses it once the validity has run out
            return
        if not still:
            self.lose("its rows were taken back")
        elif not self._lost.is_set():
            self.renewed_at = started


def while_connected(claim: Claim, work: Callable[[], T]) -> T:
    """Run ``work``; when the database connection breaks (PostgreSQL restarting),
    reconnect and run it again for as long as the claim is held, renewing it,
    so an outage shorter than a lease costs a moment, not the claim (and not a
    second copy of what a round already sent). ``work`` must be safe to repeat:
    one transaction, fenced by the owner token."""

    def still_held() -> bool:
        claim.renew()  # keeps the claim across the outage, or finds it lost
        return claim.held()

    return retry_outages(work, still_held)


def retry_outages(work: Callable[[], T], may_retry: Callable[[], bool]) -> T:
    """Run ``work``; when the database connection breaks, reconnect and run it
    again (after 0.2 s, doubling up to 5 s) for as long as ``may_retry()`` says
    (the owner still holds what ``work`` writes). A data error (queues.dberrors:
    a value or an index row too large, a constraint) is not an outage: it is
    raised at once, not tried again."""
    delay = 0.2
    while True:
        try:
            result = work()
            OUTAGE.recovered()
            return result
        except (OperationalError, InterfaceError) as exc:
            if not is_outage(exc):
                raise
            drop_connection()
            if not may_retry():
                raise
            OUTAGE.failed(exc)  # logged once per outage
            log.debug("database unavailable (%s); trying again in %.1fs", exc, delay)
            time.sleep(delay)
            delay = min(delay * 2, 5.0)


def while_renewing(claim: Claim, work: Callable[[], T]) -> T:
    """Run ``work`` in a thread of its own while this thread (the owner, which
    holds the database connection) renews ``claim``: for slow network work
    inside a round, such as fetching a recipient domain's MTA-STS policy, so
    a slow server cannot make the claim run out. ``work`` must not use the
    database and must be bounded by its own deadline; its result is returned
    and its exception raised here."""
    done: concurrent.futures.Future[T] = concurrent.futures.Future()

    def run() -> None:
        try:
            done.set_result(work())
        except BaseException as exc:  # noqa: BLE001 - raised in the owner thread
            done.set_exception(exc)

    threading.Thread(target=run, name=f"{claim.name} wait", daemon=True).start()
    while not concurrent.futures.wait([done], max(0.01, claim.seconds_to_renewal())).done:
        claim.renew_if_due()
    return done.result()


# --- the database going away and coming back, as one process sees it (issue #25) ----
#
# While PostgreSQL has no primary (a failover, a restart) every query fails the
# same way, thousands of times a minute on a busy ingress. A traceback each
# time buries the one fact that matters, so:
#
# - ``OUTAGE.failed(exc)`` notes a failure; the first one of an outage logs
#   one ERROR line (when it started, and why); the rest log nothing here
#   (ingress logs one short line per ``451``, without a traceback);
# - ``OUTAGE.recovered()`` after a query worked again logs one line when an
#   outage ends (how long it lasted, how many failures it cost);
# - ``waits_for_database(task)``: a Celery task that finds the database away
#   waits for it (polling, with a backoff) and runs again, instead of failing
#   with a traceback; it gives up quietly after ``TASK_WAIT_SECONDS`` (the work
#   is in the database: the sweep rings for it once it is back).
#
# Nothing here changes a message: a claim held across the outage is kept or
# taken back by the lease rule (above), never marked failed.

P = ParamSpec("P")

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
