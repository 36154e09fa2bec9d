"""Queue counts, rates and history, qshape and deferrals by error: the numbers
the Queue Viewer shows without counting messages on every page view.

A queue's count is the messages it holds, as ``queues.holdings`` defines it
(one definition for every view and action).

``queues_recount(now)`` runs from the periodic sweep. It refreshes every
queue's message count, oldest message, incoming and outgoing rate in one
GROUP BY over what the queues hold (plus a few lookups by primary key),
and writes one ``QueueSample`` per busy queue (and one total) for the
last-hour charts. Samples older than two hours are pruned in the same pass.

``current_counts(now)`` is what every view calls before it reads the counts:
while the queues are small it recounts them for that read (exact), else the
counts are the sweep's and every view says how old they are.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from datetime import datetime, timedelta

from django.db import connection, transaction
from django.db.models import Count, Max, Min, Q, Sum

from queues.config import store_settings
from queues.holdings import tally_sql
from queues.models import (
    WAITING_RECIPIENT_STATES,
    Attempt,
    AttemptOutcome,
    DeliveryType,
    Message,
    Queue,
    QueueSample,
    Recipient,
)
from queues.placement import special_queue

SAMPLE_RETENTION = timedelta(hours=2)
HISTORY_WINDOW = timedelta(hours=1)

# Postfix qshape's default buckets: ages up to 5, 10, 20, … 1280 minutes, then older.
QSHAPE_EDGES_MINUTES = (5, 10, 20, 40, 80, 160, 320, 640, 1280)

# What a queue's message count covers: queues.holdings (one definition).


@dataclass
class _Tally:
    depth: int = 0
    oldest_id: int | None = None
    delivered: int = 0
    failed: int = 0


def _per_minute(count: int, seconds: float) -> float:
    return round(count * 60.0 / seconds, 2) if seconds > 0 else 0.0


# The recount and the read path's refresh write the same queue rows: one at a
# time (a transaction-level advisory lock), so their updates never interleave.
COUNT_LOCK = 0x6D72_636F_756E74  # "mrcount"


def _count_lock() -> None:
    if connection.vendor != "postgresql":
        return  # SQLite serialises writers: its transactions are IMMEDIATE
    with connection.cursor() as cur:
        cur.execute("SELECT pg_advisory_xact_lock(%s)", [COUNT_LOCK])


def _holdings() -> dict[int, _Tally]:
    """What every queue holds (queues.holdings), in one statement: one snapshot."""
    tallies: dict[int, _Tally] = defaultdict(_Tally)
    sql, params = tally_sql()
    with connection.cursor() as cur:
        cur.execute(sql, params)
        for queue_id, depth, oldest in cur.fetchall():
            tallies[queue_id].depth, tallies[queue_id].oldest_id = depth, oldest
    return tallies


def _received(tallies: dict[int, _Tally]) -> dict[int, datetime]:
    oldest_ids = [t.oldest_id for t in tallies.values() if t.oldest_id is not None]
    return dict(Message.objects.filter(id__in=oldest_ids).values_list("id", "received_at"))


@dataclass(frozen=True)
class CountsAsOf:
    """When the queue rows' counts were true: ``exact`` when counted for this
    read, else the sweep's last recount (``at``; None: never counted)."""

    at: datetime | None
    exact: bool

    def age_seconds(self, now: datetime) -> int | None:
        if self.exact:
            return 0
        return None if self.at is None else max(int((now - self.at).total_seconds()), 0)

    def text(self, now: datetime) -> str:
        """ "" when exact; else "as of 12 s ago" (or "not counted yet")."""
        if self.exact:
            return ""
        age = self.age_seconds(now)
        if age is None:
            return "not counted yet"
        if age < 120:
            return f"as of {age} s ago"
        if age < 7200:
            return f"as of {age // 60} min ago"
        return f"as of {age // 3600} h ago"

    def as_dict(self, now: datetime) -> dict[str, object]:
        return {
            "counted_at": self.at.isoformat() if self.at else None,
            "exact": self.exact,
            "age_seconds": self.age_seconds(now),
        }


def refresh_counts(now: datetime) -> None:
    """Make every queue row's message_count and oldest_received_at what the queue
    holds now (the read path; rates and samples stay the sweep's)."""
    with transaction.atomic():
        _count_lock()
        tallies = _holdings()
        received = _received(tallies)
        changed = []
        for queue in Queue.objects.only("id", "message_count", "oldest_received_at"):
            tally = tallies.get(queue.pk, _Tally())
            oldest = received.get(tally.oldest_id) if tally.oldest_id is not None else None
            if queue.message_count != tally.depth or queue.oldest_received_at != oldest:
                queue.message_count, queue.oldest_received_at = tally.depth, oldest
                changed.append(queue)
        if changed:
            Queue.objects.bulk_update(
                changed, ["message_count", "oldest_received_at"], batch_size=500
            )


