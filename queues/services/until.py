"""The end of a timed action, as an operator gives it and as the pages show it.

A leaf of the services (it imports none of them): the actions, the re-route
and the timed ends (``queues.services.timed``) all read it.
"""

from __future__ import annotations

from datetime import UTC, datetime

from django.utils.dateparse import parse_datetime

from queues.lib import format_duration, parse_duration
from queues.services.action_errors import ActionInvalid


def parse_until(text: str | datetime | None, now: datetime) -> datetime | None:
    """``until`` as an operator gives it: a duration from now (``90s``, ``2h``,
    ``1d``) or an ISO 8601 time (UTC when it names no zone); "" or None: no end.
    Raises ActionInvalid for anything else, or for a time not after ``now``."""
    if text is None or text == "":
        return None
    if isinstance(text, datetime):
        when = text
    else:
        text = text.strip()
        try:
            when = now + parse_duration(text)
        except ValueError:
            try:
                parsed = parse_datetime(text)
            except ValueError:
                parsed = None
            if parsed is None:
                raise ActionInvalid(
                    f"until: {text!r} is neither a duration (90s, 2h, 1d) "
                    "nor a time (2026-05-01T08:00:00Z)"
                ) from None
            when = parsed
    if when.tzinfo is None:
        when = when.replace(tzinfo=UTC)
    if when <= now:
        raise ActionInvalid(f"until: {when.isoformat()} is not in the future")
    return when


def until_text(until: datetime | None, now: datetime | None = None) -> str:
    """``until 2026-05-01 08:00:00 UTC`` (``(in 2h)`` with ``now``), "" for no end."""
    if until is None:
        return ""
    text = f"until {until.astimezone(UTC):%Y-%m-%d %H:%M:%S} UTC"
    if now is not None and until > now:
        text += f" (in {format_duration(until - now, units=2)})"
    return text
