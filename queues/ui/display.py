"""Pure helpers that turn queue-store values into what the Queue Viewer shows."""

from __future__ import annotations

from datetime import datetime, timedelta

from queues.lib import format_duration


def _duration(delta: timedelta) -> str:
    """'45 s', '12 min', '3 h 5 min', '2 d 4 h' (the sign is the caller's: 'in', 'ago')."""
    return format_duration(abs(delta), units=2, spaced=True)


def relative_text(when: datetime | None, now: datetime) -> str:
    """'in 4 min', '3 min ago', 'now'; '' for no time."""
    if when is None:
        return ""
    delta = when - now
    if abs(delta) < timedelta(seconds=1):
        return "now"
    text = _duration(delta)
    return f"in {text}" if delta > timedelta(0) else f"{text} ago"


def age_text(since: datetime | None, now: datetime) -> str:
    return "" if since is None else _duration(now - since)


def size_text(size: int | None) -> str:
    if size is None:
        return ""
    if size < 1024:
        return f"{size} B"
    if size < 1024 * 1024:
        return f"{size / 1024:.1f} KB"
    return f"{size / (1024 * 1024):.1f} MB"


def rate_text(per_minute: float | None) -> str:
    """A message rate per minute: '0', '0.4/min', '37/min'."""
    if not per_minute:
        return "0"
    if per_minute >= 10:
        return f"{per_minute:.0f}/min"
    return f"{per_minute:.1f}/min"


def visible_text(text: str) -> str:
    """Control characters (other than line breaks and tabs) spelled out, for a <pre>.

    Auto-escaping keeps the markup inert; this keeps the text readable.
    """
    return "".join(
        ch if ch in "\n\t" or (ch >= " " and ch != "\x7f") else f"\\x{ord(ch):02x}"
        for ch in text.replace("\r\n", "\n")
    )
