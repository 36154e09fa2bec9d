"""Queue Viewer pages: thin views over queues.filters (reading), queues.services
(acting) and queues.permissions (who may do what). Here the message pages,
deferrals, audit and live; the queue pages are ``queue_views``, what every
page shares (access, the page frame, the action helpers) ``base``.

Reading: every list is one indexed query paged by keyset (queues.filters);
the numbers shown for queues are the ones the sweep keeps on the queue rows
(queues.services.counts), never counted per page view.

Acting: each action calls its one service in queues.services.actions and
shows the outcome as a flash message; an ActionConflict (the HTTP 409 of the
API) is shown as an error and changes nothing. Viewers get no action buttons,
no message content and a 403 on any action.
"""

from __future__ import annotations

from typing import Any

from django.contrib import messages as flash
from django.http import (
    FileResponse,
    HttpRequest,
    HttpResponse,
    HttpResponseBadRequest,
    HttpResponseRedirect,
    JsonResponse,
    StreamingHttpResponse,
)
from django.shortcuts import get_object_or_404, redirect
from django.urls import reverse
from django.utils.http import url_has_allowed_host_and_scheme
from django.views.decorators.http import require_GET, require_http_methods, require_POST

from insight.deferrals import error_groups
from queues.filters import (
    MESSAGE_FILTERS,
    AuditFilter,
    MessageFilter,
    MessageStatus,
    audit_page,
    message_body_preview,
    message_headers,
    message_status,
    messages_page,
    messages_prefetch,
)
from queues.lib import clock
from queues.models import (
    Attempt,
    DeliveryType,
    Event,
    Message,
    Queue,
    Recipient,
    RecipientState,
)
from queues.paging import FilterError, parse_limit
from queues.permissions import can_read_content
from queues.services.actions import (
    ActionConflict,
    ActionTooLarge,
    MessageAction,
    Via,
    message_export_pieces,
    message_export_size,
    messages_export_zip_file,
)
from queues.services.counts import (
    current_counts,
    queue_history,
)
from queues.services.timed import until_text
from queues.spec import MESSAGE_ACTIONS, OperatorAction, actions_for
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
from queues.ui.display import relative_text, size_text, visible_text
from queues.ui.forms import MessageFilterForm
from queues.ui.queue_views import (
    queue_live_data,
    queue_rows,
)

MESSAGES_PER_PAGE = 50
ATTEMPTS_SHOWN = 200
EVENTS_SHOWN = 200
LIVE_MAX_IDS = 200
ERROR_STATES = (RecipientState.DEFERRED, RecipientState.FAILED, RecipientState.EXPIRED)

# The actions the Queue Viewer offers (queues.spec declares them, with their
# labels, past tenses and roles); export is the one bulk action of its own.
UI_MESSAGE_ACTIONS = actions_for(MESSAGE_ACTIONS, "form")
EXPORT = "export"
EXPORT_LABEL = "Export as zip"


# --- rows: what a table line shows --------------------------------------------------


def _last_error(recipients: list[Recipient]) -> str:
    """The newest reply of a recipient that failed or waits after a failure."""
    failing = [r for r in recipients if r.state in ERROR_STATES and r.last_text]
    if not failing:
        return ""
    latest = max(failing, key=lambda r: (r.last_attempt_at is not None, r.last_attempt_at))
    code = " ".join(str(p) for p in (latest.last_code, latest.last_enhanced) if p)
    return f"{code} {latest.last_text}".strip()


def message_row(message: Message, recipients: list[Recipient]) -> dict[str, Any]:
    status = message_status(message, [r.state for r in recipients])
    queues: dict[int, Queue] = {}
    for r in recipients:
        if r.queue_id is not None and r.queue is not None:
            queues.setdefault(r.queue_id, r.queue)
    return {
        "message": message,
        "recipients": recipients[:3],
        "more_recipients": max(len(recipients) - 3, 0),
        "status": status,
        "status_label": MessageStatus(status).label,
        "queues": list(queues.values()),
        "last_error": _last_error(recipients),
        # Tries of the most-tried recipient (recipients of one message are tried together).
        "attempts": max((r.attempt_count for r in recipients), default=0),
        "size": size_text(message.size),
    }


def _message_live(row: dict[str, Any]) -> dict[str, Any]:
    return {
        "status": row["status"],
        "status_label": row["status_label"],
        "attempts": row["attempts"],
        "last_error": row["last_error"],
    }


# --- pages --------------------------------------------------------------------------


@viewer_required
def home(request: HttpRequest) -> HttpResponse:
    return redirect("ui:queues")


