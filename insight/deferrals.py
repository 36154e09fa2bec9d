"""Deferred recipients grouped by queue and normalised last error: computed live
while the queue is small, served from a summary refreshed in the background
when it is large.

Why: the GROUP BY over every deferred recipient (normalising each last reply
with a regular expression) costs 0.6-1.7 s with a million messages queued,
and ``/deferrals/``, ``/api/v1/errors/`` and the incidents must answer in
under 200 ms. So the periodic task (``insight.tasks.refresh``, every
``MAILRELAY_INSIGHT_REFRESH_INTERVAL``, or ten times the last refresh's own
duration when that is longer) runs that GROUP BY once and stores a bounded
summary: per queue its ``GROUPS_PER_QUEUE`` largest groups plus one "other
errors" row for the rest (``DeferralGroup``: at most 21 rows per queue with
deferrals, however varied the replies), and the incidents already aggregated
by provider and by error, the largest ``INCIDENTS_STORED`` of each
(``IncidentSummary``). While the last refresh counted at least
``MAILRELAY_INSIGHT_LIVE_LIMIT`` deferred recipients and is recent (three
intervals), readers get the stored rows — each read one small indexed query
(the largest first, ``LIMIT``), at most one interval old, and they say so
(``as_of``). Below the limit every read is live and exact.

The error text is normalised in SQL (``ERROR_TOKEN_SQL``) so the GROUP BY
already merges replies that differ only in numbers and ids, then again in
Python (``error_normalize``, the same token class) for white space.
"""

from __future__ import annotations

import time
from collections import defaultdict
from dataclasses import dataclass, field
from datetime import datetime, timedelta

from django.conf import settings
from django.db import connection, transaction
from django.db.models import Count, F, Func, Max, Min, Q, TextField, Value

from insight.models import DeferralGroup, IncidentSummary, InsightRefresh
from queues.filters import ERROR_TOKEN_SQL, error_normalize
from queues.models import Queue, Recipient, RecipientState

TREND_SLICES = 6
TREND_SLICE = timedelta(minutes=10)
GROUPS_PER_QUEUE = 20  # stored per queue; the rest merged into one "other errors" row
OTHER_TEXT = "(other errors)"


@dataclass
class Group:
    queue_id: int
    queue_name: str
    code: int | None
    enhanced: str
    text: str  # normalised (queues.filters.error_normalize): the error_group filter
    recipients: int
    senders: int  # distinct senders (summed over groups merged by white space: at most)
    first_seen: datetime | None
    last_seen: datetime | None
    trend: list[int] = field(default_factory=lambda: [0] * TREND_SLICES)
    other: bool = False  # the stored "other errors" row of a queue (several texts)

    def merge(self, g: Group) -> None:
        self.recipients += g.recipients
        self.senders += g.senders
        self.first_seen = _min(self.first_seen, g.first_seen)
        self.last_seen = _max(self.last_seen, g.last_seen)
        self.trend = [a + b for a, b in zip(self.trend, g.trend, strict=False)]


@dataclass
class Groups:
    groups: list[Group]
    as_of: datetime | None  # None: live; else the time of the stored summary
    deferred: int


def _slices(now: datetime) -> list[tuple[datetime, datetime]]:
    start = now - TREND_SLICES * TREND_SLICE
    return [(start + i * TREND_SLICE, start + (i + 1) * TREND_SLICE) for i in range(TREND_SLICES)]


def compute(now: datetime, queue_id: int | None = None) -> list[Group]:
    """The live GROUP BY (one query), merged after normalisation in Python."""
    qs = Recipient.objects.filter(state=RecipientState.DEFERRED, queue__isnull=False)
    if queue_id is not None:
        qs = qs.filter(queue_id=queue_id)
    if connection.vendor == "postgresql":
        text = Func(
            F("last_text"),
            Value(ERROR_TOKEN_SQL),
            Value("#"),
            Value("g"),
            function="regexp_replace",
            output_field=TextField(),
        )
    else:
        text = F("last_text")
    trend = {
        f"t{i}": Count("id", filter=Q(last_attempt_at__gte=lo, last_attempt_at__lt=hi))
        for i, (lo, hi) in enumerate(_slices(now))
    }
    rows = (
        qs.annotate(norm=text)
        .values("queue_id", "last_code", "last_enhanced", "norm")
        .annotate(
            n=Count("id"),
            senders=Count("message__mail_from", distinct=True),
            first=Min("first_failure_at"),
            last=Max("last_attempt_at"),
            **trend,
        )
        .order_by()
    )
    merged: dict[tuple[int, int | None, str, str], Group] = {}
    for row in rows:
        norm = error_normalize(row["norm"] or "")
        key = (row["queue_id"], row["last_code"], row["last_enhanced"] or "", norm)
        g = merged.get(key)
        if g is None:
            g = merged[key] = Group(key[0], "", key[1], key[2], norm, 0, 0, None, None)
        g.merge(
            Group(
                key[0],
                "",
                key[1],
                key[2],
                norm,
                row["n"],
                row["senders"],
                row["first"],
                row["last"],
                [row[f"t{i}"] for i in range(TREND_SLICES)],
            )
        )
    _name(merged.values())
    return list(merged.values())


