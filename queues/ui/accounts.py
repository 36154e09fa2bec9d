"""SMTP accounts in the Queue Viewer (admin role): list, add, change, remove.

The forms post back here; every change is in the audit log (``via=ui``). A
password is written, never shown: the pages show what ``account_summary`` gives.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import wraps
from typing import Any

from django.contrib import messages as flash
from django.contrib.auth.decorators import login_required
from django.core.exceptions import PermissionDenied
from django.db import transaction
from django.http import Http404, HttpRequest, HttpResponse
from django.shortcuts import redirect
from django.views.decorators.http import require_http_methods, require_POST

from queues.permissions import ADMIN, has_role
from queues.services import accounts
from queues.ui.base import render_page


def admin_required(view: Callable[..., HttpResponse]) -> Callable[..., HttpResponse]:
    """Signed in (else the login page) and an admin (else 403)."""

    @login_required
    @wraps(view)
    def wrapper(request: HttpRequest, *args: Any, **kwargs: Any) -> HttpResponse:
        if not has_role(request.user, ADMIN):
            raise PermissionDenied("SMTP accounts need the admin role.")
        return view(request, *args, **kwargs)

    return wrapper


def _rate(text: str) -> int | None:
    return accounts.clean_rate(text.strip() or None)


@admin_required
@require_http_methods(["GET", "POST"])
def account_list(request: HttpRequest) -> HttpResponse:
    """The accounts; POST adds one (username, password, senders, rate)."""
    form = {"username": "", "allowed_senders": "", "max_messages_per_hour": ""}
    if request.method == "POST":
        form = {key: request.POST.get(key, "") for key in form}
        try:
            account = accounts.create_account(
                form["username"],
                request.POST.get("password", ""),
                allowed_senders=form["allowed_senders"],
                max_messages_per_hour=_rate(form["max_messages_per_hour"]),
            )
        except accounts.AccountError as exc:
            flash.error(request, str(exc))
        else:
            accounts.audit(request.user, "ui", "add", account.username)
            flash.success(request, f"SMTP account {account.username} added.")
            return redirect("ui:smtp_accounts")
    rows = [accounts.account_summary(a) for a in accounts.list_accounts()]
    return render_page(request, "ui/smtp_accounts.html", "smtp_accounts", accounts=rows, form=form)


@admin_required
@require_http_methods(["GET", "POST"])
def account_detail(request: HttpRequest, username: str) -> HttpResponse:
    """One account; POST changes its senders, rate, enabled flag and (if given) password."""
    try:
        account = accounts.get_account(username)
    except accounts.AccountError:
        raise Http404("no such SMTP account") from None
    if request.method == "POST":
        password = request.POST.get("password", "")
        try:  # all or nothing, with its audit entry
            with transaction.atomic():
                if password:
                    accounts.set_password(username, password)
                accounts.update_account(
                    username,
                    allowed_senders=request.POST.get("allowed_senders", ""),
                    max_messages_per_hour=_rate(request.POST.get("max_messages_per_hour", "")),
                    enabled=request.POST.get("enabled") == "on",
                )
                detail = "settings" + (", password" if password else "")
                accounts.audit(request.user, "ui", "change", username, detail)
        except accounts.AccountError as exc:
            flash.error(request, str(exc))
        else:
            flash.success(request, f"SMTP account {username} saved.")
            return redirect("ui:smtp_account", username=username)
    return render_page(
        request,
        "ui/smtp_account.html",
        "smtp_accounts",
        account=accounts.account_summary(account),
        senders_text=" ".join(account.allowed_senders or []),
    )


@admin_required
@require_POST
def account_delete(request: HttpRequest, username: str) -> HttpResponse:
    try:
        accounts.delete_account(username)
    except accounts.AccountError:
        raise Http404("no such SMTP account") from None
    accounts.audit(request.user, "ui", "delete", username)
    flash.success(request, f"SMTP account {username} removed.")
    return redirect("ui:smtp_accounts")
