"""Claims that follow liveness: a live owner renews its lease while it works.

A categorizer batch, a delivery round and a link's delivery task each hold
rows under a lease (``queues.transitions``). The lease is short
(``MAILRELAY_DELIVERY_LEASE``, 30 s by default) and the owner renews it every
third of it from the thread that does the work and holds its database
connection, whatever it is waiting for (a slow peer, a DNS answer, a
10-minute reply to the final dot: the SMTP exchange runs in an event-loop
thread of its own while the owner's thread renews and serves it message
bodies, see ``delivery.deliver``). So:

- a process killed with -9, OOM-killed or cut off from PostgreSQL stops
  renewing, its leases run out, and the sweep's reclaim hands the rows on
  within one lease and one reclaim interval;
- a live owner is never robbed by a timer, however long its work takes;
- an owner that could not renew for a whole lease, or found its rows taken,
  knows it (``Claim.held()`` turns False): it stops before its next message,
  and its writes are fenced by its owner token anyway.

Renewal runs on the owner's own connection, so ownership is tied to the
process that does the work; after a database error the connection is
replaced, so a PostgreSQL restart costs a renewal, not the claim.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from datetime import datetime, timedelta
from typing import TypeVar

from django.conf import settings
from django.db import InterfaceError, OperationalError, connection

from queues import clock
from queues.dberrors import is_outage

log = logging.getLogger(__name__)

# renew(until) -> False when the claim is gone (taken back by the sweep)
Renew = Callable[[datetime], bool]
T = TypeVar("T")


def renewal_interval(lease: timedelta) -> float:
    """A third of the lease: two renewals may fail before the lease runs out."""
    return max(0.05, lease.total_seconds() / 3)


class Claim:
    """One owner's hold on some rows, renewed by the owner while it works."""

    def __init__(self, name: str, renew: Renew, lease: timedelta | None = None) -> None:
        self.name = name
        self._renew = renew
        self.lease = lease or settings.MAILRELAY_DELIVERY_LEASE
        self.interval = renewal_interval(self.lease)
        self.renewed_at = time.monotonic()
        self._lost = threading.Event()

    def held(self) -> bool:
        """Cheap and thread-safe, for the hot loop: False once the claim is lost."""
        return not self._lost.is_set()

    def lose(self, why: str) -> None:
        if not self._lost.is_set():
            log.warning("lost the claim %s: %s", self.name, why)
            self._lost.set()

    def seconds_to_renewal(self) -> float:
        return max(0.0, self.renewed_at + self.interval - time.monotonic())

    def renew_if_due(self) -> None:
        """Renew when a third of the lease has passed since the last renewal."""
        if self.held() and self.seconds_to_renewal() <= 0:
            self.renew()

    def renew(self) -> None:
        try:
            still = self._renew(clock.now() + self.lease)
        except Exception as exc:  # noqa: BLE001 - the database may be restarting
            log.warning("could not renew the claim %s: %s", self.name, exc)
            drop_connection()
            if time.monotonic() - self.renewed_at >= self.lease.total_seconds():
                self.lose(f"not renewed for {self.lease}")
            return
        if still:
            self.renewed_at = time.monotonic()
        else:
            self.lose("its rows were taken back")


def drop_connection() -> None:
    """Close this thread's database connection after an error: the next query
    opens a fresh one (the server may have restarted)."""
    try:
        connection.close()
    except Exception:  # noqa: BLE001 - closing a broken connection may fail too
        log.debug("closing a broken database connection failed", exc_info=True)


def while_connected(claim: Claim, work: Callable[[], T]) -> T:
    """Run ``work``; when the database connection breaks (PostgreSQL restarting),
    reconnect and run it again for as long as the claim is held, renewing it,
    so an outage shorter than a lease costs a moment, not the claim (and not a
    second copy of what a round already sent). ``work`` must be safe to repeat:
    one transaction, fenced by the owner token. A data error (queues.dberrors:
    a value or an index row too large, a constraint) is not an outage: it is
    raised at once, not tried again."""
    delay = 0.2
    while True:
        try:
            return work()
        except (OperationalError, InterfaceError) as exc:
            if not is_outage(exc):
                raise
            drop_connection()
            claim.renew()  # keeps the claim across the outage, or finds it lost
            if not claim.held():
                raise
            log.warning("database unavailable (%s); trying again in %.1fs", exc, delay)
            time.sleep(delay)
            delay = min(delay * 2, 5.0)
