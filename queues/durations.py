"""The one duration formatter, for the engine's rules and the operator's screens.

A leaf module (standard library only) like ``queues.domains``: the queue
store, the viewer and ``delivery`` all import it, and it imports neither.
Parsing is ``mailrelay.env.parse_duration``; this is its inverse and its
readable shortening.
"""

from __future__ import annotations

from datetime import timedelta

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
