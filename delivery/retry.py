"""When to try again. The one place the retry schedule is decided.

This is the simple schedule of the relay core; the Exchange/Exim retry
policy replaces the bodies of these functions, not their callers.
"""

from __future__ import annotations

from datetime import datetime, timedelta

from django.conf import settings

# Exchange's glitch retry (1 min) first, then widening steps.
SIMPLE_SCHEDULE = (
    timedelta(minutes=1),
    timedelta(minutes=5),
    timedelta(minutes=15),
    timedelta(minutes=30),
    timedelta(hours=1),
)


def _step(count: int) -> timedelta:
    return SIMPLE_SCHEDULE[min(max(count, 1), len(SIMPLE_SCHEDULE)) - 1]


def recipient_retry_at(attempt_count: int, now: datetime) -> datetime:
    """Next try for a recipient deferred by its own (RCPT) or its message's failure."""
    return now + _step(attempt_count)


def link_retry_at(failure_count: int, now: datetime) -> datetime:
    """Next connection attempt for a next hop whose every host failed."""
    return now + _step(failure_count)


def categorizer_retry_at(now: datetime) -> datetime:
    """Next routing attempt after a temporary DNS failure (Unreachable queue)."""
    return now + settings.MAILRELAY_CATEGORIZER_RETRY_INTERVAL