@viewer_required
@require_GET
def message_list(request: HttpRequest) -> HttpResponse:
    form = MessageFilterForm(request.GET or None)
    content = can_read_content(request.user)
    if not content:
        # What a viewer cannot see it cannot filter by (queues.filters: private).
        for spec in MESSAGE_FILTERS:
            if spec.private:
                form.fields.pop(spec.name, None)
    rows: list[dict[str, Any]] = []
    page = None
    f = MessageFilter()
    filter_error = ""
    try:
        f = MessageFilter.from_params(request.GET, content=content)
        limit = parse_limit(request.GET.get("limit"), MESSAGES_PER_PAGE)
        page = messages_page(f, request.GET.get("sort"), request.GET.get("cursor"), limit)
        recipients = messages_prefetch(page.items)
        rows = [message_row(m, recipients[m.pk]) for m in page.items]
    except FilterError as e:
        filter_error = str(e)
        flash.error(request, filter_error)
    queue = Queue.objects.filter(pk=f.queue).first() if f.queue is not None else None
    return render_page(
        request,
        "ui/message_list.html",
        "messages",
        form=form,
        rows=rows,
        page=page,
        filter=f,
        # An unreadable filter must never turn into "every message" for a filter action.
        filter_error=filter_error,
        queue=queue,
        sort=request.GET.get("sort") or "-received",
        bulk_actions=[
            *((name, a.label) for name, a in UI_MESSAGE_ACTIONS.items()),
            (EXPORT, EXPORT_LABEL),
        ],
    )


@viewer_required
@require_GET
def message_detail(request: HttpRequest, pk: int) -> HttpResponse:
    content = can_read_content(request.user)
    qs = Message.objects.all() if content else Message.objects.defer("data")
    message = get_object_or_404(qs, pk=pk)
    recipients = list(
        Recipient.objects.filter(message=message).select_related("queue").order_by("id")
    )
    attempts = list(
        Attempt.objects.filter(message=message)
        .select_related("recipient", "queue")
        .order_by("-started_at", "-id")[: ATTEMPTS_SHOWN + 1]
    )
    events = list(
        Event.objects.filter(message=message).order_by("-created_at", "-id")[: EVENTS_SHOWN + 1]
    )
    now = clock.now()
    headers: list[tuple[str, str]] = []
    preview, preview_cut = "", False
    if content:
        headers = message_headers(message)
        preview, preview_cut = message_body_preview(message)
        preview = visible_text(preview)
    row = message_row(message, recipients)
    return render_page(
        request,
        "ui/message_detail.html",
        "messages",
        m=message,
        row=row,
        recipients=[
            {"r": r, "next": next_attempt_text(r.next_attempt_at, now)} for r in recipients
        ],
        attempts=attempts[:ATTEMPTS_SHOWN],
        attempts_cut=len(attempts) > ATTEMPTS_SHOWN,
        events=events[:EVENTS_SHOWN],
        events_cut=len(events) > EVENTS_SHOWN,
        headers=headers,
        preview=preview,
        preview_cut=preview_cut,
        size=size_text(message.size),
        received_ago=relative_text(message.received_at, now),
        expires_in=relative_text(message.expires_at, now),
        done=message.state == "done",
        # a dead letter: resubmittable with a corrected recipient or sender
        dead_letter=message.state == "done"
        and any(
            r.queue is not None
            and r.queue.delivery_type == DeliveryType.DEAD_LETTER
            and r.state in (RecipientState.FAILED, RecipientState.EXPIRED)
            for r in recipients
        ),
        suspension=_held_text(message, now),
    )


def _held_text(message: Message, now) -> str:
    if not message.suspended or not (message.suspended_until or message.suspended_by):
        return ""
    text = f"suspended {until_text(message.suspended_until, now)}".strip()
    return f"{text} by {message.suspended_by}" if message.suspended_by else text


@viewer_required
@require_GET
def deferrals(request: HttpRequest) -> HttpResponse:
    queue_id = None
    raw_queue = request.GET.get("queue", "")
    if raw_queue.isascii() and raw_queue.isdigit() and len(raw_queue) <= 18:
        queue_id = int(raw_queue)
    groups = error_groups(queue_id)
    by_queue: dict[int, dict[str, Any]] = {}
    for g in groups:
        entry = by_queue.setdefault(
            g.queue_id, {"queue_id": g.queue_id, "name": g.queue_name, "groups": [], "total": 0}
        )
        entry["groups"].append(
            {
                "group": g,
                "query": query_string(
                    {"queue": str(g.queue_id), "status": "retry"}
                    if g.other  # several errors merged (insight.deferrals): the queue's
                    else {"queue": str(g.queue_id), "error_group": g.text}
                ),
            }
        )
        entry["total"] += g.recipients
    destinations = sorted(by_queue.values(), key=lambda e: (-e["total"], e["name"]))
    return render_page(
        request,
        "ui/deferrals.html",
        "deferrals",
        destinations=destinations,
        queue_id=queue_id,
        total=sum(d["total"] for d in destinations),
    )


