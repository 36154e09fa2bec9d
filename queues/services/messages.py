"""Message-level state changes shared by the categorizer, delivery and the sweep."""

from __future__ import annotations

from collections.abc import Iterable
from datetime import datetime

from django.db.models import Exists, OuterRef

from queues.models import (
    FINAL_RECIPIENT_STATES,
    Message,
    MessageState,
    Recipient,
)


def messages_finish(message_ids: Iterable[int], now: datetime) -> int:
    """Mark done the messages whose every recipient reached a final state."""
    pending = Recipient.objects.filter(message=OuterRef("pk")).exclude(
        state__in=FINAL_RECIPIENT_STATES
    )
    return (
        Message.objects.filter(id__in=list(message_ids))
        .exclude(state=MessageState.DONE)
        .exclude(Exists(pending))
        .update(state=MessageState.DONE, completed_at=now, lease_owner="", lease_until=None)
    )
