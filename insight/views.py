"""Queue Viewer pages of operator insight: Incidents, and a queue's own live page."""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Any

from django.db.models import Count, Max, Min
from django.db.models.functions import TruncMinute
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.shortcuts import get_object_or_404
from django.views.decorators.http import require_GET

from insight.deferrals import deferral_groups
from insight.explain import explain_queue
from insight.incidents import incidents
from queues.filters import MessageFilter, messages_page, messages_prefetch
from queues.lib import clock
from queues.models import Attempt, AttemptOutcome, Queue, QueueSample
from queues.services.counts import current_counts
from queues.ui.views import (
    message_row,
    query_string,
    queue_live_data,
    queue_rows,
    render_page,
    totals_context,
    viewer_required,
)

CHART_WINDOW = timedelta(hours=2)  # QueueSample keeps two hours
TOP_ERRORS = 5
SPARK = "▁▂▃▄▅▆▇█"


def spark(values: list[int]) -> str:
    top = max(values) if values else 0
    if not top:
        return SPARK[0] * len(values)
    return "".join(SPARK[min(len(SPARK) - 1, round(v * (len(SPARK) - 1) / top))] for v in values)


@viewer_required
@require_GET
def incidents_page(request: HttpRequest) -> HttpResponse:
    found = incidents(clock.now())
    rows = []
    for inc in found.by_provider:
        d = inc.as_dict()
        d["spark"] = spark(inc.trend)
        d["queue_links"] = [
            {
                "name": q["name"],
                "query": query_string({"queue": str(q["id"]), "error_group": inc.error}),
            }
            for q in d["queues"]
        ]
        rows.append(d)
    errors = [dict(i.as_dict(), spark=spark(i.trend)) for i in found.by_error]
    return render_page(
        request,
        "insight/incidents.html",
        "incidents",
        incidents=rows,
        errors=errors,
        as_of=found.as_of,
        deferred=found.deferred,
    )


def _first_attempt_id_since(when: datetime) -> int | None:
    """The first Attempt id started at or after ``when``: ids grow with time, so a
    binary search over the primary key (a few lookups) replaces an index on time."""
    bounds = Attempt.objects.aggregate(lo=Min("id"), hi=Max("id"))
    lo, hi = bounds["lo"], bounds["hi"]
    if lo is None:
        return None
    while lo < hi:
        mid = (lo + hi) // 2
        row = Attempt.objects.filter(id__gte=mid).order_by("id").values("id", "started_at").first()
        if row is None or row["started_at"] >= when:
            hi = mid
        else:
            lo = row["id"] + 1
    return lo


def history(queue: Queue, now: datetime) -> list[dict[str, Any]]:
    """The queue's samples (depth, in, out per minute) and its deferrals per minute."""
    since = now - CHART_WINDOW
    samples = list(
        QueueSample.objects.filter(
            queue=queue, sampled_at__gte=since, sampled_at__lte=now
        ).order_by("sampled_at")
    )
    deferred: dict[datetime, int] = {}
    first = _first_attempt_id_since(since)
    if first is not None:
        rows = (
            Attempt.objects.filter(
                id__gte=first, queue=queue, outcome=AttemptOutcome.DEFERRED, started_at__gte=since
            )
            .annotate(minute=TruncMinute("started_at"))
            .values("minute")
            .annotate(n=Count("id"))
            .order_by()
        )
        deferred = {r["minute"]: r["n"] for r in rows}
    points = []
    for s in samples:
        start = s.sampled_at - timedelta(seconds=s.seconds or 60)
        n = sum(v for m, v in deferred.items() if start < m + timedelta(seconds=30) <= s.sampled_at)
        minutes = (s.seconds or 60) / 60
        points.append(
            {
                "t": s.sampled_at.isoformat(),
                "label": s.sampled_at.strftime("%H:%M"),
                "depth": s.depth,
                "in": round(s.incoming / minutes, 2),
                "out": round((s.delivered + s.failed) / minutes, 2),
                "deferred": round(n / minutes, 2),
            }
        )
    return points


HELD_SHOWN = 20  # messages listed on a queue's page (the rest: its messages list)


def _live(queue: Queue, now: datetime, row: dict[str, Any] | None = None) -> dict[str, Any]:
    row = row or queue_rows([queue], now)[0]
    link = queue.link if queue.link_id else None
    groups = sorted(deferral_groups(now, queue.pk).groups, key=lambda g: -g.recipients)
    return {
        "now": now.isoformat(),
        "queue": queue_live_data(row),
        "link": {
            "name": link.name,
            "state": link.state,
            "tls": link.last_tls,
            "failure_count": link.failure_count,
            "next_retry_at": link.next_retry_at.isoformat() if link.next_retry_at else None,
            "last_error": link.last_error,
        }
        if link
        else None,
        "explain": explain_queue(queue, now),
        "top_errors": [
            {
                "code": g.code,
                "enhanced": g.enhanced,
                "text": g.text,
                "recipients": g.recipients,
                "query": query_string(
                    {"queue": str(queue.pk), "status": "retry"}
                    if g.other
                    else {"queue": str(queue.pk), "error_group": g.text}
                ),
            }
            for g in groups[:TOP_ERRORS]
        ],
        "history": history(queue, now),
    }


def _held_rows(queue: Queue) -> list[dict[str, Any]]:
    """The first messages the queue holds, newest first: what its count counts."""
    page = messages_page(MessageFilter(queue=queue.pk), None, None, HELD_SHOWN)
    recipients = messages_prefetch(page.items)
    return [message_row(m, recipients[m.pk]) for m in page.items]


@viewer_required
@require_GET
def queue_page(request: HttpRequest, pk: int) -> HttpResponse:
    now = clock.now()
    counts = current_counts(now)  # before the row is read: the count it shows is this one
    queue = get_object_or_404(Queue.objects.select_related("link"), pk=pk)
    row = queue_rows([queue], now)[0]
    return render_page(
        request,
        "insight/queue.html",
        "queues",
        totals=totals_context(counts, now),
        q=queue,
        row=row,
        live=_live(queue, now, row),
        held=_held_rows(queue),
        held_shown=HELD_SHOWN,
        as_of=counts.text(now),
        messages_query=query_string({"queue": str(queue.pk)}),
    )


@viewer_required
@require_GET
def queue_live(request: HttpRequest, pk: int) -> JsonResponse:
    now = clock.now()
    counts = current_counts(now)
    queue = get_object_or_404(Queue.objects.select_related("link"), pk=pk)
    data = _live(queue, now)
    data["as_of"] = counts.text(now)
    return JsonResponse(data)
