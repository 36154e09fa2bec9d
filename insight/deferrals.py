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
from dataclasses import dataclass
from datetime import datetime, timedelta

from django.db import transaction

from insight.groups import (
    GROUPS_PER_QUEUE,
    OTHER_TEXT,
    TREND_SLICES,
    Group,
    Groups,
    compute,
    name_groups,
    refresh_period,
    stored_in_use,
)
from insight.incidents import INCIDENTS_STORED, aggregate
from insight.models import DeferralGroup, IncidentSummary, InsightRefresh
from queues.lib import clock


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


def refresh_due(now: datetime) -> bool:
    state = InsightRefresh.objects.order_by("-computed_at").first()
    return state is None or state.computed_at <= now - refresh_period(state) + timedelta(seconds=1)


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
    name_groups(groups)
    total = state.deferred if queue_id is None else sum(g.recipients for g in groups)
    return Groups(groups, state.computed_at, total)


def by_queue(groups: list[Group]) -> dict[int, list[Group]]:
    out: dict[int, list[Group]] = defaultdict(list)
    for g in groups:
        out[g.queue_id].append(g)
    return out


# --- deferrals grouped by error, for the Queue Viewer and /api/v1/errors/ ----------


@dataclass
class ErrorGroup:
    queue_id: int
    queue_name: str
    code: int | None
    enhanced: str
    text: str  # normalised (error_normalize): the value of the error_group filter
    recipients: int
    other: bool = False  # the summary's "other errors" row of a queue


def error_groups(queue_id: int | None = None, limit: int = 200) -> list[ErrorGroup]:
    """The distinct last errors of deferred recipients per queue, normalised, with counts.

    Each group links to its messages with the filter ``queue=<id>&error_group=<text>``.
    Live while the queue is small; with a large one (a million messages) the summary
    the periodic refresh stores, so this answers in milliseconds.
    """
    found = deferral_groups(clock.now(), queue_id, limit).groups
    groups = [
        ErrorGroup(g.queue_id, g.queue_name, g.code, g.enhanced, g.text, g.recipients, g.other)
        for g in found
    ]
    groups.sort(key=lambda g: (-g.recipients, g.queue_name, g.text))
    return groups[:limit]
