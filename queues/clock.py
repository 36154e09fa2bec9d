"""The one clock. Every "now" in mailrelay comes from here so tests can move time.

Retry schedules span days; tests move this clock instead of sleeping. The
offset is process-local: code that runs in other processes (a real Celery
worker) sees real time.
"""

from __future__ import annotations

from datetime import datetime, timedelta

from django.utils import timezone

_offset = timedelta(0)


def now() -> datetime:
    return timezone.now() + _offset


def advance(delta: timedelta) -> None:
    """Move the clock forward (tests only)."""
    global _offset
    _offset += delta


def reset() -> None:
    global _offset
    _offset = timedelta(0)
