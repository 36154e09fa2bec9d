"""Actions on queues: their cores (``queue_core``), the single forms and the bulk
form over a selection (``queues_select``, ``queues_apply``)."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from datetime import datetime
from typing import Any

from django.db import transaction
from django.db.models import Exists, OuterRef, Q, QuerySet

from queues.holdings import held_count, held_recipients_q, queue_messages
from queues.lib import clock
from queues.models import (
    WAITING_RECIPIENT_STATES,
    DeliveryType,
    Link,
    Queue,
    Recipient,
)
from queues.services import reroute
from queues.services.action_errors import ActionConflict, ActionInvalid
from queues.services.actions.common import (
    NO_OPTIONS,
    Actor,
    Options,
    QueueAction,
    _after_commit_categorizer,
    _after_commit_links,
    _audit,
    options_for,
)
from queues.services.actions.cores import _resubmit
from queues.services.until import until_text


def _locked_queue(queue: Queue) -> Queue:
    return Queue.objects.select_for_update(of=("self",)).select_related("link").get(pk=queue.pk)


def _waiting_count(queue: Queue) -> int:
    return (
        Recipient.objects.filter(queue=queue, state__in=WAITING_RECIPIENT_STATES)
        .values("message_id")
        .distinct()
        .count()
    )


# Queues that hold messages no next hop can take: resubmit (or remove) them instead.
PARKING_QUEUES = (DeliveryType.DEAD_LETTER, DeliveryType.POISON)


def _nothing_waiting(queue: Queue, verb: str) -> ActionConflict:
    """The conflict of a queue with nothing to ``verb``, in the words of its count."""
    held = held_count(queue)
    if held:
        return ActionConflict(
            f"queue {queue.name} has no messages waiting to {verb}: its {held} messages "
            "are being delivered right now"
        )
    return ActionConflict(f"queue {queue.name} has no messages waiting: it holds none")


def _queue_retry(queue: Queue, now: datetime, opts: Options = NO_OPTIONS) -> int:
    if queue.delivery_type in PARKING_QUEUES:
        raise ActionConflict(
            f"queue {queue.name} has no next hop to retry: resubmit its messages "
            "(or remove them) instead"
        )
    if queue.suspended:
        raise ActionConflict(f"queue {queue.name} is suspended: resume it to deliver its messages")
    count = _waiting_count(queue)
    if not count:
        raise _nothing_waiting(queue, "retry")
    if queue.delivery_type == DeliveryType.UNREACHABLE:
        # No next hop to retry: retrying Unreachable is routing it again now.
        Recipient.objects.filter(queue=queue).resubmit(now)
        _after_commit_categorizer()
        return count
    if queue.link_id is None:
        raise ActionConflict(
            f"queue {queue.name} has no next hop to retry; resubmit its messages instead"
        )
    # The link's retry timer is overridden; when this try fails too, the
    # delivery sets a new one from now (the timer restarts).
    Link.objects.filter(pk=queue.link_id).update(next_retry_at=None)
    Recipient.objects.filter(
        queue=queue, state__in=WAITING_RECIPIENT_STATES, next_attempt_at__gt=now
    ).update(next_attempt_at=now)
    _after_commit_links([queue.link_id])
    return count


def _queue_resubmit(queue: Queue, now: datetime, opts: Options = NO_OPTIONS) -> int:
    if queue.delivery_type == DeliveryType.DEAD_LETTER:
        # Its dead letters, each back to the categorizer with a fresh expiry (MSMQ).
        ids = list(
            queue_messages(queue)
            .select_for_update(of=("self",))
            .order_by("id")
            .values_list("id", flat=True)
        )
        if not ids:
            raise ActionConflict(f"queue {queue.name} has no messages waiting: it holds none")
        count = _resubmit(ids, now)
        return count
    count = _waiting_count(queue)
    if not count:
        raise _nothing_waiting(queue, "resubmit")
    Recipient.objects.filter(queue=queue).resubmit(now)
    _after_commit_categorizer()
    return count


def _queue_suspend(queue: Queue, now: datetime, opts: Options = NO_OPTIONS) -> int:
    if queue.suspended:
        raise ActionConflict(f"queue {queue.name} is already suspended")
    Queue.objects.filter(pk=queue.pk).suspend(opts.until, opts.by)
    return _waiting_count(queue)


def _queue_resume(queue: Queue, now: datetime, opts: Options = NO_OPTIONS) -> int:
    if not queue.suspended:
        raise ActionConflict(f"queue {queue.name} is not suspended")
    Queue.objects.filter(pk=queue.pk).resume()
    if queue.link_id:
        _after_commit_links([queue.link_id])
    return _waiting_count(queue)


def _queue_reroute(queue: Queue, now: datetime, opts: Options = NO_OPTIONS) -> int:
    return reroute.start(queue, now, to=opts.to, until=opts.until, by=opts.by)


def _queue_unroute(queue: Queue, now: datetime, opts: Options = NO_OPTIONS) -> int:
    return reroute.end(queue, now, reason="unrouted", by=opts.by or "an operator")


def _require_delivery_queue(queue: Queue) -> None:
    if queue.delivery_type == DeliveryType.SUBMISSION:
        raise ActionConflict(
            "the Submission queue is worked by the categorizer, not delivered: "
            "act on its messages instead"
        )


QueueCore = Callable[[Queue, datetime, Options], int]

_QUEUE_ACTIONS: dict[str, QueueCore] = {
    QueueAction.RETRY: _queue_retry,
    QueueAction.RESUBMIT: _queue_resubmit,
    QueueAction.SUSPEND: _queue_suspend,
    QueueAction.RESUME: _queue_resume,
    QueueAction.REROUTE: _queue_reroute,
    QueueAction.UNROUTE: _queue_unroute,
}


def queue_core(action: str) -> Callable[..., int]:
    """The set-based core of a queue action, for a queue locked by the caller
    (the timed end of a suspension runs the resume core)."""
    return _QUEUE_ACTIONS[QueueAction(action).value]


def queue_state(queue: Queue, now: datetime | None = None) -> str:
    """A queue's suspension and route in words: the before and after of the audit."""
    if queue.suspended:
        held = f"suspended {until_text(queue.suspended_until, now)}".strip()
        if queue.suspended_by:
            held += f" by {queue.suspended_by}"
    else:
        held = "delivering"
    route = reroute.describe(queue, now)
    if queue.reroute_to and queue.reroute_by:
        route += f" by {queue.reroute_by}"
    return f"{held}, {route}"


