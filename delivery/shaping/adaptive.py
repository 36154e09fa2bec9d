"""Adaptive shaping: which replies mean "slow down", and how limits read now.

A throttling reply is a 421 (the peer closes: too many connections or
messages), any 4xx with an enhanced code 4.7.x (RFC 3463 security or policy
status, used by the big providers for rate limits), or a 4xx containing one
of the entry's ``on_throttle.texts``. Only a reply from one of the entry's
own hosts counts (``gate.speaking_hosts``). Such a reply multiplies the entry's
factor by ``on_throttle.factor`` (halves it by default, down to
``min_factor``); after a cool-down without another, each round that
delivered something takes one step back up (``limiter._RELEASE``).
"""

from __future__ import annotations

from collections.abc import Collection, Iterable
from datetime import UTC, datetime

from delivery.shaping.limiter import Status
from delivery.shaping.policy import Entry, Throttle
from delivery.smtp.types import BatchResult


def is_throttle(code: int | None, enhanced: str, text: str, texts: Iterable[str] = ()) -> bool:
    if code is None or not 400 <= code < 500:
        return False  # only what a peer said; our own 4.7.5 (TLS policy) has no code
    if code == 421 or enhanced.startswith("4.7."):
        return True
    lowered = text.lower()
    return any(t in lowered for t in texts)


def speaks(host: str, hosts: Collection[str] | None) -> bool:
    """Whether a reply from ``host`` (the host the connection went to) speaks
    for the entry: ``hosts`` None means every host does."""
    return hosts is None or host.lower().rstrip(".") in hosts


def throttle_reason(
    batch: BatchResult, throttle: Throttle, hosts: Collection[str] | None = None
) -> str:
    """The first throttling reply of a round from one of ``hosts`` (None: from
    any host), as "421 4.7.0 text", or ""."""
    if not throttle.enabled:
        return ""
    for f in batch.host_failures:
        if not speaks(f.host, hosts):
            continue
        enhanced = f.text.split(" ", 1)[0] if f.text[:2] == "4." else ""
        if is_throttle(f.code, enhanced, f.text, throttle.texts):
            return f"{f.code} {f.text}".strip()
    for r in batch.results:
        if speaks(r.host, hosts) and is_throttle(r.code, r.enhanced, r.text, throttle.texts):
            return " ".join(x for x in (str(r.code), r.enhanced, r.text) if x)
    return ""


def describe(entry: Entry, status: Status | None) -> str:
    """The effective limits now and why, for the queue list and the command:
    "1 conn, 5/min messages (x0.5 after 421 4.7.0 slow down at 10:32)"."""
    factor = status.factor if status else 1.0
    conns = max(1, int(entry.max_connections * factor))
    parts = [f"{conns} conn", f"{entry.max_messages_per_connection} msg/conn"]
    if entry.max_message_rate:
        parts.append(f"{entry.max_message_rate.scaled(factor)} messages")
    if entry.max_connection_rate:
        parts.append(f"{entry.max_connection_rate.scaled(factor)} connections")
    text = ", ".join(parts)
    if status and factor < 1:
        how = "halved" if factor == 0.5 else f"x{factor:g}"
        at = ""
        if status.throttled_at:
            at = " at " + datetime.fromtimestamp(status.throttled_at, UTC).strftime("%H:%M UTC")
        text += f" ({how} after {status.reason}{at}"
        if status.since and status.throttled_at and status.since > status.throttled_at:
            text += ", recovering"
        text += ")"
    return text
