"""Pure helpers that turn queue-store values into what the Queue Viewer shows."""

from __future__ import annotations

import re
from datetime import datetime, timedelta

_EMAIL = re.compile(r"<?[^\s<>@]+@[^\s<>]+>?")
_IPV6 = re.compile(r"\[?\b(?:[0-9a-f]{0,4}:){2,7}[0-9a-f]{0,4}\b\]?", re.IGNORECASE)
_IPV4 = re.compile(r"\[?\b\d{1,3}(?:\.\d{1,3}){3}\b\]?(?::\d+)?")
# Queue ids, message ids, hex digests: a word of 6+ characters with a digit in it.
_ID = re.compile(r"\b(?=[\w.-]*\d)[\w.-]{6,}\b")
_NUMBER = re.compile(r"\d+")
_SPACE = re.compile(r"\s+")


def normalise_error(text: str) -> str:
    """A last error with its variable parts stripped, so equal causes group together.

    Steps: drop addresses, IP literals (with their port), ids (words of six
    or more characters that contain a digit), then any number left; squeeze
    white space. The reply code and enhanced code are shown apart, so they
    are not part of the text.
    """
    out = _EMAIL.sub("<address>", text)
    out = _IPV6.sub("<ip>", out)
    out = _IPV4.sub("<ip>", out)
    out = _ID.sub("<id>", out)
    out = _NUMBER.sub("#", out)
    return _SPACE.sub(" ", out).strip()


def search_fragment(normalised: str) -> str:
    """The longest literal part of a normalised error: a text filter that finds its messages."""
    parts = re.split(r"<address>|<ip>|<id>|#", normalised)
    best = max((p.strip(" :;,.()[]") for p in parts), key=len, default="")
    return best


def duration_text(delta: timedelta) -> str:
    """'45 s', '12 min', '3 h 5 min', '2 d 4 h'."""
    seconds = int(abs(delta.total_seconds()))
    if seconds < 60:
        return f"{seconds} s"
    minutes = seconds // 60
    if minutes < 60:
        return f"{minutes} min"
    hours, minutes = divmod(minutes, 60)
    if hours < 24:
        return f"{hours} h {minutes} min" if minutes else f"{hours} h"
    days, hours = divmod(hours, 24)
    return f"{days} d {hours} h" if hours else f"{days} d"


def relative_text(when: datetime | None, now: datetime) -> str:
    """'in 4 min', '3 min ago', 'now', '' for no time."""
    if when is None:
        return ""
    delta = when - now
    if abs(delta) < timedelta(seconds=1):
        return "now"
    text = duration_text(delta)
    return f"in {text}" if delta > timedelta(0) else f"{text} ago"


def age_text(since: datetime | None, now: datetime) -> str:
    return "" if since is None else duration_text(now - since)


def size_text(size: int | None) -> str:
    if size is None:
        return ""
    if size < 1024:
        return f"{size} B"
    if size < 1024 * 1024:
        return f"{size / 1024:.1f} KB"
    return f"{size / (1024 * 1024):.1f} MB"


def rate_text(per_minute: float | None) -> str:
    if not per_minute:
        return "0"
    if per_minute >= 10:
        return f"{per_minute:.0f}/min"
    return f"{per_minute:.1f}/min"


def safe_preview(data: bytes, limit: int = 64 * 1024) -> tuple[str, bool]:
    """The body as text for an escaped <pre>: decoded leniently, control characters shown.

    Returns the text and whether it was cut at ``limit`` bytes. The caller
    relies on template auto-escaping: the text is never marked safe.
    """
    cut = len(data) > limit
    text = data[:limit].decode("utf-8", "replace").replace("\r\n", "\n")
    text = "".join(
        ch if ch in "\n\t" or ch >= " " and ch != "\x7f" else f"\\x{ord(ch):02x}" for ch in text
    )
    return text, cut
