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
from datetime import datetime
from typing import IO, Any

from django.conf import settings
from django.contrib.auth.models import AbstractBaseUser
from django.db import models, transaction
from django.db.models import Exists, OuterRef, Q, QuerySet

from queues import bodies, clock
from queues.models import (
    FINAL_RECIPIENT_STATES,
    WAITING_RECIPIENT_STATES,
    AuditEntry,
    DeliveryType,
    Link,
    Message,
    MessageState,
    Queue,
    Recipient,
    RecipientState,
)
from queues.replay import replay_envelope
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


# The services' action names. Labels, past tenses, help and roles are the
# operator surface's, declared once in queues.spec.
class MessageAction(models.TextChoices):
    SUSPEND = "suspend"
    RESUME = "resume"
    RESUBMIT = "resubmit"
    REMOVE = "remove"


class QueueAction(models.TextChoices):
    RETRY = "retry"
    RESUBMIT = "resubmit"
    SUSPEND = "suspend"
    RESUME = "resume"


class ActionConflict(Exception):
    """The action makes no sense in the current state; nothing was changed (HTTP 409)."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class ActionTooLarge(Exception):
    """A selection larger than the action allows (HTTP 400)."""


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
) -> AuditEntry:
    return AuditEntry.objects.create(
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


def _after_commit_categorizer() -> None:
    transaction.on_commit(lambda: categorizer_work.send(sender=None))


def _after_commit_links(link_ids: Iterable[int]) -> None:
    for link_id in sorted(set(link_ids)):
        transaction.on_commit(lambda link_id=link_id: link_work.send(sender=None, link_id=link_id))


def _chunks(ids: Sequence[int], size: int = CHUNK) -> Iterable[list[int]]:
    for start in range(0, len(ids), size):
        yield list(ids[start : start + size])


# --- the cores: set-based state changes, shared by single and bulk forms ----------


def _resubmit_recipients(recipients: QuerySet[Recipient], now: datetime) -> int:
    """Send waiting recipients back to the categorizer (their messages to Submission).

    Recipients parked in Poison come back too: their message loses its
    poison suspension and crash count (an operator decided to try again).
    Returns how many recipients moved.
    """
    waiting = recipients.filter(state__in=WAITING_RECIPIENT_STATES).exclude(
        message__state=MessageState.CATEGORIZING
    )
    poisoned = waiting.filter(queue__delivery_type=DeliveryType.POISON).values("message_id")
    Message.objects.filter(id__in=poisoned).update(suspended=False, crash_count=0, isolate=False)
    Message.objects.filter(id__in=waiting.values("message_id")).back_to_submission(now)
    return waiting.back_to_submission(now)


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


def _suspend(message_ids: Sequence[int]) -> int:
    changed = 0
    for chunk in _chunks(message_ids):
        changed += (
            Message.objects.filter(id__in=chunk, suspended=False)
            .exclude(state=MessageState.DONE)
            .update(suspended=True)
        )
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
        changed += Message.objects.filter(id__in=ids).update(suspended=False)
        # A message the poison guard parked is released to the categorizer.
        if _resubmit_recipients(
            Recipient.objects.filter(message_id__in=ids, queue__delivery_type=DeliveryType.POISON),
            now,
        ):
            submission = True
        submission = submission or (
            Message.objects.filter(id__in=ids, state=MessageState.SUBMISSION).exists()
        )
        links |= _links_with_waiting(ids)
    if submission:
        _after_commit_categorizer()
    _after_commit_links(links)
    return changed


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
    rows = _dead_letters(message_ids)
    revived = set(rows.values_list("message_id", flat=True))
    if not revived:
        return 0
    rows.update(
        queue=None,
        state=RecipientState.SUBMITTED,
        next_attempt_at=now,
        final_at=None,
        attempt_count=0,
        first_failure_at=None,
        delay_dsn_sent=False,
        lease_until=None,
    )
    Message.objects.filter(id__in=revived).update(
        state=MessageState.SUBMISSION,
        next_attempt_at=now,
        completed_at=None,
        expires_at=now + settings.MAILRELAY_MESSAGE_EXPIRATION_TIMEOUT,
        per_message_failures=0,
        problem=False,
    )
    return len(revived)


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
        if _resubmit_recipients(moved, now):
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
        from queues.services.notify import ndr_for

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


def _queue_retry(queue: Queue, now: datetime) -> int:
    if queue.suspended:
        raise ActionConflict(f"queue {queue.name} is suspended: resume it to deliver its messages")
    count = _waiting_count(queue)
    if not count:
        raise ActionConflict(f"queue {queue.name} has no messages waiting")
    if queue.delivery_type == DeliveryType.UNREACHABLE:
        # No next hop to retry: retrying Unreachable is routing it again now.
        _resubmit_recipients(Recipient.objects.filter(queue=queue), now)
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


def _queue_resubmit(queue: Queue, now: datetime) -> int:
    count = _waiting_count(queue)
    if not count:
        raise ActionConflict(f"queue {queue.name} has no messages waiting")
    _resubmit_recipients(Recipient.objects.filter(queue=queue), now)
    _after_commit_categorizer()
    return count


def _queue_suspend(queue: Queue, now: datetime) -> int:
    if queue.suspended:
        raise ActionConflict(f"queue {queue.name} is already suspended")
    Queue.objects.filter(pk=queue.pk).update(suspended=True)
    return _waiting_count(queue)


def _queue_resume(queue: Queue, now: datetime) -> int:
    if not queue.suspended:
        raise ActionConflict(f"queue {queue.name} is not suspended")
    Queue.objects.filter(pk=queue.pk).update(suspended=False)
    if queue.link_id:
        _after_commit_links([queue.link_id])
    return _waiting_count(queue)


def _require_delivery_queue(queue: Queue) -> None:
    if queue.delivery_type == DeliveryType.SUBMISSION:
        raise ActionConflict(
            "the Submission queue is worked by the categorizer, not delivered: "
            "act on its messages instead"
        )


_QUEUE_ACTIONS: dict[str, Callable[[Queue, datetime], int]] = {
    QueueAction.RETRY: _queue_retry,
    QueueAction.RESUBMIT: _queue_resubmit,
    QueueAction.SUSPEND: _queue_suspend,
    QueueAction.RESUME: _queue_resume,
}


def _queue_action(action: str, queue: Queue, actor: Actor, via: str) -> int:
    with transaction.atomic():
        locked = _locked_queue(queue)
        _require_delivery_queue(locked)
        count = _QUEUE_ACTIONS[action](locked, clock.now())
        _audit(actor, via, f"queue_{action}", "queue", ids=[queue.pk], count=count)
    queue.refresh_from_db()
    return count


def queue_retry(queue: Queue, actor: Actor, via: str) -> int:
    """Try the queue now: its link's retry time is cleared and its waiting
    messages are due now (Unreachable: routed again now). Returns the messages waiting."""
    return _queue_action(QueueAction.RETRY, queue, actor, via)


def queue_resubmit(queue: Queue, actor: Actor, via: str) -> int:
    """Send the queue's waiting messages back to the categorizer (the route may have changed)."""
    return _queue_action(QueueAction.RESUBMIT, queue, actor, via)


