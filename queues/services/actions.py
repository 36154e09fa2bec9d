"""Operator actions on queues and messages: the one implementation the Queue
Viewer, the REST API and the management commands all call.

Every action
- runs in one transaction, under row locks on what it changes (so a
  categorizer or a delivery that holds the same rows is never overtaken:
  they claim with SKIP LOCKED and pass over what we hold);
- refuses what makes no sense in the current state with ``ActionConflict``
  (HTTP 409) and then changes nothing;
- writes one ``AuditEntry`` in that same transaction;
- rings the engine's doorbells (``queues.signals``) after commit when it made
  work.

Bulk forms (``messages_apply``, ``queues_apply``) act on every message or
queue of a selection for which the action makes sense and skip the others;
they return how many they changed. ``messages_select`` / ``queues_select``
are the query that says which: the bulk form changes exactly its rows and
the preview (``queues.spec.OperatorAction.preview``) counts it.
"""

from __future__ import annotations

import itertools
import tempfile
import zipfile
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass
from datetime import datetime
from typing import IO, Any

from django.contrib.auth.models import AbstractBaseUser
from django.db import models, transaction
from django.db.models import Exists, OuterRef, Q, QuerySet
from django.db.models.functions import Lower

from queues import bodies, clock
from queues.bounce.rule import FAILURE, null_sender_q, wants_q
from queues.holdings import held_count, held_recipients_q, holds_q, queue_messages
from queues.models import (
    FINAL_RECIPIENT_STATES,
    WAITING_RECIPIENT_STATES,
    AuditEntry,
    DeliveryType,
    Link,
    Message,
    MessageSource,
    MessageState,
    Queue,
    Recipient,
    RecipientState,
)
from queues.replay import replay_envelope
from queues.services import envelope_edits, preview_sample, reroute
from queues.services.action_errors import ActionConflict, ActionInvalid, ActionTooLarge
from queues.services.retry_now import retry_now, retry_selection
from queues.services.until import parse_until, until_text
from queues.signals import categorizer_work, link_work

# A removed recipient's status. RFC 3463 X.7.0 ("other or undefined security
# or policy status"): the removal is an administrative decision of this
# relay, and the X.7 class says so without blaming the address (X.1), the
# mailbox (X.2), the destination system (X.3), the network (X.4) or the
# content (X.6). Permanent (5): the message will not be tried again.
REMOVED_ENHANCED = "5.7.0"

CHUNK = 1000  # ids per statement in bulk actions
# What a removal fails: every recipient not final and not in flight.
REMOVABLE_RECIPIENT_STATES = (
    RecipientState.SUBMITTED,
    RecipientState.QUEUED,
    RecipientState.DEFERRED,
)
MAX_EXPORT = 1000  # messages in one bulk export
# A zip export reads each body in pieces of this size (SUBSTRING on the server),
# so it holds one piece at a time, however large the messages.
EXPORT_PIECE = 1024 * 1024
# A zip export stays in memory up to this size, then goes to a temporary file.
EXPORT_SPOOL = 1024 * 1024
# A piece goes into the zip in slices of this size: the compressor's output for
# one call stays small.
ZIP_WRITE = 64 * 1024

Actor = AbstractBaseUser | str


class Via(models.TextChoices):
    UI = "ui", "Queue Viewer"
    API = "api", "REST API"
    CLI = "cli", "command line"
    SYSTEM = "system", "the relay itself"  # timed ends (queues.services.timed), actor "system"


# The services' action names. Labels, past tenses, help and roles are the
# operator surface's, declared once in queues.spec.
class MessageAction(models.TextChoices):
    SUSPEND = "suspend"
    RESUME = "resume"
    RESUBMIT = "resubmit"
    RETRY = "retry"
    REMOVE = "remove"


class QueueAction(models.TextChoices):
    RETRY = "retry"
    RESUBMIT = "resubmit"
    SUSPEND = "suspend"
    RESUME = "resume"
    REROUTE = "reroute"
    UNROUTE = "unroute"


@dataclass(frozen=True)
class Options:
    """What an action takes besides its target: ``until`` (suspend, reroute: a
    time, None for no end), ``to`` (reroute: the next hop) and ``by`` (the actor's
    name, kept on the row as ``suspended_by`` / ``reroute_by``)."""

    until: datetime | None = None
    to: str = ""
    by: str = ""


