"""Where recipients are placed: delivery queues and their links, and the special queues."""

from __future__ import annotations

from datetime import datetime

from queues.models import DeliveryType, Link, Queue


def special_queue(delivery_type: str, now: datetime) -> Queue:
    """The Unreachable, Poison or Dead-letter queue (created on first use)."""
    queue, _ = Queue.objects.get_or_create(
        delivery_type=delivery_type,
        name=DeliveryType(delivery_type).label,
        defaults={"created_at": now},
    )
    return queue


def queue_for_route(
    delivery_type: str, queue_name: str, link_name: str, hosts: list[dict], now: datetime
) -> Queue:
    """The delivery queue for a destination, attached to the link of its next hop.

    A destination whose next hop changed (new MX set, new transport) moves to
    the new link; the link's host list follows the latest routing answer.
    """
    link, created = Link.objects.get_or_create(
        name=link_name,
        defaults={"delivery_type": delivery_type, "hosts": hosts, "created_at": now},
    )
    if not created and link.hosts != hosts:
        Link.objects.filter(pk=link.pk).update(hosts=hosts)
    queue, created = Queue.objects.get_or_create(
        delivery_type=delivery_type,
        name=queue_name,
        defaults={"link": link, "created_at": now},
    )
    if not created and queue.reroute_to:
        # Re-routed by an operator (queues.services.reroute): the queue stays on
        # its override link; the route's link is where it returns at the end.
        if queue.reroute_from_id != link.pk:
            Queue.objects.filter(pk=queue.pk).update(reroute_from=link)
    elif not created and queue.link_id != link.pk:
        Queue.objects.filter(pk=queue.pk).update(link=link)
        queue.link = link
    return queue
