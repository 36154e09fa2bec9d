"""Queue Viewer pages: tracking search (viewer) and webhook endpoints (admin)."""

from __future__ import annotations

from collections.abc import Callable
from functools import wraps
from typing import Any

from django.contrib import messages as flash
from django.contrib.auth.decorators import login_required
from django.core.exceptions import PermissionDenied
from django.http import HttpRequest, HttpResponse
from django.shortcuts import get_object_or_404, redirect
from django.views.decorators.http import require_GET, require_http_methods, require_POST

from queues.permissions import ADMIN, can_read_content, has_role
from queues.ui.views import render_page, viewer_required
from tracking import endpoints as services
from tracking.events import TRACKING_EVENTS, WEBHOOK_EVENTS
from tracking.models import WebhookEndpoint
from tracking.search import SearchError, parse_limit, parse_query, search

VIA_UI = "ui"


def admin_required(view: Callable[..., HttpResponse]) -> Callable[..., HttpResponse]:
    @login_required
    @wraps(view)
    def wrapper(request: HttpRequest, *args: Any, **kwargs: Any) -> HttpResponse:
        if not has_role(request.user, ADMIN):
            raise PermissionDenied("Webhooks need the admin role.")
        return view(request, *args, **kwargs)

    return wrapper


@viewer_required
@require_GET
def tracking_search(request: HttpRequest) -> HttpResponse:
    rows: list = []
    page = None
    content = can_read_content(request.user)
    searched = any(request.GET.get(k) for k in request.GET if k not in ("limit", "cursor"))
    try:
        if request.GET.get("message_id") and not content:
            raise PermissionDenied("Searching by Message-ID needs the operator role.")
        query = parse_query(request.GET)
        page = search(query, parse_limit(request.GET.get("limit")), request.GET.get("cursor"))
        rows = page.rows
    except SearchError as exc:
        flash.error(request, str(exc))
    return render_page(
        request,
        "tracking/search.html",
        "tracking",
        rows=rows,
        page=page,
        events=TRACKING_EVENTS,
        searched=searched,
    )


def _warn(request: HttpRequest, endpoint: WebhookEndpoint) -> None:
    for warning in services.warnings(endpoint):
        flash.warning(request, warning)


def _form_events(request: HttpRequest) -> list[str]:
    return request.POST.getlist("events")


@admin_required
@require_http_methods(["GET", "POST"])
def webhook_list(request: HttpRequest) -> HttpResponse:
    if request.method == "POST":
        try:
            endpoint = services.create(
                request.user,
                VIA_UI,
                name=request.POST.get("name", ""),
                url=request.POST.get("url", ""),
                events=_form_events(request),
                secret=request.POST.get("secret", ""),
            )
        except services.EndpointError as exc:
            flash.error(request, str(exc))
        else:
            flash.success(request, f"Webhook {endpoint.name} added.")
            _warn(request, endpoint)
            return _detail_page(request, endpoint, new_secret=endpoint.secret)
    return render_page(
        request,
        "tracking/webhooks.html",
        "webhooks",
        endpoints=WebhookEndpoint.objects.all(),
        webhook_events=WEBHOOK_EVENTS,
    )


@admin_required
@require_http_methods(["GET", "POST"])
def webhook_detail(request: HttpRequest, pk: int) -> HttpResponse:
    endpoint = get_object_or_404(WebhookEndpoint, pk=pk)
    if request.method == "POST":
        try:
            services.update(
                request.user,
                VIA_UI,
                endpoint,
                url=request.POST.get("url", endpoint.url),
                events=_form_events(request),
                secret=request.POST.get("secret", ""),
                enabled=request.POST.get("enabled") == "on",
            )
        except services.EndpointError as exc:
            flash.error(request, str(exc))
        else:
            flash.success(request, f"Webhook {endpoint.name} saved.")
            _warn(request, endpoint)
            return redirect("tracking:webhook", pk=endpoint.pk)
    return _detail_page(request, endpoint)


def _detail_page(
    request: HttpRequest, endpoint: WebhookEndpoint, new_secret: str = ""
) -> HttpResponse:
    """The endpoint's page; ``new_secret`` (after creation or rotation) is shown this
    once, in the answer to that POST (never stored in the session or a redirect)."""
    response = render_page(
        request,
        "tracking/webhook.html",
        "webhooks",
        endpoint=endpoint,
        webhook_events=WEBHOOK_EVENTS,
        secret_hint=services.secret_hint(endpoint.secret),
        new_secret=new_secret,
        **services.recent(endpoint),
    )
    if new_secret:
        response["Cache-Control"] = "no-store"
    return response


@admin_required
@require_POST
def webhook_rotate_secret(request: HttpRequest, pk: int) -> HttpResponse:
    endpoint = get_object_or_404(WebhookEndpoint, pk=pk)
    secret = services.rotate_secret(request.user, VIA_UI, endpoint)
    flash.success(request, f"Webhook {endpoint.name}: new secret.")
    return _detail_page(request, endpoint, new_secret=secret)


@admin_required
@require_POST
def webhook_delete(request: HttpRequest, pk: int) -> HttpResponse:
    endpoint = get_object_or_404(WebhookEndpoint, pk=pk)
    services.delete(request.user, VIA_UI, endpoint)
    flash.success(request, f"Webhook {endpoint.name} deleted.")
    return redirect("tracking:webhooks")
