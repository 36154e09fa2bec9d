"""Message-level state changes shared by the categorizer, delivery and the sweep."""

from __future__ import annotations

from collections.abc import Iterable
from datetime import datetime

from queues.models import Message


def messages_finish(message_ids: Iterable[int], now: datetime) -> int:
    """Mark done the messages whose every recipient reached a final state."""
    return Message.objects.filter(id__in=list(message_ids)).finish(now)
