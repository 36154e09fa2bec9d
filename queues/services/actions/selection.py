"""Bulk actions on messages: which messages an action takes (``messages_select``),
what it will change (``Preview``) and the change itself (``messages_apply``)."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from django.db import transaction
from django.db.models import Exists, OuterRef, Q, QuerySet
from django.db.models.functions import Lower

from queues.holdings import held_count, holds_q
from queues.lib import DSN_FAILURE, clock, dsn_wanted_q, null_sender_q
from queues.models import (
    FINAL_RECIPIENT_STATES,
    WAITING_RECIPIENT_STATES,
    DeliveryType,
    Message,
    MessageSource,
    MessageState,
    Queue,
    Recipient,
    RecipientState,
)
from queues.services import preview_sample
from queues.services.actions.common import (
    REMOVABLE_RECIPIENT_STATES,
    Actor,
    MessageAction,
    QueueAction,
    _audit,
    options_for,
)
from queues.services.actions.cores import _remove, _resubmit, _resume, _suspend
from queues.services.actions.on_messages import _held, _remove_detail, _retry
from queues.services.actions.on_queues import SAMPLE_QUEUES, _before_after, queues_select
from queues.services.retry_now import retry_selection


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
                .filter(Exists(rows.filter(dsn_wanted_q(DSN_FAILURE), message=OuterRef("pk"))))
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
