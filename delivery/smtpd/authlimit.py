"""How many AUTH guesses a client address and a username get (Postfix's anvil, Dovecot's
auth penalty), shared by every ingress process.

An attempt is *reserved* before its password is hashed: one atomic increment
of the address's counter and of the username's, then the check. Parallel
guesses each see their own count, so no more than the limit are ever hashed,
however many arrive at once. A successful AUTH gives its reservation back; a
failed one keeps it as a failure. Each counter lives ``AUTH_FAILURE_WINDOW``
(15 min) from its first failure; past its limit the address (or the account)
is refused until then, the right password too (a guesser must learn nothing).

The counters are in Django's cache (Redis with a Redis broker: ``INCR`` is
atomic, and every ``runsmtp`` process and ingress node shares them), so more
processes allow no more guesses. If the cache is down, each process counts
in its own memory with its share of the limits (``processes``): AUTH keeps
working for real users and a guesser still gets no more tries in total than
with the cache; a warning is logged (at most once a minute).

Every call but ``locked_out`` talks to the cache: run them in the database
threads. ``locked_out`` reads what this process learnt, for the connection
check on the event loop.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass

from django.core.cache import cache

from queues.services import accounts

log = logging.getLogger(__name__)

AUTH_FAILURE_WINDOW = 15 * 60.0  # seconds: a counter lives this long from its first failure
ADDRESS = "address"
USERNAME = "user name"
_PREFIX = "smtpauth"
_WARN_EVERY = 60.0
_LEARNT_MAX = 10_000  # lockouts remembered for the connection check (the cache has them all)


def _share(total: int, processes: int) -> int:
    return max(1, total // processes) if total > 0 else 0


class AuthFailures:
    """Failures (and reservations) per key in a sliding window, in this process's
    memory: the fallback when the cache is down. Thread-safe."""

    def __init__(self, limit: int, window: float = AUTH_FAILURE_WINDOW) -> None:
        self.limit = limit
        self.window = window
        self._times: dict[str, deque[float]] = {}
        self._lock = threading.Lock()

    def _recent(self, key: str, now: float) -> deque[float] | None:
        times = self._times.get(key)
        if times is None:
            return None
        while times and times[0] <= now - self.window:
            times.popleft()
        if not times:
            del self._times[key]
            return None
        return times

    def locked_out(self, key: str, now: float | None = None) -> bool:
        if self.limit <= 0:
            return False
        with self._lock:
            times = self._recent(key, time.monotonic() if now is None else now)
            return times is not None and len(times) >= self.limit

    def add(self, key: str, now: float | None = None) -> bool:
        """Count one failure; True if the key is now refused."""
        self.reserve(key, now)
        return self.locked_out(key, now)

    def reserve(self, key: str, now: float | None = None) -> bool:
        """Count one attempt unless the key is at its limit; False (nothing counted) then."""
        if self.limit <= 0:
            return True
        now = time.monotonic() if now is None else now
        with self._lock:
            times = self._recent(key, now) or self._times.setdefault(key, deque())
            if len(times) >= self.limit:
                return False
            times.append(now)
            return True

    def release(self, key: str) -> None:
        """Give back the latest attempt counted for ``key`` (it succeeded)."""
        with self._lock:
            times = self._times.get(key)
            if times:
                times.pop()
                if not times:
                    del self._times[key]


@dataclass(frozen=True)
class Reservation:
    """An attempt counted against both limits; ``shared``: in the cache (else in memory)."""

    address: str
    username: str
    shared: bool


class AuthLimiter:
    """The AUTH limits of one ingress process: ``per_address`` failures from a client
    address (an IPv6 /64) and ``per_user`` for one username (0 = no limit)."""

    def __init__(
        self,
        per_address: int,
        per_user: int,
        *,
        window: float = AUTH_FAILURE_WINDOW,
        processes: int = 1,
    ) -> None:
        self.per_address = per_address
        self.per_user = per_user
        self.window = window
        self._local = {
            ADDRESS: AuthFailures(_share(per_address, processes), window),
            USERNAME: AuthFailures(_share(per_user, processes), window),
        }
        self._locked: dict[str, float] = {}  # address → until (time.time()), as learnt
        self._warned = 0.0

    # --- on the event loop

    def locked_out(self, address: str) -> bool:
        """Is this address refused, as far as this process knows (no cache call)?"""
        until = self._locked.get(address)
        if until is None:
            return self._local[ADDRESS].locked_out(address)
        if until > time.time():
            return True
        self._locked.pop(address, None)
        return False

    # --- in a database thread

    def reserve(self, address: str, username: str) -> Reservation | str:
        """Count one attempt against both limits before its password is checked:
        the Reservation, or what is locked (``ADDRESS`` or ``USERNAME``), nothing counted."""
        try:
            return self._reserve_shared(address, username)
        except Exception:  # noqa: BLE001 - a broken cache must not open or close AUTH
            self._warn("AUTH limits: cache unavailable, counting in this process only")
        return self._reserve_local(address, username)

    def release(self, reservation: Reservation) -> None:
        """The attempt succeeded (or could not be checked): it is no failure."""
        if not reservation.shared:
            self._local[ADDRESS].release(reservation.address)
            self._local[USERNAME].release(_user_key(reservation.username))
            return
        try:
            for _kind, key, limit in self._counters(reservation.address, reservation.username):
                if limit > 0:
                    _decr(key)
        except Exception:  # noqa: BLE001
            self._warn("AUTH limits: cache unavailable, a success was not given back")

    def failed(self, reservation: Reservation) -> str | None:
        """The attempt failed (its reservation stays): what it locked, if it reached a limit."""
        if not reservation.shared:
            for kind, key in ((ADDRESS, reservation.address), (USERNAME, reservation.username)):
                local_key = key if kind == ADDRESS else _user_key(key)
                if self._local[kind].locked_out(local_key):
                    return kind
            return None
        try:
            for kind, key, limit in self._counters(reservation.address, reservation.username):
                count = cache.get(key)
                if limit > 0 and count is not None and int(count) >= limit:
                    if kind == ADDRESS:
                        self._learn(reservation.address, key)
                    return kind
        except Exception:  # noqa: BLE001
            self._warn("AUTH limits: cache unavailable")
        return None

    def forget(self, address: str = "", username: str = "") -> None:
        """Lift the counts of an address and/or a username (tests, administrators)."""
        keys = []
        if address:
            keys.append(_key(ADDRESS, address))
            self._locked.pop(address, None)
            self._local[ADDRESS]._times.pop(address, None)
        if username:
            keys.append(_key(USERNAME, username))
            self._local[USERNAME]._times.pop(_user_key(username), None)
        if keys:
            cache.delete_many(keys + [f"{k}:until" for k in keys])

    # --- internals

    def _counters(self, address: str, username: str) -> list[tuple[str, str, int]]:
        return [
            (ADDRESS, _key(ADDRESS, address), self.per_address),
            (USERNAME, _key(USERNAME, username), self.per_user),
        ]

    def _reserve_shared(self, address: str, username: str) -> Reservation | str:
        counted: list[str] = []
        try:
            for kind, key, limit in self._counters(address, username):
                if limit <= 0:
                    continue
                count = _incr(key, self.window)
                counted.append(key)
                if count > limit:
                    for done in counted:  # refused: counts as nothing
                        _decr(done)
                    counted.clear()
                    if kind == ADDRESS:
                        self._learn(address, key)
                    return kind
        except Exception:
            for done in counted:
                try:
                    _decr(done)
                except Exception:  # noqa: BLE001 - the cache is down: nothing to undo
                    break
            raise
        return Reservation(address, username, shared=True)

    def _reserve_local(self, address: str, username: str) -> Reservation | str:
        if not self._local[ADDRESS].reserve(address):
            return ADDRESS
        if not self._local[USERNAME].reserve(_user_key(username)):
            self._local[ADDRESS].release(address)
            return USERNAME
        return Reservation(address, username, shared=False)

    def _learn(self, address: str, key: str) -> None:
        """Remember until when ``address`` is refused, for ``locked_out`` at connect."""
        until = cache.get(f"{key}:until")
        now = time.time()
        if len(self._locked) >= _LEARNT_MAX:  # many guessers: forget the lockouts over
            for old in [a for a, t in list(self._locked.items()) if t <= now]:
                self._locked.pop(old, None)
        if len(self._locked) < _LEARNT_MAX:
            self._locked[address] = float(until) if until is not None else now + self.window

    def _warn(self, text: str) -> None:
        now = time.monotonic()
        if now - self._warned >= _WARN_EVERY or not self._warned:
            self._warned = now
            log.warning(text, exc_info=True)


def _user_key(username: str) -> str:
    return hashlib.sha256(username.encode("utf-8", "surrogatepass")).hexdigest()[:32]


def _key(kind: str, value: str) -> str:
    part = f"a:{value}" if kind == ADDRESS else f"u:{_user_key(value)}"
    return f"{_PREFIX}:{part}"


def _incr(key: str, window: float) -> int:
    """Atomic increment of a counter that lives ``window`` from its first count."""
    timeout = max(1, int(window))
    if cache.add(key, 0, timeout=timeout):
        cache.set(f"{key}:until", time.time() + timeout, timeout=timeout)
    try:
        count = cache.incr(key)
    except ValueError:  # expired between add and incr
        cache.add(key, 0, timeout=timeout)
        count = cache.incr(key)
    if count == 1:
        # Redis INCR re-creates a key that expired just before it without a
        # timeout: make sure the window is set (a counter must never live forever).
        cache.touch(key, timeout=timeout)
    return count


def _decr(key: str) -> None:
    with contextlib.suppress(ValueError):  # expired meanwhile: nothing to give back
        cache.decr(key)


@dataclass(frozen=True)
class Outcome:
    """One AUTH: the grant, or ``refused`` (locked: the password was not checked),
    or a failure, with ``locked`` when it reached a limit."""

    grant: accounts.Grant | None = None
    refused: str | None = None
    locked: str | None = None


def attempt(limiter: AuthLimiter, address: str, username: str, password: str) -> Outcome:
    """Runs in a database thread: reserve, check the password, settle the reservation."""
    reservation = limiter.reserve(address, username)
    if isinstance(reservation, str):
        return Outcome(refused=reservation)
    try:
        grant = accounts.authenticate(username, password)
    except BaseException:
        limiter.release(reservation)  # not checked: no failure
        raise
    if grant is not None:
        limiter.release(reservation)
        return Outcome(grant=grant)
    return Outcome(locked=limiter.failed(reservation))
