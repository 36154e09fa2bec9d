"""The special queues (Unreachable, Poison, Dead-letter), where the categorizer,
the delivery and the sweep park recipients. A destination's
delivery queue and its link are the categorizer's (``delivery.qmgr.categorize``)."""

from __future__ import annotations

from datetime import datetime

from queues.models import DeliveryType, Queue


def special_queue(delivery_type: str, now: datetime) -> Queue:
    """The Unreachable, Poison or Dead-letter queue (created on first use)."""
    queue, _ = Queue.objects.get_or_create(
        delivery_type=delivery_type,
        name=DeliveryType(delivery_type).label,
        defaults={"created_at": now},
    )
    return queue