def timed_notes(queue: Queue, now: datetime | None = None) -> list[str]:
    """What an operator set on a queue, for the viewer and ``queue list``:
    "suspended until T by X", "re-routed to [10.0.0.9]:25 until T by X"."""
    notes = []
    if queue.suspended and (queue.suspended_until or queue.suspended_by):
        held = f"suspended {until_text(queue.suspended_until, now)}".strip()
        notes.append(f"{held} by {queue.suspended_by}" if queue.suspended_by else held)
    if queue.reroute_to:
        route = reroute.describe(queue, now)
        notes.append(f"{route} by {queue.reroute_by}" if queue.reroute_by else route)
    return notes


def _before_after(before: str, after: str) -> str:
    return f"before: {before}; after: {after}"


def _queue_action(action: str, queue: Queue, actor: Actor, via: str, **options: Any) -> int:
    with transaction.atomic():
        now = clock.now()
        opts = options_for(actor, now, **options)
        locked = _locked_queue(queue)
        _require_delivery_queue(locked)
        before = queue_state(locked)
        count = _QUEUE_ACTIONS[action](locked, now, opts)
        after = queue_state(_locked_queue(queue))
        _audit(
            actor,
            via,
            f"queue_{action}",
            "queue",
            ids=[queue.pk],
            count=count,
            detail=f"{_before_after(before, after)}; {count} messages waiting",
        )
    queue.refresh_from_db()
    return count


def queue_retry(queue: Queue, actor: Actor, via: str) -> int:
    """Try the queue now: its link's retry time is cleared and its waiting
    messages are due now (Unreachable: routed again now). Returns the messages waiting."""
    return _queue_action(QueueAction.RETRY, queue, actor, via)


def queue_resubmit(queue: Queue, actor: Actor, via: str) -> int:
    """Send the queue's waiting messages back to the categorizer (the route may have changed)."""
    return _queue_action(QueueAction.RESUBMIT, queue, actor, via)


def queue_suspend(queue: Queue, actor: Actor, via: str, until: Any = None) -> int:
    """Stop delivering from the queue (a round in flight finishes); with ``until``
    (a duration or a time) it resumes by itself then (queues.services.timed)."""
    return _queue_action(QueueAction.SUSPEND, queue, actor, via, until=until)


def queue_resume(queue: Queue, actor: Actor, via: str) -> int:
    """Deliver from the queue again."""
    return _queue_action(QueueAction.RESUME, queue, actor, via)


def queue_reroute(queue: Queue, actor: Actor, via: str, to: str = "", until: Any = None) -> int:
    """Send the queue's mail to the next hop ``to`` (``[10.0.0.9]:25``, a smart
    host) instead of its own, until ``until`` (None: until unrouted); its
    waiting messages are due now there (queues.services.reroute)."""
    return _queue_action(QueueAction.REROUTE, queue, actor, via, to=to, until=until)


def queue_unroute(queue: Queue, actor: Actor, via: str) -> int:
    """End a re-route now: the queue goes back to the next hop routing gave it."""
    return _queue_action(QueueAction.UNROUTE, queue, actor, via)


