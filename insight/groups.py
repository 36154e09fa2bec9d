"""Deferred recipients grouped by queue and normalised last error: the groups, the
live GROUP BY and whether the stored summary is in use (insight.deferrals).

Below both readers of the groups: the deferrals summary and the incidents
(insight.incidents) aggregated from them, which the refresh stores together.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime, timedelta

from django.db import connection
from django.db.models import Count, F, Func, Max, Min, Q, TextField, Value

from insight.config import insight_settings
from insight.models import InsightRefresh
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
    name_groups(merged.values())
    return list(merged.values())


def _min(a: datetime | None, b: datetime | None) -> datetime | None:
    return b if a is None else a if b is None else min(a, b)


def _max(a: datetime | None, b: datetime | None) -> datetime | None:
    return b if a is None else a if b is None else max(a, b)


def name_groups(groups) -> None:
    groups = list(groups)
    names = dict(
        Queue.objects.filter(id__in={g.queue_id for g in groups}).values_list("id", "name")
    )
    for g in groups:
        g.queue_name = names.get(g.queue_id, "?")


def refresh_period(state: InsightRefresh | None) -> timedelta:
    """How often the summary is refreshed: the interval, or ten times what the last
    refresh cost when that is longer (it takes at most a tenth of one core)."""
    interval = insight_settings().refresh_interval
    if state is None:
        return interval
    return max(interval, timedelta(seconds=10 * state.seconds))


def stored_in_use(now: datetime) -> InsightRefresh | None:
    state = InsightRefresh.objects.order_by("-computed_at").first()
    if state is None or state.deferred < insight_settings().live_limit:
        return None
    if state.computed_at < now - 3 * refresh_period(state):
        return None  # the refresh stopped: exact (and slow) beats stale
    return state
