"""Queue Viewer pages of the relay itself: back pressure and alerts (viewer),
DKIM keys (admin). Each shows what its API or command shows, from the same
function: delivery.backpressure.store (``GET /api/v1/backpressure/``),
insight.alerts (``GET /api/v1/alerts/``), queues.services.dkim_keys
(``manage.py dkim``)."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from django.contrib import messages as flash
from django.http import Http404, HttpRequest, HttpResponse
from django.shortcuts import redirect
from django.views.decorators.http import require_GET, require_http_methods, require_POST

from delivery.backpressure import store
from delivery.backpressure.config import BackPressureConfig
from delivery.backpressure.engine import Resource
from insight import alerts
from queues.lib import clock
from queues.models import Event
from queues.services import dkim_keys
from queues.ui.accounts import admin_required
from queues.ui.base import render_page, viewer_required
from queues.ui.display import relative_text

HISTORY_SHOWN = 30  # the newest intervals of a resource's history, one cell each
RECENT_CHANGES = 20  # the newest level changes (events) of every node
RECENT_WINDOW = timedelta(days=7)  # how far back they are looked for (event_by_time)


def _number(value: float | None) -> str:
    if value is None:
        return "—"
    return f"{value:.0f}" if float(value).is_integer() else f"{value:.1f}"


def _resource_row(row: dict[str, Any]) -> dict[str, Any]:
    unit = " %" if row["unit"] == "%" else ""
    t = row["thresholds"]
    action = row["action"] or ""
    if action == "tarpit":
        action = f"tarpit {_number(row['delay_seconds'])} s"
    return {
        **row,
        "reading_text": "not monitored"
        if row["reading"] is None
        else f"{_number(row['reading'])}{unit}",
        "level_text": row["level"].replace("_", " "),
        "thresholds_text": (
            f"{_number(t['normal'])} / {_number(t['medium'])} / {_number(t['high'])}{unit}"
            if t
            else "—"
        ),
        "recent": row["history"][-HISTORY_SHOWN:],
        "action_text": action,
    }


@viewer_required
@require_GET
def backpressure_page(request: HttpRequest) -> HttpResponse:
    now = clock.now()
    nodes = []
    for node in store.pressure_nodes(BackPressureConfig.from_settings().interval, now):
        data = store.node_dict(node)
        data["age"] = relative_text(node.updated_at, now)
        data["resources"] = [_resource_row(r) for r in data["resources"]]
        nodes.append(data)
    changes = Event.objects.filter(
        kind=store.EVENT_KIND, created_at__gte=now - RECENT_WINDOW
    ).order_by("-created_at", "-id")
    return render_page(
        request,
        "ui/backpressure.html",
        "backpressure",
        nodes=nodes,
        changes=list(changes[:RECENT_CHANGES]),
        resources=[r.label for r in Resource],
    )


@viewer_required
@require_GET
def alerts_page(request: HttpRequest) -> HttpResponse:
    now = clock.now()
    rows = []
    for alert in alerts.active():
        data = alerts.as_dict(alert)
        data["since"] = relative_text(alert.raised_at, now)
        data["checked"] = relative_text(alert.updated_at, now)
        rows.append(data)
    history = Event.objects.filter(kind="alert", created_at__gte=now - RECENT_WINDOW).order_by(
        "-created_at", "-id"
    )[:RECENT_CHANGES]
    return render_page(request, "ui/alerts.html", "alerts", alerts=rows, history=list(history))


@admin_required
@require_http_methods(["GET", "POST"])
def dkim_page(request: HttpRequest) -> HttpResponse:
    """The keys; POST generates one (kept in the database) and shows its record."""
    form = {"domain": "", "selector": "", "algorithm": "rsa"}
    generated = None
    if request.method == "POST":
        form = {key: request.POST.get(key, "").strip() for key in form}
        try:
            generated = dkim_keys.generate(
                request.user,
                "ui",
                form["domain"],
                form["selector"],
                ed25519=form["algorithm"] == "ed25519",
                database=True,
            )
        except dkim_keys.DkimKeyError as exc:
            flash.error(request, str(exc))
        else:
            form = {"domain": "", "selector": "", "algorithm": "rsa"}
    response = render_page(
        request, "ui/dkim.html", "dkim", keys=dkim_keys.keys(), form=form, generated=generated
    )
    if request.method == "POST" and generated is None:
        response.status_code = 400
    return response


@admin_required
@require_POST
def dkim_action(request: HttpRequest, domain: str, selector: str, action: str) -> HttpResponse:
    if action not in ("disable", "enable"):
        raise Http404("no such action")
    name = f"{selector}._domainkey.{domain}"
    try:
        changed = dkim_keys.set_enabled(request.user, "ui", domain, selector, action == "enable")
    except dkim_keys.DkimKeyError as exc:
        flash.error(request, str(exc))
    else:
        word = "enabled" if action == "enable" else "disabled"
        flash.success(request, f"{name} {word}." if changed else f"{name} was already {word}.")
    return redirect("ui:dkim")
