"""What every Queue Viewer page shares: access, the page frame, the action helpers.

``viewer_required`` and ``operator_required`` guard the views; ``render_page``
renders a page with the header's totals (the queue rows' counts, never
counted per view); the action helpers turn an action's outcome or its
``ActionConflict`` (the API's 409) into a flash message.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import wraps
from typing import Any

from django.contrib import messages as flash
from django.contrib.auth.decorators import login_required
from django.core.exceptions import PermissionDenied
from django.db.models import Count, Q, Sum
from django.http import (
    HttpRequest,
    HttpResponse,
    HttpResponseRedirect,
    QueryDict,
)
from django.shortcuts import render
from django.utils.http import url_has_allowed_host_and_scheme

from queues.lib import clock
from queues.models import (
    DeliveryType,
    LinkState,
    Queue,
)
from queues.paging import MAX_BIGINT
from queues.permissions import can_act, can_read_content, can_view, user_role
from queues.services.actions import (
    ActionConflict,
)
from queues.services.counts import (
    CountsAsOf,
    current_counts,
)
from queues.services.preview_sample import age_words
from queues.spec import OPTION_HELP, OperatorAction
from queues.ui.display import relative_text


def ui_action(request: HttpRequest, table: dict[str, OperatorAction], name: str):
    """The action ``name`` of ``table`` if the user may run it; None when unknown."""
    spec = table.get(name)
    if spec is not None and not spec.allowed(request.user):
        raise PermissionDenied(f"This needs the {spec.role} role.")
    return spec


def viewer_required(view: Callable[..., HttpResponse]) -> Callable[..., HttpResponse]:
    """Signed in (else the login page) and holding a role (else 403)."""

    @login_required
    @wraps(view)
    def wrapper(request: HttpRequest, *args: Any, **kwargs: Any) -> HttpResponse:
        if not can_view(request.user):
            raise PermissionDenied(
                "Your account has no Queue Viewer role (viewer, operator or admin)."
            )
        return view(request, *args, **kwargs)

    return wrapper


def operator_required(view: Callable[..., HttpResponse]) -> Callable[..., HttpResponse]:
    """Signed in and an operator (or admin): actions and message content; 403 for viewers."""

    @login_required
    @wraps(view)
    def wrapper(request: HttpRequest, *args: Any, **kwargs: Any) -> HttpResponse:
        if not can_act(request.user):
            raise PermissionDenied("This needs the operator role.")
        return view(request, *args, **kwargs)

    return wrapper


def render_page(request: HttpRequest, template: str, section: str, **context: Any) -> HttpResponse:
    if "totals" not in context:
        now = clock.now()
        context["totals"] = totals_context(current_counts(now), now)
    context.update(
        section=section,
        role=user_role(request.user) or "no role",
        can_act=can_act(request.user),
        can_read_content=can_read_content(request.user),
    )
    return render(request, template, context)


def redirect_back(request: HttpRequest, fallback: str) -> HttpResponseRedirect:
    """Where an action returns to: the page that posted it (``next``), else ``fallback``."""
    target = request.POST.get("next") or request.GET.get("next") or ""
    if not url_has_allowed_host_and_scheme(
        target, allowed_hosts={request.get_host()}, require_https=request.is_secure()
    ):
        target = fallback
    return HttpResponseRedirect(target or fallback)


def parse_ids(values: list[str]) -> list[int]:
    out = []
    for value in values:
        try:
            number = int(value)
        except ValueError:
            continue
        if 0 < number <= MAX_BIGINT:  # a larger id is no row, and PostgreSQL errs on it
            out.append(number)
    return out


def totals_context(counts: CountsAsOf, now) -> dict[str, Any]:
    """The header's numbers: the queue rows' counts (``current_counts`` first), one
    aggregate. ``messages``: what the queues hold except the dead letters (a
    message waiting for two destinations counts in each, as in their rows)."""
    dead = Q(delivery_type=DeliveryType.DEAD_LETTER)
    totals: dict[str, Any] = Queue.objects.aggregate(
        messages=Sum("message_count", filter=~dead),
        dead_letters=Sum("message_count", filter=dead),
        queues=Count("id"),
        suspended_queues=Count("id", filter=Q(suspended=True)),
        retry_queues=Count("id", filter=Q(suspended=False, link__state=LinkState.RETRY)),
    )
    totals = {k: v or 0 for k, v in totals.items()}
    # "" when the counts were made for this read; else "as of 12 s ago".
    totals["as_of"] = counts.text(now)
    return totals


def query_string(params: dict[str, str]) -> str:
    q = QueryDict(mutable=True)
    for k, v in params.items():
        q[k] = v
    return q.urlencode()


def report_conflict(request: HttpRequest, error: ActionConflict) -> None:
    flash.error(request, f"Not done: {error.message}. Nothing was changed.")


def spec_option_fields(spec: OperatorAction | None, given: dict[str, Any]) -> list[tuple[str, str]]:
    """The options a confirmation page asks for: those the action takes, not given yet."""
    if spec is None:
        return []
    return [(name, OPTION_HELP[name]) for name in spec.takes_in_bulk if name not in given]


def action_options(spec: OperatorAction, data, bulk: bool = False) -> dict[str, Any]:
    """The options of the form (until, to, recipient, sender) this action takes."""
    names = spec.takes_in_bulk if bulk else spec.params
    return {name: data.get(name, "").strip() for name in names if data.get(name, "").strip()}


def sample_rows(preview: Any) -> list[dict[str, Any]]:
    """The preview's first messages, with their age in words, for confirm.html."""
    return [dict(row, age=age_words(row["age_seconds"])) for row in preview.sample]


def bulk_result(
    request: HttpRequest, label: str, changed: int, selected: int | None, noun: str
) -> None:
    of = f" of {selected} selected" if selected is not None else " matching"
    if changed:
        flash.success(request, f"{label}: {changed}{of} {noun} changed.")
    else:
        flash.warning(
            request,
            f"{label}: none{of} {noun} changed (the action makes no sense in their state).",
        )


def next_attempt_text(when, now) -> str:
    return "due" if when <= now else relative_text(when, now)