@viewer_required
@require_GET
def audit(request: HttpRequest) -> HttpResponse:
    entries = []
    page = None
    try:
        f = AuditFilter.from_params(request.GET)
        page = audit_page(f, request.GET.get("cursor"), parse_limit(request.GET.get("limit")))
        entries = [
            {
                "entry": e,
                "ids": list(e.target_ids or [])[:20],
                "more_ids": max(len(e.target_ids or []) - 20, 0),
                "filter_query": query_string({k: str(v) for k, v in (e.filter or {}).items()}),
            }
            for e in page.items
        ]
    except FilterError as e:
        flash.error(request, str(e))
    return render_page(request, "ui/audit.html", "audit", entries=entries, page=page)


@viewer_required
@require_GET
def live(request: HttpRequest) -> JsonResponse:
    """The small JSON the pages poll: totals, the shown queues and messages, the chart."""
    now = clock.now()
    counts = current_counts(now)
    data: dict[str, Any] = {"now": now.isoformat(), "totals": totals_context(counts, now)}
    queue_ids = parse_ids(request.GET.get("queues", "").split(","))[:LIVE_MAX_IDS]
    if queue_ids:
        queues = list(Queue.objects.filter(id__in=queue_ids).select_related("link"))
        rows = queue_rows(queues, now)
        data["queues"] = {str(row["queue"].pk): queue_live_data(row) for row in rows}
    message_ids = parse_ids(request.GET.get("messages", "").split(","))[:LIVE_MAX_IDS]
    if message_ids:
        found = list(Message.objects.filter(id__in=message_ids).defer("data"))
        recipients = messages_prefetch(found)
        data["messages"] = {
            str(m.pk): _message_live(message_row(m, recipients[m.pk])) for m in found
        }
    if request.GET.get("history"):
        data["history"] = [
            {
                "t": p.at.isoformat(),
                "label": p.at.strftime("%H:%M"),
                "depth": p.depth,
                "delivered": p.delivered_per_minute,
            }
            for p in queue_history(None, now)
        ]
    return JsonResponse(data)


# --- actions ------------------------------------------------------------------------


@operator_required
@require_POST
def message_action(request: HttpRequest, pk: int, action: str) -> HttpResponse:
    message = get_object_or_404(Message.objects.defer("data"), pk=pk)
    fallback = reverse("ui:message", args=[message.pk])
    spec = ui_action(request, UI_MESSAGE_ACTIONS, action)
    if spec is None:
        return HttpResponseBadRequest("unknown message action")
    try:
        spec.run(message, request.user, Via.UI, **action_options(spec, request.POST))
    except ActionConflict as e:
        report_conflict(request, e)
    else:
        flash.success(request, f"{spec.past} message {message.qid}.")
    return redirect_back(request, fallback)


@operator_required
@require_GET
def message_export_view(request: HttpRequest, pk: int) -> StreamingHttpResponse:
    # Without its body: the export streams it from the database in pieces.
    message = get_object_or_404(Message.objects.defer("data"), pk=pk)
    # ?form=sent: as it leaves for the next hop (with its DKIM-Signature).
    form = "sent" if request.GET.get("form") == "sent" else "received"
    pieces = message_export_pieces(message, actor=request.user, via=Via.UI, form=form)
    response = StreamingHttpResponse(pieces, content_type="message/rfc822")
    if (size := message_export_size(message, form=form)) is not None:
        response["Content-Length"] = str(size)
    name = f"{message.qid}.sent.eml" if form == "sent" else f"{message.qid}.eml"
    response["Content-Disposition"] = f'attachment; filename="{name}"'
    return response


def _zip_response(request: HttpRequest, qs, **audit: Any) -> FileResponse | None:
    """The selected messages as a zip, built in a temporary file and streamed
    from it (FileResponse closes it once sent): memory stays flat however many
    and however large the messages are."""
    try:
        out = messages_export_zip_file(qs, request.user, Via.UI, **audit)
    except ActionTooLarge as e:
        flash.error(request, str(e))
        return None
    stamp = clock.now().strftime("%Y%m%d-%H%M%S")
    return FileResponse(
        out, as_attachment=True, filename=f"messages-{stamp}.zip", content_type="application/zip"
    )


