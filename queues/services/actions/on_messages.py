"""Actions on one message: the single forms the Queue Viewer, the API and the CLI call."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from datetime import datetime
from typing import Any

from django.db import transaction

from queues.lib import clock
from queues.models import (
    WAITING_RECIPIENT_STATES,
    Message,
    MessageState,
    Recipient,
    RecipientState,
)
from queues.services import envelope_edits
from queues.services.action_errors import ActionConflict
from queues.services.actions.common import (
    REMOVED_ENHANCED,
    Actor,
    Options,
    _after_commit_categorizer,
    _after_commit_links,
    _audit,
    options_for,
)
from queues.services.actions.cores import _dead_letters, _remove, _resubmit, _resume, _suspend
from queues.services.actions.on_queues import _before_after
from queues.services.retry_now import retry_now, retry_selection
from queues.services.until import until_text


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
