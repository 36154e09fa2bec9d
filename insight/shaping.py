"""Is a link held back by traffic shaping right now? (explain's reason "shaping")

Reads, never writes, the shared counters the delivery round's limiter keeps in
Redis (``delivery.shaping.limiter``): the same checks, in the same order, as
its acquire script — a free connection slot, then the message rate, then the
connection rate, each scaled by the entry's adaptive factor — and says which
limit holds the link and when it frees (the first slot's lease end, or the
oldest send in the window plus the period). One Redis round trip per link;
nothing at all without a ``MAILRELAY_SHAPING`` file.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import redis

from delivery.shaping import gate
from delivery.shaping import limiter as limiter_module
from delivery.shaping.policy import Entry, Rate
from queues.models import Link

CONNECTIONS, MESSAGE_RATE, CONNECTION_RATE = "connections", "message rate", "connection rate"


@dataclass
class Hold:
    entry: str
    scope: str
    limit: str  # connections / message rate / connection rate
    limit_text: str  # "10/min", "5/min connections", "2 connections at once"
    in_use: int
    allowed: int
    factor: float
    next_at: datetime

    @property
    def text(self) -> str:
        return (
            f"Waiting for the shaping limit of entry {self.entry} ({self.limit_text}), "
            f"next at {self.next_at.isoformat()}."
        )

    def as_data(self) -> dict[str, Any]:
        return {
            "entry": self.entry,
            "scope": self.scope,
            "limit": self.limit,
            "limit_text": self.limit_text,
            "in_use": self.in_use,
            "allowed": self.allowed,
            "factor": self.factor,
            "next_at": self.next_at,
            "text": self.text,
        }


def _effective(n: int, factor: float) -> int:
    return max(1, math.floor(n * factor))  # as the acquire script scales a limit


def _when(score: float) -> datetime:
    return datetime.fromtimestamp(score, UTC)


def link_hold(link: Link, now: datetime) -> Hold | None:
    """The shaping limit holding ``link`` at ``now``, or None (no policy file,
    nothing used up, or Redis away: then the round goes on unshaped anyway)."""
    pol = gate.current()
    if pol is None:
        return None
    lim = limiter_module.limiter()
    if lim is None:
        return None
    entry: Entry = gate.entry_for(link, pol)
    scope = gate.scope_of(entry, link.pk)
    keys = limiter_module.keys(scope)
    t = now.timestamp()
    rates: list[tuple[str, str, Rate]] = []
    if entry.max_message_rate:
        rates.append((MESSAGE_RATE, keys["msgs"], entry.max_message_rate))
    if entry.max_connection_rate:
        rates.append((CONNECTION_RATE, keys["conns"], entry.max_connection_rate))
    try:
        pipe = lim.client.pipeline(transaction=False)
        pipe.hget(keys["adaptive"], "factor")
        pipe.zcount(keys["slots"], f"({t!r}", "+inf")
        pipe.zrangebyscore(keys["slots"], f"({t!r}", "+inf", start=0, num=1, withscores=True)
        for _, key, rate in rates:
            since = f"({t - rate.period!r}"
            pipe.zcount(key, since, "+inf")
            pipe.zrangebyscore(key, since, "+inf", start=0, num=1, withscores=True)
        answers = pipe.execute()
    except (redis.RedisError, OSError) as exc:
        limiter_module.warn_unavailable(exc)
        return None
    factor = float(answers[0] or 1)
    slots, first_slot = int(answers[1]), answers[2]
    allowed = _effective(entry.max_connections, factor)
    if slots >= allowed and first_slot:
        return Hold(
            entry.name,
            scope,
            CONNECTIONS,
            f"{allowed} connection{'s' if allowed != 1 else ''} at once",
            slots,
            allowed,
            factor,
            _when(first_slot[0][1]),
        )
    for i, (limit, _, rate) in enumerate(rates):
        used, oldest = int(answers[3 + 2 * i]), answers[4 + 2 * i]
        scaled = rate.scaled(factor)
        if used >= scaled.count and oldest:
            text = str(scaled) if limit == MESSAGE_RATE else f"{scaled} connections"
            return Hold(
                entry.name,
                scope,
                limit,
                text,
                used,
                scaled.count,
                factor,
                _when(oldest[0][1] + rate.period),
            )
    return None