NO_OPTIONS = Options()


def options_for(actor: Actor, now: datetime, until: Any = None, to: str = "") -> Options:
    """The options as the edges pass them (``until`` as text), checked: ActionInvalid."""
    return Options(
        until=parse_until(until, now), to=" ".join((to or "").split()), by=actor_name(actor)
    )


# --- audit ------------------------------------------------------------------------


def actor_name(actor: Actor) -> str:
    if isinstance(actor, str):
        return actor
    return actor.get_username()


def _audit(
    actor: Actor,
    via: str,
    action: str,
    target_type: str,
    *,
    ids: Sequence[int] = (),
    filter: Mapping[str, Any] | None = None,
    count: int = 0,
    detail: str = "",
    changed: Sequence[int] | None = None,
) -> AuditEntry:
    """The audit entry (``ids``: what the operator named). ``changed``: the rows the
    action really changed, when it knows them; the message tracking log records
    the action on those (tracking.hooks.on_audit), not on what was only named."""
    entry = AuditEntry(
        created_at=clock.now(),
        actor=None if isinstance(actor, str) else actor,
        actor_name=actor_name(actor)[:150],
        via=Via(via).value,
        action=action,
        target_type=target_type,
        target_ids=list(ids),
        filter=dict(filter or {}),
        count=count,
        detail=detail,
    )
    if changed is not None:
        entry.changed_ids = list(changed)  # read by the post_save hook
    entry.save()
    return entry


def _after_commit_categorizer() -> None:
    transaction.on_commit(lambda: categorizer_work.send(sender=None))


def _after_commit_links(link_ids: Iterable[int]) -> None:
    for link_id in sorted(set(link_ids)):
        transaction.on_commit(lambda link_id=link_id: link_work.send(sender=None, link_id=link_id))


def _chunks(ids: Sequence[int], size: int = CHUNK) -> Iterable[list[int]]:
    for start in range(0, len(ids), size):
        yield list(ids[start : start + size])


# --- the cores: set-based state changes, shared by single and bulk forms ----------


def _links_with_waiting(message_ids: Iterable[int]) -> set[int]:
    return set(
        Recipient.objects.filter(
            message_id__in=list(message_ids),
            state__in=WAITING_RECIPIENT_STATES,
            queue__suspended=False,
            queue__link__isnull=False,
        )
        .values_list("queue__link_id", flat=True)
        .distinct()
    )


def _suspend(message_ids: Sequence[int], opts: Options = NO_OPTIONS) -> int:
    changed = 0
    for chunk in _chunks(message_ids):
        changed += Message.objects.filter(id__in=chunk).suspend(opts.until, opts.by)
    return changed


def _resume(message_ids: Sequence[int], now: datetime) -> int:
    changed = 0
    submission = False
    links: set[int] = set()
    for chunk in _chunks(message_ids):
        ids = list(
            Message.objects.filter(id__in=chunk, suspended=True)
            .exclude(state=MessageState.DONE)
            .values_list("id", flat=True)
        )
        if not ids:
            continue
        changed += Message.objects.filter(id__in=ids).resume()
        # A message the poison guard parked is released to the categorizer.
        if Recipient.objects.filter(
            message_id__in=ids, queue__delivery_type=DeliveryType.POISON
        ).resubmit(now):
            submission = True
        submission = submission or (
            Message.objects.filter(id__in=ids, state=MessageState.SUBMISSION).exists()
        )
        links |= _links_with_waiting(ids)
    if submission:
        _after_commit_categorizer()
    _after_commit_links(links)
    return changed


def resume_messages(message_ids: Sequence[int], now: datetime) -> int:
    """Release suspended messages (the timed end of a suspension runs this too)."""
    return _resume(message_ids, now)


def _dead_letters(message_ids: Iterable[int]) -> QuerySet[Recipient]:
    """Failed or expired recipients of finished messages, kept in the Dead-letter queue."""
    return Recipient.objects.filter(
        message_id__in=list(message_ids),
        message__state=MessageState.DONE,
        queue__delivery_type=DeliveryType.DEAD_LETTER,
        state__in=[RecipientState.FAILED, RecipientState.EXPIRED],
    )


