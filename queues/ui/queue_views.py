"""The Queue Viewer's queue pages: the queue list, qshape, and the queue actions
(one queue, the selected ones, or every queue a filter selects)."""

from __future__ import annotations

from typing import Any

from django.contrib import messages as flash
from django.http import (
    HttpRequest,
    HttpResponse,
    HttpResponseBadRequest,
    HttpResponseRedirect,
)
from django.shortcuts import get_object_or_404, redirect
from django.urls import reverse
from django.views.decorators.http import require_GET, require_http_methods, require_POST

from queues.filters import QueueFilter, QueueStatus, queue_status, queues_page
from queues.holdings import next_attempts
from queues.lib import clock
from queues.models import (
    DeliveryType,
    Queue,
)
from queues.paging import FilterError
from queues.services.actions import (
    ActionConflict,
    Via,
    timed_notes,
)
from queues.services.counts import (
    current_counts,
    qshape,
)
from queues.services.reroute import REROUTABLE
from queues.spec import QUEUE_ACTIONS, actions_for
from queues.ui.base import (
    action_options,
    bulk_result,
    next_attempt_text,
    operator_required,
    parse_ids,
    query_string,
    redirect_back,
    render_page,
    report_conflict,
    sample_rows,
    spec_option_fields,
    totals_context,
    ui_action,
    viewer_required,
)
from queues.ui.display import age_text, rate_text
from queues.ui.forms import QueueFilterForm

QUEUES_PER_PAGE = 100


UI_QUEUE_ACTIONS = actions_for(QUEUE_ACTIONS, "form")


# What each special queue offers: its messages' actions, through the messages'
# confirmation page (a preview listing the first messages) — never a silent 409.
SPECIAL_OFFERS: dict[str, tuple[tuple[str, str], ...]] = {
    DeliveryType.DEAD_LETTER: (("resubmit", "Resubmit all"), ("export", "Export")),
    DeliveryType.POISON: (
        ("resubmit", "Resubmit all"),
        ("remove", "Remove"),
        ("remove_ndr", "Remove with NDR"),
        ("export", "Export"),
    ),
    DeliveryType.UNREACHABLE: (
        ("resubmit", "Resubmit all"),
        ("remove", "Remove"),
        ("remove_ndr", "Remove with NDR"),
        ("export", "Export"),
    ),
}


# The queue actions a row offers by delivery type (the rest: all of them).
ROW_ACTIONS: dict[str, frozenset[str]] = {
    DeliveryType.SUBMISSION: frozenset(),
    DeliveryType.DEAD_LETTER: frozenset(),
    DeliveryType.POISON: frozenset(),
    DeliveryType.UNREACHABLE: frozenset({"retry", "suspend", "resume"}),
}


def _queue_row(queue: Queue, now, next_at=None) -> dict[str, Any]:
    status = queue_status(queue)
    link = queue.link if queue.link_id else None
    last_error = queue.last_error or (link.last_error if link is not None else "")
    offers = ROW_ACTIONS.get(queue.delivery_type, frozenset(UI_QUEUE_ACTIONS))
    return {
        "queue": queue,
        "link": link,
        "status": status,
        "status_label": QueueStatus(status).label,
        # The earliest next attempt over its recipients, not before the link's retry.
        "next_retry_at": next_at,
        "next_retry": next_attempt_text(next_at, now) if next_at is not None else "",
        "last_error": last_error,
        "oldest": age_text(queue.oldest_received_at, now),
        "rate_in": rate_text(queue.incoming_rate),
        "rate_out": rate_text(queue.outgoing_rate),
        "actionable": bool(offers),
        "offers": offers,
        "special_offers": SPECIAL_OFFERS.get(queue.delivery_type, ()),
        # "suspended until T by X", "re-routed to [10.0.0.9]:25 until T by X"
        "notes": timed_notes(queue, now),
        "reroutable": queue.delivery_type in REROUTABLE,
    }


def queue_rows(queues: list[Queue], now) -> list[dict[str, Any]]:
    nexts = next_attempts(queues)
    return [_queue_row(q, now, nexts.get(q.pk)) for q in queues]


def queue_live_data(row: dict[str, Any]) -> dict[str, Any]:
    return {
        "count": row["queue"].message_count,
        "status": row["status"],
        "status_label": row["status_label"],
        "next_retry": row["next_retry"],
        "last_error": row["last_error"],
        "oldest": row["oldest"],
        "rate_in": row["rate_in"],
        "rate_out": row["rate_out"],
    }


