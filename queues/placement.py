"""The special queues (Unreachable, Poison, Dead-letter), where the categorizer,
the delivery and the sweep park recipients, and the parking of poison messages.
A destination's delivery queue and its link are the categorizer's
(``delivery.qmgr.tasks``)."""

from __future__ import annotations

from datetime import datetime

from django.db import transaction

from queues.config import store_settings
from queues.lib import clock
from queues.models import DeliveryType, Event, EventLevel, Message, Queue


def special_queue(delivery_type: str, now: datetime) -> Queue:
    """The Unreachable, Poison or Dead-letter queue (created on first use)."""
    queue, _ = Queue.objects.get_or_create(
        delivery_type=delivery_type,
        name=DeliveryType(delivery_type).label,
        defaults={"created_at": now},
    )
    return queue


def park_poison(message_ids: list[int]) -> None:
    """The poison rule's action (``transitions.poisoned`` says when): the messages
    suspended, their unfinished recipients parked in the Poison queue, an event
    each. The categorizer and the delivery round call it for what they claimed."""
    now = clock.now()
    poison = special_queue(DeliveryType.POISON, now)
    with transaction.atomic():
        Message.objects.filter(id__in=message_ids).park_in_poison(poison.pk)
        Event.objects.bulk_create(
            Event(
                created_at=now,
                level=EventLevel.ERROR,
                kind="poison",
                text="processing this message crashed a worker "
                f"{store_settings().poison_threshold} times; moved to the Poison queue",
                message_id=mid,
                queue=poison,
            )
            for mid in message_ids
        )