def _revive_dead_letters(message_ids: Sequence[int], now: datetime) -> int:
    """Give dead letters a new life: back to the categorizer with a fresh expiry (MSMQ)."""
    return len(_dead_letters(message_ids).revive(now))


def _resubmit(message_ids: Sequence[int], now: datetime) -> int:
    changed = 0
    for chunk in _chunks(message_ids):
        moved = Recipient.objects.filter(message_id__in=chunk)
        before = set(
            moved.filter(state__in=WAITING_RECIPIENT_STATES)
            .exclude(message__state=MessageState.CATEGORIZING)
            .values_list("message_id", flat=True)
            .distinct()
        )
        if moved.resubmit(now):
            changed += len(before)
        changed += _revive_dead_letters(chunk, now)
    if changed:
        _after_commit_categorizer()
    return changed


def _remove(
    message_ids: Sequence[int], now: datetime, actor: Actor, ndr: bool
) -> dict[int, list[int]]:
    """Fail every recipient not final and not in flight; return {message: recipients}."""
    removed: dict[int, list[int]] = {}
    for chunk in _chunks(message_ids):
        rows = list(
            Recipient.objects.filter(
                message_id__in=chunk,
                state__in=REMOVABLE_RECIPIENT_STATES,
            )
            .exclude(message__state=MessageState.CATEGORIZING)
            # locked: a delivery claim cannot take these rows between read and update
            .select_for_update(of=("self",))
            .values_list("message_id", "id")
        )
        if not rows:
            continue
        Recipient.objects.filter(id__in=[rid for _, rid in rows]).fail(
            now, enhanced=REMOVED_ENHANCED, text=f"removed by {actor_name(actor)}"
        )
        for mid, rid in rows:
            removed.setdefault(mid, []).append(rid)
        # Done unless a recipient is still in flight; the delivery that holds it
        # finishes the message when it records the result.
        Message.objects.filter(id__in={mid for mid, _ in rows}).finish(now)
    if ndr and removed:
        # The lead's DSN generation: queues the NDR in this same transaction, so
        # the removal and the notification it owes commit together.
        from queues.bounce.notify import ndr_for

        for mid, rids in removed.items():
            ndr_for(mid, rids)
    return removed


# --- queues -------------------------------------------------------------------------


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


# --- messages ------------------------------------------------------------------------


def _locked_message(message: Message) -> Message:
    return Message.objects.select_for_update().defer("data").get(pk=message.pk)


def _require_live(message: Message, verb: str) -> None:
    if message.state == MessageState.DONE:
        raise ActionConflict(
            f"message {message.qid} is done (every recipient delivered or failed): "
            f"nothing to {verb}"
        )


def _require_not_categorizing(message: Message, verb: str) -> None:
    if message.state == MessageState.CATEGORIZING:
        raise ActionConflict(
            f"message {message.qid} is being routed right now; {verb} it again in a moment"
        )


def _message_action(
    action: str,
    message: Message,
    actor: Actor,
    via: str,
    check: Callable[[Message], None],
    apply: Callable[[list[int], datetime, Options], int],
    detail: Callable[[dict[str, str], Message, int], str],
    **options: Any,
) -> int:
    with transaction.atomic():
        now = clock.now()
        opts = options_for(actor, now, **options)
        locked = _locked_message(message)
        check(locked)
        before = {"held": _held(locked), "where": _where(locked)}
        count = apply([locked.pk], now, opts)
        after = _locked_message(message)
        _audit(
            actor,
            via,
            f"message_{action}",
            "message",
            ids=[locked.pk],
            count=count,
            detail=detail(before, after, count),
        )
    message.refresh_from_db()
    return count


def _held(m: Message) -> str:
    if not m.suspended:
        return "not suspended"
    text = f"suspended {until_text(m.suspended_until)}".strip()
    return f"{text} by {m.suspended_by}" if m.suspended_by else text


def _where(m: Message) -> str:
    states = sorted(set(m.recipients.values_list("state", flat=True)))
    return f"{m.state}, recipients {'/'.join(states) or 'none'}"