def queue_suspend(queue: Queue, actor: Actor, via: str) -> int:
    """Stop delivering from the queue (a round in flight finishes)."""
    return _queue_action(QueueAction.SUSPEND, queue, actor, via)


def queue_resume(queue: Queue, actor: Actor, via: str) -> int:
    """Deliver from the queue again."""
    return _queue_action(QueueAction.RESUME, queue, actor, via)


def _queue_has_waiting() -> Exists:
    return Exists(
        Recipient.objects.filter(queue=OuterRef("pk"), state__in=WAITING_RECIPIENT_STATES)
    )


def _delivery_queues(queryset: QuerySet[Queue]) -> QuerySet[Queue]:
    return queryset.exclude(delivery_type=DeliveryType.SUBMISSION)


# The queues of a selection each action changes: exactly those its core above
# accepts without an ActionConflict. The preview counts this query and the
# bulk form runs on it, so the two cannot disagree.
QUEUE_SELECTIONS: dict[str, Callable[[QuerySet[Queue]], QuerySet[Queue]]] = {
    QueueAction.RETRY: lambda qs: _delivery_queues(qs).filter(
        _queue_has_waiting(),
        Q(delivery_type=DeliveryType.UNREACHABLE) | Q(link__isnull=False),
        suspended=False,
    ),
    QueueAction.RESUBMIT: lambda qs: _delivery_queues(qs).filter(_queue_has_waiting()),
    QueueAction.SUSPEND: lambda qs: _delivery_queues(qs).filter(suspended=False),
    QueueAction.RESUME: lambda qs: _delivery_queues(qs).filter(suspended=True),
}


def queues_select(action: str, queryset: QuerySet[Queue]) -> QuerySet[Queue]:
    """The queues of a selection that ``queues_apply(action, …)`` changes."""
    return QUEUE_SELECTIONS[QueueAction(action).value](queryset)


def queues_apply(
    action: str,
    queryset: QuerySet[Queue],
    actor: Actor,
    via: str,
    *,
    ids: Sequence[int] = (),
    filter: Mapping[str, Any] | None = None,
) -> int:
    """Apply a queue action to every queue of a selection where it makes sense.

    Returns how many queues it changed; one audit entry for the whole selection.
    """
    action = QueueAction(action).value
    changed = 0
    messages = 0
    with transaction.atomic():
        selected = queues_select(action, queryset).select_for_update(of=("self",))
        for queue in selected.select_related("link").order_by("id"):
            try:
                with transaction.atomic():
                    messages += _QUEUE_ACTIONS[action](queue, clock.now())
            except ActionConflict:  # changed between the selection and its lock
                continue
            changed += 1
        _audit(
            actor,
            via,
            f"queue_{action}",
            "queue",
            ids=ids,
            filter=filter,
            count=changed,
            detail=f"{messages} messages",
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
    apply: Callable[[list[int], datetime], int],
    detail: str = "",
) -> int:
    with transaction.atomic():
        locked = _locked_message(message)
        check(locked)
        count = apply([locked.pk], clock.now())
        _audit(
            actor, via, f"message_{action}", "message", ids=[locked.pk], count=count, detail=detail
        )
    message.refresh_from_db()
    return count