@operator_required
@require_POST
def messages_bulk(request: HttpRequest) -> HttpResponse:
    """An action on the messages ticked in a list."""
    action = request.POST.get("action", "")
    fallback = reverse("ui:messages")
    spec = ui_action(request, UI_MESSAGE_ACTIONS, action)
    if spec is None and action != EXPORT:
        return HttpResponseBadRequest("unknown message action")
    ids = parse_ids(request.POST.getlist("ids"))
    if not ids:
        flash.warning(request, "Select at least one message first.")
        return redirect_back(request, fallback)
    qs = Message.objects.filter(id__in=ids)
    if spec is None:
        response = _zip_response(request, qs, ids=ids)
        return response or redirect_back(request, fallback)
    if spec.bulk_action == MessageAction.REMOVE and request.POST.get("confirmed") != "1":
        return _confirm_selected(request, spec, qs, ids, fallback)
    try:
        changed = spec.apply(
            qs, request.user, Via.UI, ids=ids, **action_options(spec, request.POST, bulk=True)
        )
    except ActionConflict as e:
        report_conflict(request, e)
        return redirect_back(request, fallback)
    bulk_result(request, spec.label, changed, len(ids), "messages")
    return redirect_back(request, fallback)


def _confirm_selected(
    request: HttpRequest, spec: OperatorAction, qs, ids: list[int], fallback: str
) -> HttpResponse:
    """A removal of ticked messages asks first: what it would do, and to which."""
    try:
        preview = spec.dry_run(qs)
    except ActionConflict as e:
        report_conflict(request, e)
        return redirect_back(request, fallback)
    back = request.POST.get("next") or fallback
    if not url_has_allowed_host_and_scheme(
        back, allowed_hosts={request.get_host()}, require_https=request.is_secure()
    ):
        back = fallback
    return render_page(
        request,
        "ui/confirm.html",
        "messages",
        kind="messages",
        action=spec.name,
        action_label=spec.label,
        count=preview.count,
        consequences=preview.lines("messages"),
        sample=sample_rows(preview),
        options={},
        option_fields=[],
        params={},
        ids=ids,
        cancel=back,
        post_url=reverse("ui:messages_bulk"),
    )


@operator_required
@require_http_methods(["GET", "POST"])
def messages_confirm(request: HttpRequest) -> HttpResponse:
    """An action on every message a filter selects: first how many, then confirm."""
    params = request.POST if request.method == "POST" else request.GET
    action = params.get("action", "")
    spec = ui_action(request, UI_MESSAGE_ACTIONS, action)
    if spec is None and action != EXPORT:
        return HttpResponseBadRequest("unknown message action")
    try:
        f = MessageFilter.from_params(params)
    except FilterError as e:
        flash.error(request, str(e))
        return redirect("ui:messages")
    list_url = reverse("ui:messages") + "?" + query_string(f.as_params())
    qs = f.queryset()
    if request.method == "POST":
        if spec is None:
            response = _zip_response(request, qs, filter=f.as_params())
            return response or HttpResponseRedirect(list_url)
        try:
            changed = spec.apply(
                qs,
                request.user,
                Via.UI,
                filter=f.as_params(),
                **action_options(spec, params, True),
            )
        except ActionConflict as e:
            report_conflict(request, e)
            return HttpResponseRedirect(list_url)
        bulk_result(request, spec.label, changed, None, "messages")
        return HttpResponseRedirect(list_url)
    # the action's own selection: exactly the messages it will change, and what follows
    consequences: list[str] = []
    options: dict[str, Any] = {}
    sample: list[dict[str, Any]] = []
    if spec is None:
        count = qs.count()
    else:
        options = action_options(spec, params, bulk=True)
        try:
            preview = spec.dry_run(qs, **options)
        except ActionConflict as e:
            report_conflict(request, e)
            return HttpResponseRedirect(list_url)
        count, consequences = preview.count, preview.lines("messages")
        sample = sample_rows(preview)
    return render_page(
        request,
        "ui/confirm.html",
        "messages",
        kind="messages",
        action=action,
        action_label=EXPORT_LABEL if spec is None else spec.label,
        count=count,
        consequences=consequences,
        sample=sample,
        options=options,
        option_fields=spec_option_fields(spec, options),
        params=f.as_params(),
        cancel=list_url,
        post_url=reverse("ui:messages_confirm"),
    )