def message_suspend(message: Message, actor: Actor, via: str, until: Any = None) -> int:
    """Hold the message: no recipient of it is tried until it is resumed, or
    until ``until`` (a duration or a time) when it resumes by itself."""

    def check(m: Message) -> None:
        _require_live(m, "suspend")
        if m.suspended:
            raise ActionConflict(f"message {m.qid} is already suspended")

    return _message_action(
        "suspend",
        message,
        actor,
        via,
        check,
        lambda ids, now, opts: _suspend(ids, opts),
        lambda b, a, n: _before_after(b["held"], _held(a)),
        until=until,
    )


def message_resume(message: Message, actor: Actor, via: str) -> int:
    """Release a suspended message (one parked in Poison goes back to the categorizer)."""

    def check(m: Message) -> None:
        _require_live(m, "resume")
        if not m.suspended:
            raise ActionConflict(f"message {m.qid} is not suspended")

    return _message_action(
        "resume",
        message,
        actor,
        via,
        check,
        lambda ids, now, opts: _resume(ids, now),
        lambda b, a, n: _before_after(b["held"], _where(a)),
    )


def message_resubmit(
    message: Message, actor: Actor, via: str, recipient: str = "", sender: str | None = None
) -> int:
    """Send the message's waiting recipients back to the categorizer, due now.

    A finished message in the Dead-letter queue is resubmitted whole: its failed
    and expired recipients go back to the categorizer with a fresh expiry. A
    dead letter may be resubmitted with envelope edits (the body untouched):
    ``recipient`` a corrected address for its one dead recipient, or
    ``old=new`` naming which; ``sender`` a corrected envelope sender ("<>" the
    null sender). The audit entry says what they were and what they became.
    """
    edits = envelope_edits.parse(recipient, sender)
    changes: list[str] = []

    def check(m: Message) -> None:
        if m.state == MessageState.DONE and _dead_letters([m.pk]).exists():
            return  # a dead letter: resubmittable (MSMQ), see _revive_dead_letters
        if edits:
            raise ActionConflict(
                f"message {m.qid} is not a dead letter: only a dead letter's envelope "
                "can be corrected when it is resubmitted"
            )
        _require_live(m, "resubmit")
        _require_not_categorizing(m, "resubmit")
        if not Recipient.objects.filter(message=m, state__in=WAITING_RECIPIENT_STATES).exists():
            raise ActionConflict(
                f"message {m.qid} has no recipient waiting in a queue "
                "(they are in the categorizer or being delivered right now)"
            )

    def apply(ids: list[int], now: datetime, opts: Options) -> int:
        if edits:
            changes.extend(edits.apply(ids[0], _dead_letters(ids)))
        return _resubmit(ids, now)

    def detail(b: dict[str, str], a: Message, n: int) -> str:
        text = _before_after(b["where"], _where(a))
        return "\n".join([text, *changes])

    return _message_action("resubmit", message, actor, via, check, apply, detail)


def _retry(message_ids: Sequence[int], now: datetime) -> int:
    changed, links, categorizer = retry_now(message_ids, now)
    if categorizer:
        _after_commit_categorizer()
    _after_commit_links(links)
    return changed


def message_retry(message: Message, actor: Actor, via: str) -> int:
    """Try the message now (Postfix's ``postqueue -i``): its waiting recipients are
    due now and their links' retry time is cleared; those in Unreachable are
    routed again now (queues.services.retry_now)."""

    def check(m: Message) -> None:
        _require_live(m, "retry")
        _require_not_categorizing(m, "retry")
        if m.suspended:
            raise ActionConflict(f"message {m.qid} is suspended: resume it to try it")
        if not retry_selection(Message.objects.filter(pk=m.pk)).exists():
            raise ActionConflict(
                f"message {m.qid} has nothing to retry: it is due already, being "
                "delivered right now, or waits in a suspended queue"
            )

    return _message_action(
        "retry",
        message,
        actor,
        via,
        check,
        lambda ids, now, opts: _retry(ids, now),
        lambda b, a, n: _before_after(b["where"], f"due now, {_where(a)}"),
    )


