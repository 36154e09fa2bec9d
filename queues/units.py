"""Units: parsing and formatting durations and sizes, and seconds for the clients.

A leaf module (standard library only) like ``queues.domains``: the settings
(``mailrelay.env``), the queue store, the viewer and ``delivery`` all import
it, and it imports none of them, so ``queues`` needs nothing from
``mailrelay`` and the dependency arrows run one way.
"""

from __future__ import annotations

import re
from datetime import timedelta

_SIZE_UNITS = {
    "": 1,
    "B": 1,
    "K": 1024,
    "KB": 1024,
    "M": 1024**2,
    "MB": 1024**2,
    "G": 1024**3,
    "GB": 1024**3,
}
_DURATION_PART = re.compile(r"(\d+(?:\.\d+)?)([wdhms])")
_DURATION_UNITS = {"w": 604800, "d": 86400, "h": 3600, "m": 60, "s": 1}
# Exchange's TimeSpan notation: [d.]hh:mm:ss
_TIMESPAN = re.compile(r"^(?:(\d+)\.)?(\d{1,2}):(\d{2}):(\d{2})$")


def parse_size(text: str) -> int:
    """``35MB`` → 36700160; a bare number is bytes. Units are binary (K=1024)."""
    match = re.fullmatch(r"\s*(\d+)\s*([A-Za-z]*)\s*", text)
    if not match or match.group(2).upper() not in _SIZE_UNITS:
        raise ValueError(f"{text!r} is not a size (e.g. 35MB, 512K, 1048576)")
    return int(match.group(1)) * _SIZE_UNITS[match.group(2).upper()]


def parse_duration(text: str) -> timedelta:
    """Parse ``90s``, ``15m``, ``2h``, ``2d``, ``1h30m``, or Exchange's ``d.hh:mm:ss``."""
    text = text.strip()
    span = _TIMESPAN.match(text)
    if span:
        days, hours, minutes, seconds = (int(g or 0) for g in span.groups())
        if minutes > 59 or seconds > 59:
            raise ValueError(f"{text!r} is not a duration")
        return timedelta(days=days, hours=hours, minutes=minutes, seconds=seconds)
    if not text:
        raise ValueError("empty duration")
    pos = 0
    total = 0.0
    for match in _DURATION_PART.finditer(text):
        if match.start() != pos:
            break
        total += float(match.group(1)) * _DURATION_UNITS[match.group(2)]
        pos = match.end()
    if pos != len(text):
        raise ValueError(f"{text!r} is not a duration (e.g. 90s, 15m, 2h, 2d, 1h30m, 1.00:00:00)")
    return timedelta(seconds=total)


def seconds(value: timedelta | float | int) -> float:
    """``value`` as float seconds: a ``timedelta`` or a number of seconds
    (asyncio and dnspython want a float)."""
    return value.total_seconds() if isinstance(value, timedelta) else float(value)


_ZERO = timedelta(0)
_SECOND = timedelta(seconds=1)
# (seconds, compact label, spaced label), largest first.
_UNITS = ((86400, "d", "d"), (3600, "h", "h"), (60, "m", "min"), (1, "s", "s"))
_SECONDS = len(_UNITS) - 1


def format_duration(value: timedelta, *, units: int | None = None, spaced: bool = False) -> str:
    """A duration as text, in days, hours, minutes and seconds (no weeks).

    Exact by default, in Exim's notation (what ``parse_duration`` reads back):
    ``1d8h15m``, ``7h35m37.5s``, ``0s``, ``-15m``.

    ``units``: rounded down to that many units, counted from the largest that
    is not zero; units that are zero are left out, and seconds are shown only
    under a minute (past it they are noise). ``spaced``: for people, ``3 h 5
    min`` rather than ``3h5m``. The viewer's ages are ``units=2, spaced=True``
    (``45 s``, ``12 min``, ``3 h 5 min``, ``2 d 4 h``); the CLI's ``units=1``.
    """
    if value < _ZERO:
        return "-" + format_duration(-value, units=units, spaced=spaced)
    total = value / _SECOND
    rest = int(total)
    counts = []
    for size, _, _ in _UNITS:
        count, rest = divmod(rest, size)
        counts.append(count)
    first = next((i for i, count in enumerate(counts) if count), _SECONDS)
    if units is None:
        last, fraction = len(_UNITS), total - int(total)
    else:
        last, fraction = min(first + units, max(first + 1, _SECONDS)), 0.0
    parts = []
    for i in range(first, last):
        amount: float = counts[i] + (fraction if i == _SECONDS else 0)
        if amount:
            parts.append(f"{amount:g}" if amount != int(amount) else f"{int(amount)}")
            parts[-1] += " " + _UNITS[i][2] if spaced else _UNITS[i][1]
    if not parts:
        parts.append("0 s" if spaced else "0s")
    return (" " if spaced else "").join(parts)