def _queue_has_waiting() -> Exists:
    return Exists(
        Recipient.objects.filter(queue=OuterRef("pk"), state__in=WAITING_RECIPIENT_STATES)
    )


def _queue_has_dead() -> Exists:
    # The Dead-letter queue's holdings (queues.holdings.held_recipients_q).
    return Exists(
        Recipient.objects.filter(held_recipients_q(DeliveryType.DEAD_LETTER), queue=OuterRef("pk"))
    )


def _delivery_queues(queryset: QuerySet[Queue]) -> QuerySet[Queue]:
    return queryset.exclude(delivery_type=DeliveryType.SUBMISSION)


REROUTE_TO_MISSING = "the next hop to send the queues' mail to is missing, e.g. [10.0.0.9]:25"


def _select_reroute(qs: QuerySet[Queue], opts: Options) -> QuerySet[Queue]:
    # reroute.start: every queue with a next hop, except one already re-routed
    # exactly so (same next hop, same end).
    rerouteable = qs.filter(delivery_type__in=reroute.REROUTABLE)
    if not opts.to:  # nothing changes without a next hop (queues_apply: ActionInvalid)
        return rerouteable.none()
    same = Q(reroute_to=opts.to) & (
        Q(reroute_until__isnull=True) if opts.until is None else Q(reroute_until=opts.until)
    )
    return rerouteable.exclude(same)


# The queues of a selection each action changes: exactly those its core above
# accepts without an ActionConflict. The preview counts this query and the
# bulk form runs on it, so the two cannot disagree.
QUEUE_SELECTIONS: dict[str, Callable[[QuerySet[Queue], Options], QuerySet[Queue]]] = {
    QueueAction.RETRY: lambda qs, opts: _delivery_queues(qs).filter(
        _queue_has_waiting(),
        Q(delivery_type=DeliveryType.UNREACHABLE) | Q(link__isnull=False),
        suspended=False,
    ),
    QueueAction.RESUBMIT: lambda qs, opts: _delivery_queues(qs).filter(
        _queue_has_waiting() | (Q(delivery_type=DeliveryType.DEAD_LETTER) & _queue_has_dead())
    ),
    QueueAction.SUSPEND: lambda qs, opts: _delivery_queues(qs).filter(suspended=False),
    QueueAction.RESUME: lambda qs, opts: _delivery_queues(qs).filter(suspended=True),
    QueueAction.REROUTE: _select_reroute,
    QueueAction.UNROUTE: lambda qs, opts: _delivery_queues(qs).exclude(reroute_to=""),
}


def queues_select(
    action: str, queryset: QuerySet[Queue], opts: Options = NO_OPTIONS
) -> QuerySet[Queue]:
    """The queues of a selection that ``queues_apply(action, …)`` changes."""
    return QUEUE_SELECTIONS[QueueAction(action).value](queryset, opts)


# The queues whose messages a queue action's preview samples.
SAMPLE_QUEUES = 20

# Queues named with their before and after in one bulk action's audit detail.
AUDIT_ROWS = 50


def queues_apply(
    action: str,
    queryset: QuerySet[Queue],
    actor: Actor,
    via: str,
    *,
    ids: Sequence[int] = (),
    filter: Mapping[str, Any] | None = None,
    **options: Any,
) -> int:
    """Apply a queue action to every queue of a selection where it makes sense.

    Returns how many queues it changed; one audit entry for the whole selection,
    naming each queue's before and after (the first ``AUDIT_ROWS``).
    """
    action = QueueAction(action).value
    changed = 0
    changed_ids: list[int] = []
    messages = 0
    lines: list[str] = []
    with transaction.atomic():
        now = clock.now()
        opts = options_for(actor, now, **options)
        if action == QueueAction.REROUTE and not opts.to:  # never a silent "0 changed"
            raise ActionInvalid(f"to: {REROUTE_TO_MISSING}")
        selected = queues_select(action, queryset, opts).select_for_update(of=("self",))
        for queue in selected.select_related("link").order_by("id"):
            before = queue_state(queue)
            try:
                with transaction.atomic():
                    messages += _QUEUE_ACTIONS[action](queue, now, opts)
            except ActionInvalid:
                raise  # the options are wrong for every queue: nothing changes
            except ActionConflict:  # changed between the selection and its lock
                continue
            changed += 1
            changed_ids.append(queue.pk)
            if len(lines) < AUDIT_ROWS:
                after = queue_state(Queue.objects.select_related("link").get(pk=queue.pk))
                lines.append(f"{queue.name}: {_before_after(before, after)}")
        if changed > len(lines):
            lines.append(f"… and {changed - len(lines)} more")
        _audit(
            actor,
            via,
            f"queue_{action}",
            "queue",
            ids=ids,
            filter=filter,
            count=changed,
            detail="\n".join([f"{messages} messages", *lines]),
            changed=changed_ids,
        )
    return changed