def message_remove(message: Message, actor: Actor, via: str, ndr: bool = False) -> int:
    """Fail every recipient not yet final, with or without a non-delivery report.

    Refused while the categorizer or a delivery holds the message (it would
    overwrite the removal); suspend it first and try again after that round.
    """
    failed: list[int] = []

    def check(m: Message) -> None:
        _require_live(m, "remove")
        _require_not_categorizing(m, "remove")
        in_flight = Recipient.objects.filter(message=m, state=RecipientState.ACTIVE).count()
        if in_flight:
            raise ActionConflict(
                f"message {m.qid} is being delivered right now ({in_flight} recipients in "
                "flight); suspend it and remove it after this delivery round"
            )

    def apply(ids: list[int], now: datetime, opts: Options) -> int:
        removed = _remove(ids, now, actor, ndr)
        failed.extend(rid for rids in removed.values() for rid in rids)
        return len(removed)

    def detail(b: dict[str, str], a: Message, n: int) -> str:
        return _remove_detail(ndr, b["where"], len(failed), _where(a))

    return _message_action("remove", message, actor, via, check, apply, detail)


def _remove_detail(ndr: bool, before: str, failed: int, after: str) -> str:
    return f"{'with' if ndr else 'without'} NDR; " + _before_after(
        before, f"{failed} recipients failed ({REMOVED_ENHANCED}), {after}"
    )


EXPORT_FORMS = ("received", "sent")


def _check_form(form: str) -> None:
    if form not in EXPORT_FORMS:
        raise ValueError(f"unknown export form {form!r} (received or sent)")


def message_export_pieces(
    message: Message,
    fmt: str = "eml",
    actor: Actor | None = None,
    via: str | None = None,
    form: str = "received",
) -> Iterator[bytes]:
    """The message exactly as stored (the received bytes behind our Received
    header), as an iterator of pieces read from the database as it is consumed.

    ``form="sent"`` is what leaves for the next hop: the header fields added
    for sending (``Message.signature``, a DKIM-Signature) before the stored
    bytes; ``"received"`` (the default) leaves them out.

    ``fmt="replay"`` puts Exchange's replay envelope first (X-Sender, one
    X-Receiver per recipient still to deliver), so the file can be dropped in
    the replay folder (suspend, export, copy into Replay). With an ``actor``
    the export is written to the audit log (message bodies are personal data:
    who read which one is worth knowing). The format is checked and the audit
    written now, before the first piece; ``message`` may be loaded without
    its body (``.defer("data")``): the body is never loaded whole.
    """
    if fmt not in ("eml", "replay"):
        raise ValueError(f"unknown export format {fmt!r} (eml or replay)")
    _check_form(form)
    head: tuple[bytes, ...] = ()
    if fmt == "replay":
        pending = message.recipients.exclude(state__in=FINAL_RECIPIENT_STATES).order_by("id")
        try:
            head = (replay_envelope(message, pending),)
        except ValueError as exc:
            raise ActionConflict(f"message {message.qid}: {exc}") from None
    if form == "sent" and message.signature:
        head += (bytes(message.signature),)
    if actor is not None:
        _audit(actor, via or Via.API, "message_export", "message", ids=[message.pk], count=1)
    return itertools.chain(head, bodies.body_pieces(message.pk, EXPORT_PIECE))


def message_export_size(message: Message, fmt: str = "eml", form: str = "received") -> int | None:
    """How many octets ``message_export_pieces`` yields for an eml export (for a
    Content-Length), without reading the body; None for replay or when gone."""
    _check_form(form)
    if fmt != "eml" or (size := bodies.body_size(message.pk)) is None:
        return None
    return size + (len(message.signature) if form == "sent" else 0)


def message_export(
    message: Message,
    fmt: str = "eml",
    actor: Actor | None = None,
    via: str | None = None,
    form: str = "received",
) -> bytes:
    """``message_export_pieces`` joined: the whole export in memory (the CLI's
    file or standard output; the web exports stream the pieces instead)."""
    return b"".join(message_export_pieces(message, fmt, actor, via, form))


def _zip_write(entry: IO[bytes], data: bytes) -> None:
    view = memoryview(data)
    for start in range(0, len(view), ZIP_WRITE):
        entry.write(view[start : start + ZIP_WRITE])


