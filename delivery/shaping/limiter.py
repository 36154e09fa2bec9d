"""Shared shaping counters in Redis: connection slots, rate windows, adaptive state.

Every key of one scope (an entry's name, or ``link:<id>`` for the default
entry, which limits each next hop on its own) lives under
``mailrelay:shaping:<scope>:``:

- ``slots``: a sorted set of connection slots, scored by their lease end. A
  slot of a killed worker is not renewed and counts no more once its lease
  has passed (each acquire drops expired slots first): kill -9 leaks nothing.
- ``msgs`` / ``conns``: sliding windows of the messages and connections
  granted, scored by when (at most N in any period).
- ``adaptive``: the current factor (1 = the entry's limits), since when, why.
- ``waiters``: links refused (a slot or a rate), rung when a slot is released.
- ``wake``: set while the countdown wake-up after a rate refusal is pending
  (one per scope: the link it wakes rings the other waiters when it is done).

Each step is one Lua script, so workers on any host see one consistent
state; the time comes from the caller (``queues.lib.clock``: hosts keep their
clocks in sync, as the database leases need already).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from functools import lru_cache

import redis

from queues.config import once_per_process

log = logging.getLogger(__name__)

PREFIX = "mailrelay:shaping:"
# How long a scope's keys outlive their last use.
KEY_TTL_MS = 2 * 86400 * 1000

_ACQUIRE = """
local now = tonumber(ARGV[1])
local lease = tonumber(ARGV[2])
local token = ARGV[3]
local max_conns = tonumber(ARGV[4])
local mpc = tonumber(ARGV[5])
local want = tonumber(ARGV[6])
local msg_count = tonumber(ARGV[7])
local msg_period = tonumber(ARGV[8])
local conn_count = tonumber(ARGV[9])
local conn_period = tonumber(ARGV[10])
local waiter = ARGV[11]
local ttl = tonumber(ARGV[12])
local factor = tonumber(redis.call('HGET', KEYS[4], 'factor') or '1')
local function eff(n)
  local v = math.floor(n * factor)
  if v < 1 then v = 1 end
  return v
end
local function refuse(why, wait)
  -- Rung by the next release of a slot of this scope (whatever kept it out).
  redis.call('SADD', KEYS[5], waiter)
  redis.call('PEXPIRE', KEYS[5], math.ceil(math.max(lease, wait) * 2000))
  -- A rate frees itself at a known time: one countdown doorbell per scope
  -- (the link it rings releases its slots, which rings the other waiters).
  local ring = 0
  if why ~= 'connections' and wait > 0
     and redis.call('SET', KEYS[6], waiter, 'NX', 'PX', math.ceil(wait * 1000)) then
    ring = 1
  end
  return {0, 0, tostring(wait), why, tostring(factor), ring}
end
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
local free = eff(max_conns) - redis.call('ZCARD', KEYS[1])
if free <= 0 then
  local first = redis.call('ZRANGE', KEYS[1], 0, 0, 'WITHSCORES')
  return refuse('connections', tonumber(first[2]) - now)
end
local msgs = want
if msg_count > 0 then
  redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', now - msg_period)
  local left = eff(msg_count) - redis.call('ZCARD', KEYS[2])
  if left <= 0 then
    local oldest = redis.call('ZRANGE', KEYS[2], 0, 0, 'WITHSCORES')
    return refuse('message rate', tonumber(oldest[2]) + msg_period - now)
  end
  if left < msgs then msgs = left end
end
local conns = math.ceil(msgs / mpc)
if conns > free then conns = free end
if conn_count > 0 then
  redis.call('ZREMRANGEBYSCORE', KEYS[3], '-inf', now - conn_period)
  local left = eff(conn_count) - redis.call('ZCARD', KEYS[3])
  if left <= 0 then
    local oldest = redis.call('ZRANGE', KEYS[3], 0, 0, 'WITHSCORES')
    return refuse('connection rate', tonumber(oldest[2]) + conn_period - now)
  end
  if left < conns then conns = left end
