"""Login throttling for the Queue Viewer, the admin and API token creation.

After ``MAILRELAY_LOGIN_FAILURE_LIMIT`` (5) failed logins for one user name,
or from one client address, within ``MAILRELAY_LOGIN_FAILURE_WINDOW`` (15m),
logins for that name / from that address are refused for
``MAILRELAY_LOGIN_LOCKOUT`` (15m) without the password being checked, so a
guesser learns nothing more, even with the right password. Each lockout is
an Event (kind ``login_lockout``) and an AuditEntry (action
``login_lockout``). A successful login clears its user name's failures (not
its address's: a guesser with one valid account must not reset the count).

Counters live in Django's cache (Redis with a Redis broker, files otherwise;
mailrelay/settings.py), so every web process shares them. If the cache is
down, logins are not throttled (and a warning is logged) rather than every
operator being locked out of the relay when they need it most.
"""

from __future__ import annotations

import hashlib
import logging
import math
import time
from dataclasses import dataclass

from django.conf import settings
from django.core.cache import cache

from queues.lib import clock
from queues.models import AuditEntry, Event
from queues.states import EventLevel

log = logging.getLogger(__name__)

LOCKOUT = "login_lockout"


@dataclass
class LoginLocked(Exception):
    """Logins are refused for this user name or client address for now."""

    by: str  # "user name" or "address"
    retry_after: int  # seconds

    @property
    def message(self) -> str:
        minutes = max(1, math.ceil(self.retry_after / 60))
        return (
            f"Too many failed logins for this {self.by}: logins are refused for "
            f"{minutes} more minute{'s' if minutes != 1 else ''}. "
            "Ask an administrator if you need in sooner."
        )

    def __str__(self) -> str:
        return self.message


def _norm(username: str) -> str:
    return username.strip().casefold()[:150]


def _keys(username: str, address: str) -> list[tuple[str, str]]:
    """(kind, key part) of each counter a login attempt counts against."""
    name = hashlib.sha256(_norm(username).encode()).hexdigest()[:32]
    return [("user name", f"u:{name}"), ("address", f"a:{address}")]


def _seconds(value) -> int:
    return max(1, int(value.total_seconds()))


def check(username: str, address: str) -> None:
    """Raise LoginLocked when either the user name or the address is locked."""
    now = time.time()
    try:
        for by, part in _keys(username, address):
            until = cache.get(f"login:lock:{part}")
            if until is not None and until > now:
                raise LoginLocked(by, math.ceil(until - now))
    except LoginLocked:
        raise
    except Exception:  # noqa: BLE001 - a broken cache must not lock everyone out
        log.warning("login throttle: cache unavailable, not throttling", exc_info=True)


def _count(key: str, window: int) -> int:
    cache.add(key, 0, timeout=window)  # the window starts at the first failure
    try:
        return cache.incr(key)
    except ValueError:  # expired between add and incr
        cache.set(key, 1, timeout=window)
        return 1


def failed(username: str, address: str, via: str) -> LoginLocked | None:
    """Count a failed login; the lockout it starts, if it starts one."""
    limit = settings.MAILRELAY_LOGIN_FAILURE_LIMIT
    window = _seconds(settings.MAILRELAY_LOGIN_FAILURE_WINDOW)
    lockout = _seconds(settings.MAILRELAY_LOGIN_LOCKOUT)
    started: list[str] = []
    try:
        for by, part in _keys(username, address):
            if _count(f"login:fail:{part}", window) < limit:
                continue
            # add(): only the failure that starts a lockout records it.
            if cache.add(f"login:lock:{part}", time.time() + lockout, timeout=lockout):
                cache.delete(f"login:fail:{part}")
                started.append(by)
    except Exception:  # noqa: BLE001
        log.warning("login throttle: cache unavailable, not counting", exc_info=True)
    if not started:
        return None
    _record(started, username, address, via, limit, lockout)  # one record per lockout
    return LoginLocked(started[0], lockout)


def succeeded(username: str) -> None:
    try:
        cache.delete(f"login:fail:{_keys(username, '')[0][1]}")
    except Exception:  # noqa: BLE001
        log.warning("login throttle: cache unavailable", exc_info=True)


def forget(username: str = "", address: str = "") -> None:
    """Lift the lockout and failures of a user name and/or an address (tests, admins)."""
    parts = []
    for by, part in _keys(username, address):
        if (by == "user name" and username) or (by == "address" and address):
            parts.append(part)
    cache.delete_many([f"login:{kind}:{part}" for part in parts for kind in ("fail", "lock")])


def _record(
    started: list[str], username: str, address: str, via: str, limit: int, lockout: int
) -> None:
    window = settings.MAILRELAY_LOGIN_FAILURE_WINDOW
    names = {"user name": f"user name {_norm(username)!r}", "address": f"address {address}"}
    who = " and ".join(names[by] for by in started)
    text = (
        f"{limit} failed logins for {who} within {int(window.total_seconds() // 60)} min "
        f"(last from {address}, via {via}): logins refused for {lockout // 60} min"
    )
    now = clock.now()
    data = {"by": started, "username": _norm(username), "address": address, "via": via}
    Event.objects.create(
        created_at=now, level=EventLevel.WARNING, kind=LOCKOUT, text=text, data=data
    )
    AuditEntry.objects.create(
        created_at=now,
        actor=None,
        actor_name=_norm(username) or "(no user name)",
        via=via,
        action=LOCKOUT,
        target_type="login",
        filter=data,
        count=limit,
        detail=text,
    )
    log.warning("login lockout: %s", text)