def messages_export_zip(
    queryset: QuerySet[Message],
    out: IO[bytes],
    actor: Actor,
    via: str,
    *,
    ids: Sequence[int] = (),
    filter: Mapping[str, Any] | None = None,
    limit: int = MAX_EXPORT,
) -> int:
    """Write the selected messages into a zip (one ``<qid>.eml`` each) on ``out``.

    Bodies are read one message at a time, in pieces (``EXPORT_PIECE``) streamed
    into the zip entry, so memory does not grow with the messages' sizes; a
    message removed before its body is read is left out (stored bytes never
    change, so pieces of one message always fit together). Raises
    ActionTooLarge past ``limit`` messages. Returns how many it wrote.
    """
    count = queryset.count()
    if count > limit:
        raise ActionTooLarge(
            f"{count} messages match; export at most {limit} at once (narrow the filter)"
        )
    written = 0
    # At most ``limit`` small rows: the bodies are not part of this query.
    rows = list(queryset.order_by("id").values_list("id", "qid"))
    with zipfile.ZipFile(out, "w", compression=zipfile.ZIP_DEFLATED) as archive:
        for message_id, qid in rows:
            pieces = bodies.body_pieces(message_id, EXPORT_PIECE)
            first = next(pieces, None)
            if first is None:
                continue
            with archive.open(f"{qid}.eml", "w") as entry:
                _zip_write(entry, first)
                del first
                for data in pieces:
                    _zip_write(entry, data)
                    del data  # before the next piece is read
            written += 1
    _audit(actor, via, "messages_export", "message", ids=ids, filter=filter, count=written)
    return written


def messages_export_zip_file(
    queryset: QuerySet[Message],
    actor: Actor,
    via: str,
    *,
    ids: Sequence[int] = (),
    filter: Mapping[str, Any] | None = None,
    limit: int = MAX_EXPORT,
) -> IO[bytes]:
    """``messages_export_zip`` into a temporary file (in memory up to
    ``EXPORT_SPOOL``, then on disk), returned open at its start; the caller
    closes it (``FileResponse`` does, once it has sent it). Raises as
    ``messages_export_zip`` does, leaving no file behind."""
    out = tempfile.SpooledTemporaryFile(max_size=EXPORT_SPOOL)  # noqa: SIM115
    try:
        messages_export_zip(queryset, out, actor, via, ids=ids, filter=filter, limit=limit)
    except BaseException:
        out.close()
        raise
    out.seek(0)
    return out


def _has_recipient(**conditions: Any) -> Exists:
    return Exists(Recipient.objects.filter(message=OuterRef("pk"), **conditions))


def _select_resubmit(qs: QuerySet[Message]) -> QuerySet[Message]:
    # _resubmit_recipients: waiting recipients of a message not being routed;
    # _revive_dead_letters: finished messages with failed/expired recipients in Dead-letter.
    waiting = ~Q(state=MessageState.CATEGORIZING) & Q(
        _has_recipient(state__in=WAITING_RECIPIENT_STATES)
    )
    dead_letter = Q(state=MessageState.DONE) & Q(
        _has_recipient(
            queue__delivery_type=DeliveryType.DEAD_LETTER,
            state__in=[RecipientState.FAILED, RecipientState.EXPIRED],
        )
    )
    return qs.filter(waiting | dead_letter)


def _select_remove(qs: QuerySet[Message]) -> QuerySet[Message]:
    # _remove fails the recipients not final and not in flight; a message with a
    # recipient in flight is skipped whole (its delivery would overwrite the removal).
    return (
        qs.exclude(state__in=[MessageState.DONE, MessageState.CATEGORIZING])
        .filter(_has_recipient(state__in=REMOVABLE_RECIPIENT_STATES))
        .exclude(_has_recipient(state=RecipientState.ACTIVE))
    )


# The messages of a selection each action changes: exactly those its core
# (_suspend, _resume, _resubmit, _remove) changes. The preview (UI
# confirmation, dry_run of the API and the command) counts this query and
# messages_apply locks and changes its rows, so the two cannot disagree.
MESSAGE_SELECTIONS: dict[str, Callable[[QuerySet[Message]], QuerySet[Message]]] = {
    MessageAction.SUSPEND: lambda qs: qs.filter(suspended=False).exclude(state=MessageState.DONE),
    MessageAction.RESUME: lambda qs: qs.filter(suspended=True).exclude(state=MessageState.DONE),
    MessageAction.RESUBMIT: _select_resubmit,
    MessageAction.REMOVE: _select_remove,
    MessageAction.RETRY: retry_selection,
}