def message_suspend(message: Message, actor: Actor, via: str) -> int:
    """Hold the message: no recipient of it is tried until it is resumed."""

    def check(m: Message) -> None:
        _require_live(m, "suspend")
        if m.suspended:
            raise ActionConflict(f"message {m.qid} is already suspended")

    return _message_action("suspend", message, actor, via, check, lambda ids, now: _suspend(ids))


def message_resume(message: Message, actor: Actor, via: str) -> int:
    """Release a suspended message (one parked in Poison goes back to the categorizer)."""

    def check(m: Message) -> None:
        _require_live(m, "resume")
        if not m.suspended:
            raise ActionConflict(f"message {m.qid} is not suspended")

    return _message_action("resume", message, actor, via, check, _resume)


def message_resubmit(message: Message, actor: Actor, via: str) -> int:
    """Send the message's waiting recipients back to the categorizer, due now.

    A finished message in the Dead-letter queue is resubmitted whole: its failed
    and expired recipients go back to the categorizer with a fresh expiry.
    """

    def check(m: Message) -> None:
        if m.state == MessageState.DONE and _dead_letters([m.pk]).exists():
            return  # a dead letter: resubmittable (MSMQ), see _revive_dead_letters
        _require_live(m, "resubmit")
        _require_not_categorizing(m, "resubmit")
        if not Recipient.objects.filter(message=m, state__in=WAITING_RECIPIENT_STATES).exists():
            raise ActionConflict(
                f"message {m.qid} has no recipient waiting in a queue "
                "(they are in the categorizer or being delivered right now)"
            )

    return _message_action("resubmit", message, actor, via, check, _resubmit)


def message_remove(message: Message, actor: Actor, via: str, ndr: bool = False) -> int:
    """Fail every recipient not yet final, with or without a non-delivery report.

    Refused while the categorizer or a delivery holds the message (it would
    overwrite the removal); suspend it first and try again after that round.
    """

    def check(m: Message) -> None:
        _require_live(m, "remove")
        _require_not_categorizing(m, "remove")
        in_flight = Recipient.objects.filter(message=m, state=RecipientState.ACTIVE).count()
        if in_flight:
            raise ActionConflict(
                f"message {m.qid} is being delivered right now ({in_flight} recipients in "
                "flight); suspend it and remove it after this delivery round"
            )

    def apply(ids: list[int], now: datetime) -> int:
        return len(_remove(ids, now, actor, ndr))

    return _message_action(
        "remove", message, actor, via, check, apply, detail="with NDR" if ndr else "without NDR"
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
}


def messages_select(action: str, queryset: QuerySet[Message]) -> QuerySet[Message]:
    """The messages of a selection that ``messages_apply(action, …)`` changes."""
    return MESSAGE_SELECTIONS[MessageAction(action).value](queryset)


def messages_apply(
    action: str,
    queryset: QuerySet[Message],
    actor: Actor,
    via: str,
    *,
    ndr: bool = False,
    ids: Sequence[int] = (),
    filter: Mapping[str, Any] | None = None,
) -> int:
    """Apply a message action to every message of a selection where it makes sense.

    ``ids`` or ``filter`` say how the selection was made (for the audit log).
    Messages for which the action makes no sense (done, already suspended,
    in the categorizer or in flight) are skipped: ``messages_select`` says
    which. Returns how many changed.
    """
    action = MessageAction(action).value
    with transaction.atomic():
        now = clock.now()
        # Lock what we change: the categorizer and deliveries skip locked rows.
        message_ids = list(
            messages_select(action, queryset)
            .select_for_update(of=("self",))
            .order_by("id")
            .values_list("id", flat=True)
        )
        if action == MessageAction.SUSPEND:
            count = _suspend(message_ids)
        elif action == MessageAction.RESUME:
            count = _resume(message_ids, now)
        elif action == MessageAction.RESUBMIT:
            count = _resubmit(message_ids, now)
        else:
            count = len(_remove(message_ids, now, actor, ndr))
        _audit(
            actor,
            via,
            f"message_{action}",
            "message",
            ids=ids,
            filter=filter,
            count=count,
            detail=("with NDR" if ndr else "without NDR") if action == MessageAction.REMOVE else "",
        )
    return count


__all__ = [
    "ActionConflict",
    "ActionTooLarge",
    "MessageAction",
    "QueueAction",
    "Via",
    "message_export",
    "message_export_pieces",
    "message_export_size",
    "message_remove",
    "message_resubmit",
    "message_resume",
    "message_suspend",
    "messages_apply",
    "messages_export_zip",
    "messages_select",
    "messages_export_zip_file",
    "queue_resubmit",
    "queue_resume",
    "queue_retry",
    "queue_suspend",
    "queues_apply",
    "queues_select",
]