def _min(a: datetime | None, b: datetime | None) -> datetime | None:
    return b if a is None else a if b is None else min(a, b)


def _max(a: datetime | None, b: datetime | None) -> datetime | None:
    return b if a is None else a if b is None else max(a, b)


def _name(groups) -> None:
    groups = list(groups)
    names = dict(
        Queue.objects.filter(id__in={g.queue_id for g in groups}).values_list("id", "name")
    )
    for g in groups:
        g.queue_name = names.get(g.queue_id, "?")


def bounded(groups: list[Group], per_queue: int = GROUPS_PER_QUEUE) -> list[Group]:
    """Each queue's ``per_queue`` largest groups, and one "other errors" row with
    the rest of that queue (what the summary stores: its size bounded by the
    number of queues, whatever the variety of replies)."""
    out: list[Group] = []
    for queue_id, mine in by_queue(groups).items():
        mine.sort(key=lambda g: (-g.recipients, g.code or 0, g.text))
        out += mine[:per_queue]
        rest = mine[per_queue:]
        if rest:
            other = Group(queue_id, rest[0].queue_name, None, "", OTHER_TEXT, 0, 0, None, None)
            other.other = True
            for g in rest:
                other.merge(g)
            out.append(other)
    return out


def refresh(now: datetime) -> InsightRefresh:
    """Recompute every group and store the bounded summary and the incidents
    (one transaction): the periodic task."""
    from insight.incidents import INCIDENTS_STORED, aggregate

    started = time.monotonic()
    groups = compute(now)
    by_provider, by_error = aggregate(groups, INCIDENTS_STORED)
    incidents = [i.stored(by_error=False) for i in by_provider]
    incidents += [i.stored(by_error=True) for i in by_error]
    rows = [
        DeferralGroup(
            queue_id=g.queue_id,
            code=g.code,
            enhanced=g.enhanced,
            text=g.text,
            recipients=g.recipients,
            senders=g.senders,
            first_seen=g.first_seen,
            last_seen=g.last_seen,
            trend=g.trend,
            other=g.other,
        )
        for g in bounded(groups)
    ]
    with transaction.atomic():
        DeferralGroup.objects.all().delete()
        DeferralGroup.objects.bulk_create(rows, batch_size=1000)
        IncidentSummary.objects.all().delete()
        IncidentSummary.objects.bulk_create(incidents, batch_size=1000)
        state = InsightRefresh.objects.select_for_update().first() or InsightRefresh(
            computed_at=now
        )
        state.computed_at = now
        state.deferred = sum(g.recipients for g in groups)
        state.seconds = round(time.monotonic() - started, 3)
        state.save()
    return state


def _period(state: InsightRefresh | None) -> timedelta:
    """How often the summary is refreshed: the interval, or ten times what the last
    refresh cost when that is longer (it takes at most a tenth of one core)."""
    interval = settings.MAILRELAY_INSIGHT_REFRESH_INTERVAL
    if state is None:
        return interval
    return max(interval, timedelta(seconds=10 * state.seconds))


def refresh_due(now: datetime) -> bool:
    state = InsightRefresh.objects.order_by("-computed_at").first()
    return state is None or state.computed_at <= now - _period(state) + timedelta(seconds=1)


def stored_in_use(now: datetime) -> InsightRefresh | None:
    state = InsightRefresh.objects.order_by("-computed_at").first()
    if state is None or state.deferred < settings.MAILRELAY_INSIGHT_LIVE_LIMIT:
        return None
    if state.computed_at < now - 3 * _period(state):
        return None  # the refresh stopped: exact (and slow) beats stale
    return state


def deferral_groups(now: datetime, queue_id: int | None = None, limit: int | None = None) -> Groups:
    """The groups, live or stored (see the module doc); ``limit``: the largest only."""
    state = stored_in_use(now)
    if state is None:
        groups = compute(now, queue_id)
        total = sum(g.recipients for g in groups)
        if limit is not None:
            groups = sorted(groups, key=lambda g: -g.recipients)[:limit]
        return Groups(groups, None, total)
    qs = DeferralGroup.objects.all()
    if queue_id is not None:
        qs = qs.filter(queue_id=queue_id)
    if limit is not None:
        qs = qs.order_by("-recipients", "id")[:limit]
    groups = [
        Group(
            d.queue_id,
            "",
            d.code,
            d.enhanced,
            d.text,
            d.recipients,
            d.senders,
            d.first_seen,
            d.last_seen,
            list(d.trend) or [0] * TREND_SLICES,
            d.other,
        )
        for d in qs
    ]
    _name(groups)
    total = state.deferred if queue_id is None else sum(g.recipients for g in groups)
    return Groups(groups, state.computed_at, total)


def by_queue(groups: list[Group]) -> dict[int, list[Group]]:
    out: dict[int, list[Group]] = defaultdict(list)
    for g in groups:
        out[g.queue_id].append(g)
    return out