def messages_select(action: str, queryset: QuerySet[Message]) -> QuerySet[Message]:
    """The messages of a selection that ``messages_apply(action, …)`` changes."""
    return MESSAGE_SELECTIONS[MessageAction(action).value](queryset)


# --- what an action will do: the preview ----------------------------------------------


@dataclass(frozen=True)
class Preview:
    """What a bulk action will do, from the queries the action itself runs.

    ``count``: the rows it changes (what ``*_apply`` returns); ``matched``: the
    rows of the selection; ``skipped``: matched but left alone (the action makes
    no sense in their state), of which ``in_flight`` because the categorizer or
    a delivery holds them right now. ``recipients``: the recipients it moves
    (resubmit: back to the categorizer; suspend/resume: held/released) or fails
    (remove); ``failing``: those that will fail; ``ndrs``: the non-delivery
    reports it will send, to ``ndr_senders`` distinct senders. Queue actions:
    ``messages`` held by the queues it changes. ``sample``: the first messages
    it would touch, oldest first (queues.services.preview_sample: id, qid,
    sender, recipients, queues, age), beside the counts.
    """

    action: str
    count: int
    matched: int
    in_flight: int = 0
    recipients: int = 0
    failing: int = 0
    ndrs: int = 0
    ndr_senders: int = 0
    messages: int = 0
    sample: tuple[dict[str, Any], ...] = ()

    @property
    def skipped(self) -> int:
        return self.matched - self.count

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "skipped": self.skipped}

    def lines(self, noun: str) -> list[str]:
        """The consequences in words, for the confirmation page and the command."""
        out = [f"{self.action} would change {self.count} of {self.matched} {noun}"]
        if self.skipped:
            why = f", {self.in_flight} of them in flight right now" if self.in_flight else ""
            out.append(
                f"{self.skipped} {noun} skipped (the action makes no sense in their state{why})"
            )
        if self.failing:
            out.append(f"{self.failing} recipients will fail")
        if self.ndrs:
            out.append(
                f"{self.ndrs} non-delivery reports will go to {self.ndr_senders} distinct senders"
            )
        elif self.failing:
            out.append("no non-delivery report will be sent")
        if noun == "queues" and self.count:
            out.append(f"{self.messages} messages wait in those queues")
        return out


def _in_flight(qs: QuerySet[Message]) -> QuerySet[Message]:
    return qs.exclude(state=MessageState.DONE).filter(
        Q(state=MessageState.CATEGORIZING) | Q(_has_recipient(state=RecipientState.ACTIVE))
    )


def messages_preview(
    action: str, queryset: QuerySet[Message], *, ndr: bool = False, **options: Any
) -> Preview:
    """What ``messages_apply(action, queryset, ndr=ndr)`` will change, without changing it."""
    action = MessageAction(action).value
    selected = messages_select(action, queryset)
    ids = selected.values("pk")
    count = selected.count()
    matched = queryset.count()
    in_flight = _in_flight(queryset.exclude(pk__in=ids)).count() if matched > count else 0
    recipients = failing = ndrs = ndr_senders = 0
    if action == MessageAction.REMOVE:
        rows = Recipient.objects.filter(message__in=ids, state__in=REMOVABLE_RECIPIENT_STATES)
        recipients = failing = rows.count()
        if ndr and failing:
            owed = (
                Message.objects.filter(pk__in=ids)
                .exclude(null_sender_q())
                .exclude(source=MessageSource.DSN)
                .filter(Exists(rows.filter(wants_q(FAILURE), message=OuterRef("pk"))))
            )
            ndrs = owed.count()
            ndr_senders = owed.values(lower=Lower("mail_from")).distinct().count() if ndrs else 0
    elif action == MessageAction.RESUBMIT:
        waiting = Recipient.objects.filter(message__in=ids, state__in=WAITING_RECIPIENT_STATES)
        waiting = waiting.exclude(message__state=MessageState.CATEGORIZING)
        recipients = waiting.count() + _dead_letters_of(ids).count()
    else:
        recipients = (
            Recipient.objects.filter(message__in=ids)
            .exclude(state__in=FINAL_RECIPIENT_STATES)
            .count()
        )
    first = tuple(preview_sample.sample(selected, clock.now())) if count else ()
    return Preview(
        action, count, matched, in_flight, recipients, failing, ndrs, ndr_senders, sample=first
    )