def current_counts(now: datetime) -> CountsAsOf:
    """The queue counts every view reads, made exact first when that is cheap.

    While the queues hold at most ``MAILRELAY_LIVE_COUNTS_UP_TO`` messages (by
    the counts on record) they are recounted for this read, in one statement;
    above it (a million queued) a read costs one aggregate and the counts are
    the sweep's, dated by its last recount."""
    stamp = Queue.objects.aggregate(at=Min("counted_at"), total=Sum("message_count"))
    if (stamp["total"] or 0) <= store_settings().live_counts_up_to:
        refresh_counts(now)
        return CountsAsOf(now, exact=True)
    return CountsAsOf(stamp["at"], exact=False)


def queues_recount(now: datetime) -> None:
    """Refresh Queue.message_count / counted_at / rates / oldest, and sample them.

    Steps:
    1. what every queue holds (queues.holdings): distinct messages and the
       oldest (lowest) message id per queue, in one statement;
    2. the oldest messages' received_at, by primary key;
    3. the attempts recorded since the previous recount (ids past the mark
       kept in the previous total sample): delivered and failed per queue;
    4. arrivals: in total, the messages stored since the previous recount;
       per queue, the change in depth since the previous sample plus what
       left it (never below zero);
    5. in one transaction: update the queues whose numbers changed, write the
       samples (busy queues and the total), prune samples older than two hours.

    All of it under the count lock: a refresh of the read path never writes
    between this count and its write.
    """
    with transaction.atomic():
        _count_lock()
        _recount(now)


def _since(
    previous: QueueSample | None,
    tallies: dict[int, _Tally],
    attempt_mark: int,
    message_mark: int,
    now: datetime,
) -> tuple[float, int, dict[int, int]]:
    """What happened since the previous recount: its age in seconds, the messages
    that arrived, each queue's depth then; each tally gets its queue's delivered
    and failed attempts. Nothing (0, 0, {}) at the first recount."""
    if previous is None:
        return 0.0, 0, {}
    seconds = max((now - previous.sampled_at).total_seconds(), 0.0)
    # The depth each queue had at the previous recount (a queue without a
    # sample then held nothing): the read path's refreshes do not move it.
    before = dict(
        QueueSample.objects.filter(sampled_at=previous.sampled_at, queue__isnull=False).values_list(
            "queue_id", "depth"
        )
    )
    outcomes = (
        Attempt.objects.filter(id__gt=previous.attempt_mark, id__lte=attempt_mark)
        .filter(queue__isnull=False)
        .values("queue_id")
        .annotate(
            delivered=Count("id", filter=Q(outcome=AttemptOutcome.DELIVERED)),
            failed=Count("id", filter=Q(outcome=AttemptOutcome.FAILED)),
        )
        .order_by()
    )
    for row in outcomes:
        tally = tallies[row["queue_id"]]
        tally.delivered, tally.failed = row["delivered"], row["failed"]
    arrived_total = Message.objects.filter(
        id__gt=previous.message_mark, id__lte=message_mark
    ).count()
    return seconds, arrived_total, before


def _recount(now: datetime) -> None:
    submission = special_queue(DeliveryType.SUBMISSION, now)
    special_queue(DeliveryType.DEAD_LETTER, now)  # shown, and counted, from the start
    tallies = _holdings()
    tallies.setdefault(submission.pk, _Tally())
    received = _received(tallies)

    previous = QueueSample.objects.filter(queue__isnull=True).order_by("-sampled_at", "-id").first()
    attempt_mark = Attempt.objects.aggregate(m=Max("id"))["m"] or 0
    message_mark = Message.objects.aggregate(m=Max("id"))["m"] or 0
    seconds, arrived_total, before = _since(previous, tallies, attempt_mark, message_mark, now)

    queues = list(Queue.objects.all())
    changed: list[Queue] = []
    samples: list[QueueSample] = []
    total = QueueSample(
        sampled_at=now,
        queue=None,
        seconds=seconds,
        depth=0,
        incoming=arrived_total,
        attempt_mark=attempt_mark,
        message_mark=message_mark,
    )
    for queue in queues:
        tally = tallies.get(queue.pk, _Tally())
        left = tally.delivered + tally.failed
        was = before.get(queue.pk, 0)
        incoming = max(tally.depth - was + left, 0) if previous else 0
        oldest = received.get(tally.oldest_id) if tally.oldest_id is not None else None
        values = {
            "message_count": tally.depth,
            "oldest_received_at": oldest,
            "incoming_rate": _per_minute(incoming, seconds),
            "outgoing_rate": _per_minute(left, seconds),
        }
        busy = tally.depth or was or queue.message_count or incoming or left
        if any(getattr(queue, k) != v for k, v in values.items()) or queue.counted_at is None:
            for k, v in values.items():
                setattr(queue, k, v)
            changed.append(queue)
        queue.counted_at = now
        total.depth += tally.depth
        total.delivered += tally.delivered
        total.failed += tally.failed
        if busy:
            samples.append(
                QueueSample(
                    sampled_at=now,
                    queue=queue,
                    seconds=seconds,
                    depth=tally.depth,
                    incoming=incoming,
                    delivered=tally.delivered,
                    failed=tally.failed,
                    attempt_mark=attempt_mark,
                    message_mark=message_mark,
                )
            )
    samples.append(total)

    if changed:
        Queue.objects.bulk_update(
            changed,
            ["message_count", "oldest_received_at", "incoming_rate", "outgoing_rate"],
            batch_size=500,
        )
    # counted_at moves for every queue: one statement, not one per queue.
    Queue.objects.update(counted_at=now)
    QueueSample.objects.bulk_create(samples, batch_size=1000)
    QueueSample.objects.filter(sampled_at__lt=now - SAMPLE_RETENTION).delete()