end
if msgs > conns * mpc then msgs = conns * mpc end
for i = 1, conns do
  redis.call('ZADD', KEYS[1], now + lease, token .. ':s' .. i)
  if conn_count > 0 then redis.call('ZADD', KEYS[3], now, token .. ':c' .. i) end
end
if msg_count > 0 then
  for i = 1, msgs do redis.call('ZADD', KEYS[2], now, token .. ':m' .. i) end
end
for i = 1, 3 do redis.call('PEXPIRE', KEYS[i], ttl) end
return {conns, msgs, '0', '', tostring(factor), 0}
"""

_RELEASE = """
local now = tonumber(ARGV[1])
local token = ARGV[2]
local conns = tonumber(ARGV[3])
local throttled = ARGV[4] == '1'
local reason = ARGV[5]
local delivered = ARGV[6] == '1'
local step = tonumber(ARGV[7])
local cooldown = tonumber(ARGV[8])
local min_factor = tonumber(ARGV[9])
local ttl = tonumber(ARGV[10])
for i = 1, conns do redis.call('ZREM', KEYS[1], token .. ':s' .. i) end
local factor = tonumber(redis.call('HGET', KEYS[2], 'factor') or '1')
if throttled then
  local f = factor * step
  if f < min_factor then f = min_factor end
  redis.call('HSET', KEYS[2], 'factor', tostring(f), 'since', tostring(now),
             'throttled_at', tostring(now), 'reason', reason)
  redis.call('PEXPIRE', KEYS[2], ttl)
elseif delivered and factor < 1 then
  local since = tonumber(redis.call('HGET', KEYS[2], 'since') or '0')
  if now - since >= cooldown then
    local f = factor / step
    if f >= 0.999 then
      redis.call('DEL', KEYS[2])
    else
      redis.call('HSET', KEYS[2], 'factor', tostring(f), 'since', tostring(now))
    end
  end
end
return redis.call('SPOP', KEYS[3], 100)
"""

_RENEW = """
local n = 0
for i = 3, #ARGV do
  n = n + redis.call('ZADD', KEYS[1], 'XX', 'CH', ARGV[1], ARGV[2] .. ':s' .. ARGV[i])
