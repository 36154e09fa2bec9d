"""What a queue holds: the one definition behind every count, list, page, API
field, CLI table and action of the operator surface.

- **Submission**: the messages waiting for the categorizer or in it
  (message state ``submission`` or ``categorizing``).
- **Dead-letter**: finished messages with a failed or expired recipient kept
  there (MSMQ's dead letters; the sweep purges them after
  ``MAILRELAY_DEAD_LETTER_RETENTION``).
- **Every other queue** (the delivery queues, Unreachable, Poison): the
  messages with a recipient waiting there (queued, deferred) or in flight from
  there (active).

A queue's count is the number of distinct messages it holds. ``held_count``
counts one queue now; ``tally_sql`` counts every queue in one statement (one
snapshot: a message moving from one queue to another is never counted twice
or missed), which the sweep's recount and the read path's refresh
(queues.services.counts) run.
"""

from __future__ import annotations

from collections.abc import Iterable
from datetime import datetime

from django.db.models import Exists, OuterRef, Q, QuerySet, Subquery

from queues.models import (
    DeliveryType,
    LinkState,
    Message,
    MessageState,
    Queue,
    Recipient,
    RecipientState,
)

# Recipients a delivery, Unreachable or Poison queue holds.
HELD_STATES = (RecipientState.QUEUED, RecipientState.DEFERRED, RecipientState.ACTIVE)
# Recipients the Dead-letter queue holds (of finished messages).
DEAD_STATES = (RecipientState.FAILED, RecipientState.EXPIRED)
# Messages the Submission queue holds.
SUBMISSION_STATES = (MessageState.SUBMISSION, MessageState.CATEGORIZING)


def held_recipients_q(delivery_type: str) -> Q:
    """The condition on a Recipient (besides its queue) for a queue of this type to hold it."""
    if delivery_type == DeliveryType.DEAD_LETTER:
        return Q(state__in=DEAD_STATES, message__state=MessageState.DONE)
    return Q(state__in=HELD_STATES)


def held_recipients(queue: Queue) -> QuerySet[Recipient]:
    """The recipients ``queue`` holds (none for Submission: its recipients have no queue)."""
    if queue.delivery_type == DeliveryType.SUBMISSION:
        return Recipient.objects.filter(
            state=RecipientState.SUBMITTED, message__state__in=SUBMISSION_STATES
        )
    return Recipient.objects.filter(held_recipients_q(queue.delivery_type), queue=queue)


def holds_q(queue: Queue) -> Q:
    """The condition on a Message for ``queue`` to hold it (the ``queue`` filter)."""
    if queue.delivery_type == DeliveryType.SUBMISSION:
        return Q(state__in=SUBMISSION_STATES)
    rows = Recipient.objects.filter(
        held_recipients_q(queue.delivery_type), message=OuterRef("pk"), queue=queue
    )
    if queue.delivery_type == DeliveryType.DEAD_LETTER:
        return Q(state=MessageState.DONE) & Q(Exists(rows))
    return Q(Exists(rows))


def queue_messages(queue: Queue, base: QuerySet[Message] | None = None) -> QuerySet[Message]:
    """The messages ``queue`` holds: what its page lists and its count counts."""
    qs = base if base is not None else Message.objects.all()
    return qs.filter(holds_q(queue))


def held_count(queue: Queue) -> int:
    """How many messages ``queue`` holds right now (exact; one indexed count)."""
    if queue.delivery_type == DeliveryType.SUBMISSION:
        return Message.objects.filter(state__in=SUBMISSION_STATES).count()
    return held_recipients(queue).values("message_id").distinct().count()


def next_attempts(queues: Iterable[Queue]) -> dict[int, datetime | None]:
    """When each queue's mail is tried next: the earliest next attempt over the
    recipients it holds (of messages not suspended), and not before its link's
    retry time while the link is in Retry; None when nothing is to be tried (a
    suspended queue, Dead-letter, Poison's held messages, an empty queue).

    One query for all the queues: per queue an index probe of recipient_waiting
    (queue, next_attempt_at) with LIMIT 1; Submission by message_submission_due.
    """
    queues = list(queues)
    waiting = (
        Recipient.objects.filter(
            queue=OuterRef("pk"),
            state__in=(RecipientState.QUEUED, RecipientState.DEFERRED),
            message__suspended=False,
        )
        .order_by("next_attempt_at")
        .values("next_attempt_at")[:1]
    )
    ids = [q.pk for q in queues if q.delivery_type != DeliveryType.SUBMISSION]
    earliest = dict(
        Queue.objects.filter(id__in=ids)
        .annotate(first=Subquery(waiting))
        .values_list("id", "first")
    )
    out: dict[int, datetime | None] = {}
    for queue in queues:
        if queue.delivery_type == DeliveryType.SUBMISSION:
            out[queue.pk] = (
                Message.objects.filter(state=MessageState.SUBMISSION, suspended=False)
                .order_by("next_attempt_at")
                .values_list("next_attempt_at", flat=True)
                .first()
            )
            continue
        when = earliest.get(queue.pk)
        if queue.suspended or queue.delivery_type == DeliveryType.DEAD_LETTER or when is None:
            out[queue.pk] = None
            continue
        link = queue.link if queue.link_id else None
        if link is not None and link.state == LinkState.RETRY and link.next_retry_at:
            when = max(when, link.next_retry_at)
        out[queue.pk] = when
    return out


def tally_sql() -> tuple[str, list]:
    """(queue_id, messages, oldest message id) for every queue holding something,
    in one statement. Each branch matches one partial index (recipient_waiting,
    recipient_active_lease; the Dead-letter rows by their queue; the Submission
    messages by message_submission_due and message_categorizing_lease), so the
    cost follows what is queued, not the delivered history."""
    r, m, q = (model._meta.db_table for model in (Recipient, Message, Queue))
    sql = (
        "SELECT queue_id, COUNT(DISTINCT message_id), MIN(message_id) FROM ("
        f"SELECT queue_id, message_id FROM {r} WHERE state IN (%s, %s) AND queue_id IS NOT NULL "
        f"UNION ALL SELECT queue_id, message_id FROM {r} "
        "WHERE state = %s AND queue_id IS NOT NULL "
        f"UNION ALL SELECT d.queue_id, d.message_id FROM {r} AS d JOIN {m} AS dm "
        "ON dm.id = d.message_id AND dm.state = %s "
        "WHERE d.state IN (%s, %s) "
        f"AND d.queue_id IN (SELECT id FROM {q} WHERE delivery_type = %s) "
        f"UNION ALL SELECT sq.id, s.id FROM {m} AS s, {q} AS sq "
        "WHERE s.state = %s AND sq.delivery_type = %s "
        f"UNION ALL SELECT sq.id, s.id FROM {m} AS s, {q} AS sq "
        "WHERE s.state = %s AND sq.delivery_type = %s"
        ") AS held GROUP BY queue_id"
    )
    params = [
        RecipientState.QUEUED,
        RecipientState.DEFERRED,
        RecipientState.ACTIVE,
        MessageState.DONE,
        *DEAD_STATES,
        DeliveryType.DEAD_LETTER,
        MessageState.SUBMISSION,
        DeliveryType.SUBMISSION,
        MessageState.CATEGORIZING,
        DeliveryType.SUBMISSION,
    ]
    return sql, [str(p) for p in params]


__all__ = [
    "DEAD_STATES",
    "HELD_STATES",
    "SUBMISSION_STATES",
    "held_count",
    "held_recipients",
    "held_recipients_q",
    "holds_q",
    "next_attempts",
    "queue_messages",
    "tally_sql",
]
