"""Retry one message now (Postfix's ``postqueue -i``): the core the message
action ``retry`` runs, singly and in bulk (queues.services.actions).

For each message, in the caller's transaction, under its row locks:
- its recipients waiting in a delivery queue are due now, and the retry time
  of their links is cleared (a link in Retry is tried now; when the try fails
  the delivery sets a new one from now, as a queue's retry does); the other
  recipients of those links keep their own next attempt;
- its recipients in Unreachable are routed again now (back to the categorizer);
- a message waiting for the categorizer (a routing retry) is due now.

A suspended message (Poison's too), a finished one, one being routed, one
already due, and recipients in a suspended queue are left alone:
``retry_selection`` says which messages it changes, and the preview counts
exactly those.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime

from django.db.models import Exists, OuterRef, Q, QuerySet

from queues.lib import clock
from queues.models import (
    WAITING_RECIPIENT_STATES,
    DeliveryType,
    Link,
    Message,
    MessageState,
    Recipient,
)


def _retryable_recipients() -> Q:
    """Recipients a retry makes due: waiting in a queue that is not suspended,
    not Poison nor Dead-letter (no next hop there)."""
    return Q(state__in=WAITING_RECIPIENT_STATES, queue__suspended=False) & ~Q(
        queue__delivery_type__in=(DeliveryType.POISON, DeliveryType.DEAD_LETTER)
    )


def retry_selection(qs: QuerySet[Message], now: datetime | None = None) -> QuerySet[Message]:
    """The messages of a selection that a retry changes: one waiting for the
    categorizer's retry, or with a recipient not due yet in a delivery queue, or
    waiting in Unreachable (a message that is due already is left as it is)."""
    now = now or clock.now()
    not_due = Q(next_attempt_at__gt=now) | Q(queue__delivery_type=DeliveryType.UNREACHABLE)
    waiting = Exists(
        Recipient.objects.filter(_retryable_recipients(), not_due, message=OuterRef("pk"))
    )
    return qs.filter(suspended=False).filter(
        Q(state=MessageState.SUBMISSION, next_attempt_at__gt=now)
        | (Q(state=MessageState.QUEUED) & Q(waiting))
    )


def retry_now(message_ids: Sequence[int], now: datetime) -> tuple[int, set[int], bool]:
    """Make the messages due now. Returns (messages changed, links to ring,
    whether the categorizer has work)."""
    ids = list(
        retry_selection(Message.objects.filter(id__in=list(message_ids)), now).values_list(
            "id", flat=True
        )
    )
    if not ids:
        return 0, set(), False
    rows = Recipient.objects.filter(_retryable_recipients(), message_id__in=ids)
    unreachable = rows.filter(queue__delivery_type=DeliveryType.UNREACHABLE)
    unreachable.resubmit(now)
    delivery = rows.exclude(queue__delivery_type=DeliveryType.UNREACHABLE)
    links = set(delivery.exclude(queue__link__isnull=True).values_list("queue__link_id", flat=True))
    delivery.filter(next_attempt_at__gt=now).update(next_attempt_at=now)
    if links:
        Link.objects.filter(pk__in=links, next_retry_at__gt=now).update(next_retry_at=None)
    waiting_categorizer = Message.objects.filter(id__in=ids, state=MessageState.SUBMISSION)
    waiting_categorizer.filter(next_attempt_at__gt=now).update(next_attempt_at=now)
    return len(ids), links, waiting_categorizer.exists()


__all__ = ["retry_now", "retry_selection"]
