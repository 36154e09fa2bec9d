"""Re-route: an operator sends a queue's mail to another next hop for a while.

While ``Queue.reroute_to`` is set, the queue hangs on the link of that next
hop (a link of its own, found or created by its name, like a transport-map
entry's) instead of the link routing gave it, which is kept in
``Queue.reroute_from``. Deliveries claim recipients by link, so from the
commit on the new hop's delivery takes the queue's waiting mail and the old
hop's takes none; recipients a delivery holds already (ACTIVE) finish where
they are. The categorizer keeps new mail of the queue on the re-route
(``delivery.qmgr.tasks.queue_for_route``). At ``Queue.reroute_until`` the sweep ends it
(``queues.services.timed``), or an operator does (unroute): the queue goes
back to the link it came from and routing is normal again.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime

from django.db import transaction

from queues.models import (
    WAITING_RECIPIENT_STATES,
    DeliveryType,
    Event,
    EventLevel,
    Link,
    Queue,
    Recipient,
)
from queues.services.action_errors import ActionConflict, ActionInvalid
from queues.services.until import until_text
from queues.signals import categorizer_work, link_work

# Delivery types that have a next hop to replace.
REROUTABLE = (DeliveryType.DNS_MX, DeliveryType.TRANSPORT_MAP, DeliveryType.SMART_HOST)


def _ring(link_id: int | None) -> None:
    if link_id is not None:
        transaction.on_commit(lambda: link_work.send(sender=None, link_id=link_id))


def describe(queue: Queue, now: datetime | None = None) -> str:
    """Where a queue's mail goes now, for the audit log and the viewer."""
    if queue.reroute_to:
        return f"re-routed to {queue.reroute_to} {until_text(queue.reroute_until, now)}".strip()
    link = queue.link.name if queue.link_id and queue.link else "no link"
    return f"routed to {link}"


@dataclass(frozen=True)
class NextHopRoute:
    """Where a re-routed queue's mail goes: the link of exactly these hosts."""

    link_name: str
    delivery_type: str
    hosts: list[dict]


# The engine's router, plugged in when the apps are ready (delivery.apps): the
# store resolves no next hop itself. ``route_resolver(spec, queue_name)`` raises
# ValueError saying why a spec cannot be used.
route_resolver: Callable[[str, str], NextHopRoute] | None = None


def _override_link(queue: Queue, to: str, now: datetime) -> Link:
    if route_resolver is None:
        raise ActionConflict("no router is loaded to resolve the next hop")
    try:
        route = route_resolver(to, queue.name)
    except ValueError as exc:
        raise ActionInvalid(f"to: {exc}") from None
    hosts = route.hosts
    link, created = Link.objects.get_or_create(
        name=route.link_name,
        defaults={"delivery_type": route.delivery_type, "hosts": hosts, "created_at": now},
    )
    if not created and link.hosts != hosts:
        Link.objects.filter(pk=link.pk).update(hosts=hosts)
    return link


def start(queue: Queue, now: datetime, *, to: str, until: datetime | None, by: str) -> int:
    """Re-route a locked ``queue`` to ``to`` until ``until`` (None: until
    unrouted). Its waiting recipients are due now on the new hop. Returns the
    messages waiting in it."""
    to = " ".join((to or "").split())
    if not to:
        raise ActionInvalid("to: the next hop to send the queue's mail to, e.g. [10.0.0.9]:25")
    if queue.delivery_type not in REROUTABLE:
        raise ActionConflict(
            f"queue {queue.name} ({queue.get_delivery_type_display()}) has no next hop to re-route"
        )
    link = _override_link(queue, to, now)
    if queue.reroute_to and queue.link_id == link.pk and queue.reroute_until == until:
        raise ActionConflict(f"queue {queue.name} is already {describe(queue)}")
    if not queue.reroute_to and queue.link_id == link.pk:
        raise ActionConflict(f"queue {queue.name} is already delivered to {link.name}")
    # A change of a running re-route keeps the link to return to.
    home = queue.reroute_from_id if queue.reroute_to else queue.link_id
    Queue.objects.filter(pk=queue.pk).reroute(link.pk, to=to, until=until, by=by, home=home)
    waiting = Recipient.objects.filter(queue=queue, state__in=WAITING_RECIPIENT_STATES)
    waiting.filter(next_attempt_at__gt=now).update(next_attempt_at=now)
    Event.objects.create(
        created_at=now,
        level=EventLevel.WARNING,
        kind="reroute",
        text=f"queue {queue.name} re-routed by {by} to {to} ({link.name}) "
        f"{until_text(until) or 'until unrouted'}",
        queue=queue,
        data={"to": to, "link": link.pk, "from_link": home, "by": by},
    )
    if not queue.suspended:
        _ring(link.pk)
    return waiting.values("message_id").distinct().count()


def end(queue: Queue, now: datetime, *, reason: str, by: str = "") -> int:
    """End the re-route of a locked ``queue``: back on the link it came from
    (when that link is gone, its waiting mail is routed again). Returns the
    messages waiting in it."""
    if not queue.reroute_to:
        raise ActionConflict(f"queue {queue.name} is not re-routed")
    home = queue.reroute_from_id
    was = describe(queue)
    Queue.objects.filter(pk=queue.pk).unroute(home if home is not None else queue.link_id)
    waiting = Recipient.objects.filter(queue=queue, state__in=WAITING_RECIPIENT_STATES)
    count = waiting.values("message_id").distinct().count()
    if home is None:
        waiting.resubmit(now)
        transaction.on_commit(lambda: categorizer_work.send(sender=None))
    elif not queue.suspended:
        _ring(home)
    Event.objects.create(
        created_at=now,
        level=EventLevel.INFO,
        kind="reroute_ended",
        text=f"queue {queue.name}: {was} ended ({by + ' unrouted it' if by else reason}); "
        "routing is normal again",
        queue=queue,
        data={"link": home, "by": by or queue.reroute_by},
    )
    return count
