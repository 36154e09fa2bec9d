"""The message cores: set-based state changes, shared by single and bulk forms
(each a transition of queues.transitions, under the action's row locks)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from datetime import datetime

from django.db.models import QuerySet

from queues.models import (
    WAITING_RECIPIENT_STATES,
    DeliveryType,
    Message,
    MessageState,
    Recipient,
    RecipientState,
)
from queues.services.actions.common import (
    NO_OPTIONS,
    REMOVABLE_RECIPIENT_STATES,
    REMOVED_ENHANCED,
    Actor,
    Options,
    _after_commit_categorizer,
    _after_commit_links,
    _chunks,
    actor_name,
)


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