end
return n
"""


@dataclass(frozen=True)
class Grant:
    """What one acquire gave: ``connections`` slots and ``messages`` sends
    (0 and 0: not now, for ``wait`` seconds, because of ``why``)."""

    connections: int
    messages: int
    wait: float
    why: str
    factor: float
    ring_later: bool  # this caller should schedule the wake-up


@dataclass(frozen=True)
class Status:
    factor: float
    since: float | None
    throttled_at: float | None
    reason: str
    connections: int
    messages_in_window: int
    connections_in_window: int


def keys(scope: str) -> dict[str, str]:
    base = f"{PREFIX}{scope}:"
    return {k: base + k for k in ("slots", "msgs", "conns", "adaptive", "waiters", "wake")}


class Limiter:
    def __init__(self, client: redis.Redis) -> None:
        self.client = client
        self._acquire = client.register_script(_ACQUIRE)
        self._release = client.register_script(_RELEASE)
        self._renew = client.register_script(_RENEW)

    def acquire(
        self,
        scope: str,
        *,
        now: float,
        lease: float,
        token: str,
        max_connections: int,
        messages_per_connection: int,
        want: int,
        message_rate: tuple[int, float] | None,
        connection_rate: tuple[int, float] | None,
        waiter: str,
    ) -> Grant:
        k = keys(scope)
        mr = message_rate or (0, 0.0)
        cr = connection_rate or (0, 0.0)
        conns, msgs, wait, why, factor, ring = self._acquire(
            keys=[k["slots"], k["msgs"], k["conns"], k["adaptive"], k["waiters"], k["wake"]],
            args=[
                repr(now),
                repr(lease),
                token,
                max_connections,
                max(1, messages_per_connection),
                max(0, want),
                mr[0],
                repr(mr[1]),
                cr[0],
                repr(cr[1]),
                waiter,
                KEY_TTL_MS,
            ],
        )
        return Grant(
            int(conns),
            int(msgs),
            max(0.0, float(wait)),
            _text(why),
            float(factor),
            bool(ring),
        )

    def refund(self, scope: str, token: str, grant: Grant, connections: int, messages: int) -> None:
        """Give back what a round was granted but will not use."""
        k = keys(scope)
        pipe = self.client.pipeline(transaction=False)
        spare = range(connections + 1, grant.connections + 1)
        if spare:
            pipe.zrem(k["slots"], *(f"{token}:s{i}" for i in spare))
            pipe.zrem(k["conns"], *(f"{token}:c{i}" for i in spare))
        extra = range(messages + 1, grant.messages + 1)
        if extra:
            pipe.zrem(k["msgs"], *(f"{token}:m{i}" for i in extra))
        if spare or extra:
            pipe.execute()

    def renew(self, scope: str, token: str, connections: int, until: float) -> None:
        if connections:
            self._renew(
                keys=[keys(scope)["slots"]],
                args=[repr(until), token, *range(1, connections + 1)],
            )

    def release(
        self,
        scope: str,
        token: str,
        connections: int,
        *,
        now: float,
        throttled: str,
        delivered: bool,
        step: float,
        cooldown: float,
        min_factor: float,
    ) -> list[str]:
        """Free the round's slots, adapt the factor; returns the links waiting for a slot."""
        k = keys(scope)
        waiters = self._release(
            keys=[k["slots"], k["adaptive"], k["waiters"]],
            args=[
                repr(now),
                token,
                connections,
                "1" if throttled else "0",
                throttled[:200],
                "1" if delivered else "0",
                repr(step),
                repr(cooldown),
                repr(min_factor),
                KEY_TTL_MS,
            ],
        )
        return [_text(w) for w in waiters or []]

    def status(self, scope: str, now: float, periods: tuple[float, float]) -> Status:
        k = keys(scope)
        pipe = self.client.pipeline(transaction=False)
        pipe.hgetall(k["adaptive"])
        pipe.zcount(k["slots"], f"({now!r}", "+inf")
        pipe.zcount(k["msgs"], f"({now - periods[0]!r}", "+inf")
        pipe.zcount(k["conns"], f"({now - periods[1]!r}", "+inf")
        adaptive, slots, msgs, conns = pipe.execute()
        return _status(adaptive, slots, msgs, conns)

    def adaptive_many(self, scopes: list[str]) -> dict[str, Status]:
        """The adaptive state of many scopes in one round trip (the queue list)."""
        pipe = self.client.pipeline(transaction=False)
        for scope in scopes:
            pipe.hgetall(keys(scope)["adaptive"])
        return {s: _status(a, 0, 0, 0) for s, a in zip(scopes, pipe.execute(), strict=True)}


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _status(adaptive: dict, slots: int, msgs: int, conns: int) -> Status:
    a = {_text(k): _text(v) for k, v in (adaptive or {}).items()}
    return Status(
        factor=float(a.get("factor", 1)),
        since=float(a["since"]) if "since" in a else None,
        throttled_at=float(a["throttled_at"]) if "throttled_at" in a else None,
        reason=a.get("reason", ""),
        connections=int(slots),
        messages_in_window=int(msgs),
        connections_in_window=int(conns),
    )


@lru_cache(maxsize=4)
def _limiter_for(url: str) -> Limiter:
    return Limiter(
        redis.Redis.from_url(
            url, socket_timeout=2, socket_connect_timeout=2, health_check_interval=30
        )
    )


@once_per_process
def limiter() -> Limiter | None:
    """The limiter on the broker's Redis; None when the broker is not Redis (read
    once per process: ``queues.config``)."""
    from django.conf import settings

    url = settings.CELERY_BROKER_URL
    if not url.startswith(("redis://", "rediss://")):
        return None
    return _limiter_for(url)


_warned_at = 0.0


def warn_unavailable(exc: Exception) -> None:
    """Log that Redis is away, at most once a minute."""
    global _warned_at
    if time.monotonic() - _warned_at > 60:
        _warned_at = time.monotonic()
        log.warning(
            "shaping counters unavailable (%s): delivering with the entry's per-link "
            "limits, without shared counters, until Redis is back",
            exc,
        )