def queues_preview(
    action: str, queryset: QuerySet[Queue], actor: Actor = "", **options: Any
) -> Preview:
    """What ``queues_apply(action, queryset, …)`` will change, without changing it."""
    action = QueueAction(action).value
    now = clock.now()
    opts = options_for(actor, now, **options)
    selected = queues_select(action, queryset, opts)
    count = selected.count()
    messages = 0
    first: tuple[dict[str, Any], ...] = ()
    if count:
        held = Q()
        for queue in selected.order_by("id")[:SAMPLE_QUEUES]:
            held |= holds_q(queue)
        messages = (
            Recipient.objects.filter(
                queue__in=selected.values("pk"), state__in=WAITING_RECIPIENT_STATES
            )
            .values("message_id")
            .distinct()
            .count()
        )
        dead = selected.filter(delivery_type=DeliveryType.DEAD_LETTER).first()
        if dead is not None:
            messages += held_count(dead)
        first = tuple(preview_sample.sample(Message.objects.filter(held), now))
    return Preview(action, count, queryset.count(), messages=messages, sample=first)


def _dead_letters_of(ids: QuerySet) -> QuerySet[Recipient]:
    return Recipient.objects.filter(
        message__in=ids,
        message__state=MessageState.DONE,
        queue__delivery_type=DeliveryType.DEAD_LETTER,
        state__in=[RecipientState.FAILED, RecipientState.EXPIRED],
    )


def messages_apply(
    action: str,
    queryset: QuerySet[Message],
    actor: Actor,
    via: str,
    *,
    ndr: bool = False,
    ids: Sequence[int] = (),
    filter: Mapping[str, Any] | None = None,
    **options: Any,
) -> int:
    """Apply a message action to every message of a selection where it makes sense.

    ``ids`` or ``filter`` say how the selection was made (for the audit log).
    Messages for which the action makes no sense (done, already suspended,
    in the categorizer or in flight) are skipped: ``messages_select`` says
    which. ``options``: ``until`` for suspend. Returns how many changed.
    """
    action = MessageAction(action).value
    with transaction.atomic():
        now = clock.now()
        opts = options_for(actor, now, **options)
        # Lock what we change: the categorizer and deliveries skip locked rows.
        message_ids = list(
            messages_select(action, queryset)
            .select_for_update(of=("self",))
            .order_by("id")
            .values_list("id", flat=True)
        )
        if action == MessageAction.SUSPEND:
            count = _suspend(message_ids, opts)
            detail = _before_after(
                "not suspended",
                _held(Message(suspended=True, suspended_until=opts.until, suspended_by=opts.by)),
            )
        elif action == MessageAction.RESUME:
            count = _resume(message_ids, now)
            detail = _before_after("suspended", "released")
        elif action == MessageAction.RESUBMIT:
            count = _resubmit(message_ids, now)
            detail = _before_after("waiting in a queue, or a dead letter", "in Submission, due now")
        elif action == MessageAction.RETRY:
            count = _retry(message_ids, now)
            detail = _before_after("waiting", "due now")
        else:
            removed = _remove(message_ids, now, actor, ndr)
            message_ids = list(removed)
            count = len(removed)
            failed = sum(len(r) for r in removed.values())
            detail = _remove_detail(
                ndr, "not final, not in flight", failed, "done unless in flight"
            )
        _audit(
            actor,
            via,
            f"message_{action}",
            "message",
            ids=ids,
            filter=filter,
            count=count,
            detail=detail,
            changed=message_ids,
        )
    return count


__all__ = [
    "ActionConflict",
    "ActionInvalid",
    "ActionTooLarge",
    "MessageAction",
    "Options",
    "Preview",
    "QueueAction",
    "Via",
    "message_export",
    "message_export_pieces",
    "message_export_size",
    "message_remove",
    "message_resubmit",
    "message_resume",
    "message_retry",
    "message_suspend",
    "messages_apply",
    "messages_export_zip",
    "messages_preview",
    "messages_select",
    "messages_export_zip_file",
    "queue_reroute",
    "queue_resubmit",
    "queue_resume",
    "queue_retry",
    "queue_suspend",
    "queue_unroute",
    "queues_apply",
    "queues_preview",
    "queues_select",
    "resume_messages",
    "timed_notes",
]