@viewer_required
@require_GET
def queue_list(request: HttpRequest) -> HttpResponse:
    now = clock.now()
    counts = current_counts(now)  # before any count is read: every number from one count
    form = QueueFilterForm(request.GET or None)
    rows: list[dict[str, Any]] = []
    page = None
    f = QueueFilter()
    try:
        f = QueueFilter.from_params(request.GET)
        page = queues_page(f, request.GET.get("sort"), request.GET.get("cursor"), QUEUES_PER_PAGE)
        rows = queue_rows(page.items, now)
    except FilterError as e:
        flash.error(request, str(e))
    return render_page(
        request,
        "ui/queue_list.html",
        "queues",
        totals=totals_context(counts, now),
        form=form,
        rows=rows,
        page=page,
        sort=request.GET.get("sort") or "-count",
        queue_actions=[(name, a.label) for name, a in UI_QUEUE_ACTIONS.items()],
        filtered=bool(f.params),
    )


@viewer_required
@require_GET
def qshape_view(request: HttpRequest) -> HttpResponse:
    by = "domain" if request.GET.get("by") == "domain" else "queue"
    shape = qshape(clock.now(), by=by, top=50)
    return render_page(request, "ui/qshape.html", "queues", shape=shape, by=by)


@operator_required
@require_POST
def queue_action(request: HttpRequest, pk: int, action: str) -> HttpResponse:
    spec = ui_action(request, UI_QUEUE_ACTIONS, action)
    if spec is None:
        return HttpResponseBadRequest("unknown queue action")
    queue = get_object_or_404(Queue, pk=pk)
    try:
        count = spec.run(queue, request.user, Via.UI, **action_options(spec, request.POST))
    except ActionConflict as e:
        report_conflict(request, e)
    else:
        flash.success(request, f"{spec.past} queue {queue.name} ({count} messages waiting).")
    return redirect_back(request, reverse("ui:queues"))


@operator_required
@require_POST
def queues_bulk(request: HttpRequest) -> HttpResponse:
    spec = ui_action(request, UI_QUEUE_ACTIONS, request.POST.get("action", ""))
    if spec is None:
        return HttpResponseBadRequest("unknown queue action")
    ids = parse_ids(request.POST.getlist("ids"))
    if not ids:
        flash.warning(request, "Select at least one queue first.")
        return redirect_back(request, reverse("ui:queues"))
    options = action_options(spec, request.POST, bulk=True)
    try:
        changed = spec.apply(
            Queue.objects.filter(id__in=ids), request.user, Via.UI, ids=ids, **options
        )
    except ActionConflict as e:
        report_conflict(request, e)
        return redirect_back(request, reverse("ui:queues"))
    bulk_result(request, spec.label, changed, len(ids), "queues")
    return redirect_back(request, reverse("ui:queues"))


@operator_required
@require_http_methods(["GET", "POST"])
def queues_confirm(request: HttpRequest) -> HttpResponse:
    """A queue action on every queue a filter selects: count first, then confirm."""
    params = request.POST if request.method == "POST" else request.GET
    spec = ui_action(request, UI_QUEUE_ACTIONS, params.get("action", ""))
    if spec is None:
        return HttpResponseBadRequest("unknown queue action")
    try:
        f = QueueFilter.from_params(params)
    except FilterError as e:
        flash.error(request, str(e))
        return redirect("ui:queues")
    qs = f.queryset()
    options = action_options(spec, params, bulk=True)
    back = reverse("ui:queues") + "?" + query_string(f.as_params())
    try:
        if request.method == "POST":
            changed = spec.apply(qs, request.user, Via.UI, filter=f.as_params(), **options)
            bulk_result(request, spec.label, changed, None, "queues")
            return HttpResponseRedirect(back)
        preview = spec.dry_run(qs, partial=True, **options)  # the page asks for what is missing
    except ActionConflict as e:
        report_conflict(request, e)
        return HttpResponseRedirect(back)
    return render_page(
        request,
        "ui/confirm.html",
        "queues",
        kind="queues",
        action=spec.name,
        action_label=spec.label,
        # the action's own selection: exactly the queues it will change
        count=preview.count,
        consequences=preview.lines("queues"),
        sample=sample_rows(preview),
        options=options,
        option_fields=spec_option_fields(spec, options),
        params=f.as_params(),
        cancel=reverse("ui:queues") + "?" + query_string(f.as_params()),
        post_url=reverse("ui:queues_confirm"),
    )
