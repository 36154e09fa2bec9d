"""Where recipients are placed: delivery queues and their links, and the special queues."""

from __future__ import annotations

import json
from datetime import datetime
from typing import NamedTuple

from django.db import connection

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
            Queue.objects.filter(pk=queue.pk).learn_route(link.pk)
    elif not created and queue.link_id != link.pk:
        # Only while the queue is still not re-routed: a re-route committed since
        # we read the row keeps its override link (and learns the new route).
        if Queue.objects.filter(pk=queue.pk, reroute_to="").update(link=link):
            queue.link = link
        else:
            Queue.objects.filter(pk=queue.pk).learn_route(link.pk)
            queue.refresh_from_db(fields=["link", "reroute_to", "reroute_from"])
    return queue


class Placement(NamedTuple):
    """What the categorizer needs of a destination's queue."""

    queue_id: int
    link_id: int | None
    suspended: bool


# Both rows of a route as they stand, in one SELECT (the usual case: nothing to
# create or change).
_PG_ROUTE = (
    "SELECT q.id, q.link_id, q.suspended, q.reroute_to, q.reroute_from_id, l.id, l.hosts "
    "FROM queues_link AS l, queues_queue AS q "
    "WHERE l.name = %s AND q.delivery_type = %s AND q.name = %s"
)


def placement_for_route(
    delivery_type: str, queue_name: str, link_name: str, hosts: list[dict], now: datetime
) -> Placement:
    """``queue_for_route`` for the categorizer's hot path: on PostgreSQL one
    SELECT when the queue and its link exist and nothing needs changing, else
    ``queue_for_route`` itself."""
    if connection.vendor == "postgresql":
        with connection.cursor() as cur:
            cur.execute(_PG_ROUTE, [link_name, delivery_type, queue_name])
            row = cur.fetchone()
        if row is not None:
            qid, queue_link, suspended, reroute_to, reroute_from, link_id, stored = row
            if isinstance(stored, str):
                stored = json.loads(stored)
            settled = reroute_from == link_id if reroute_to else queue_link == link_id
            if stored == hosts and settled:
                return Placement(qid, queue_link, suspended)
    queue = queue_for_route(delivery_type, queue_name, link_name, hosts, now)
    return Placement(queue.pk, queue.link_id, queue.suspended)