# --- history (the last-hour chart) ------------------------------------------------


@dataclass
class HistoryPoint:
    at: datetime
    depth: int
    incoming_per_minute: float
    delivered_per_minute: float
    failed_per_minute: float


def queue_history(
    queue_id: int | None, now: datetime, window: timedelta = HISTORY_WINDOW
) -> list[HistoryPoint]:
    """Depth and rates of one queue (``None``: all queues) over the last ``window``."""
    rows = QueueSample.objects.filter(
        queue_id=queue_id, sampled_at__gte=now - window, sampled_at__lte=now
    ).order_by("sampled_at")
    return [
        HistoryPoint(
            at=s.sampled_at,
            depth=s.depth,
            incoming_per_minute=_per_minute(s.incoming, s.seconds),
            delivered_per_minute=_per_minute(s.delivered, s.seconds),
            failed_per_minute=_per_minute(s.failed, s.seconds),
        )
        for s in rows
    ]


# --- qshape ---------------------------------------------------------------------


@dataclass
class QShapeRow:
    key: str  # queue name or recipient domain
    queue_id: int | None
    total: int
    counts: list[int]  # one per bucket, youngest first


@dataclass
class QShape:
    buckets: list[str]  # "5" … "1280" (minutes, up to), then "1280+"
    total: QShapeRow
    rows: list[QShapeRow] = field(default_factory=list)


def _first_id_received_since(when: datetime) -> int:
    first = (
        Message.objects.filter(received_at__gte=when)
        .order_by("received_at", "id")
        .values_list("id", flat=True)
        .first()
    )
    return first if first is not None else (Message.objects.aggregate(m=Max("id"))["m"] or 0) + 1


def qshape(now: datetime, by: str = "queue", top: int | None = None) -> QShape:
    """Postfix's qshape: waiting recipients per destination and age bucket.

    ``by`` is ``queue`` (the delivery queue: one per next-hop domain) or
    ``domain`` (the recipient's domain). Ages are the message's time in the
    store. Steps:
    1. for each bucket edge, the first message id received since then (an
       index lookup; ids grow with arrival, so an id range is an age range);
    2. one GROUP BY over the waiting recipients with a count per id range.
    """
    if by not in ("queue", "domain"):
        raise ValueError("by: queue or domain")
    edges = [_first_id_received_since(now - timedelta(minutes=m)) for m in QSHAPE_EDGES_MINUTES]
    buckets: dict[str, Count] = {}
    upper: int | None = None
    for i, lower in enumerate(edges):
        cond = Q(message_id__gte=lower)
        if upper is not None:
            cond &= Q(message_id__lt=upper)
        buckets[f"b{i}"] = Count("id", filter=cond)
        upper = lower
    buckets[f"b{len(edges)}"] = Count("id", filter=Q(message_id__lt=upper))
    group = "queue_id" if by == "queue" else "domain"
    rows = (
        Recipient.objects.filter(state__in=WAITING_RECIPIENT_STATES, queue__isnull=False)
        .values(group)
        .annotate(total=Count("id"), **buckets)
        .order_by()
    )
    names = dict(Queue.objects.values_list("id", "name")) if by == "queue" else {}
    out: list[QShapeRow] = []
    for row in rows:
        counts = [row[f"b{i}"] for i in range(len(edges) + 1)]
        if by == "queue":
            name = names.get(row["queue_id"], "?")
            out.append(QShapeRow(name, row["queue_id"], row["total"], counts))
        else:
            out.append(QShapeRow(row["domain"], None, row["total"], counts))
    out.sort(key=lambda r: (-r.total, r.key))
    total = QShapeRow(
        "TOTAL",
        None,
        sum(r.total for r in out),
        [sum(r.counts[i] for r in out) for i in range(len(edges) + 1)],
    )
    labels = [str(m) for m in QSHAPE_EDGES_MINUTES] + [f"{QSHAPE_EDGES_MINUTES[-1]}+"]
    return QShape(labels, total, out[:top] if top else out)
