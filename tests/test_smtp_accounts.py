"""SMTP accounts: the service, `manage.py smtpaccount`, the API, the Queue Viewer, the filter."""

from __future__ import annotations

import io
import json
import sys

import pytest
from django.core.management import CommandError, call_command
from django.test import Client

from queues.filters import MessageFilter
from queues.models import AuditEntry, Message, SmtpAccount
from queues.services import accounts
from tests.support.operator_factories import api_client, make_message, make_user

pytestmark = pytest.mark.django_db

SECRET = "s3cret-Password!"


@pytest.fixture(autouse=True)
def _fast_hasher(settings):
    settings.PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]


class Tty(io.StringIO):
    """stdin for the command: not a terminal, so the password is its first line."""

    def isatty(self) -> bool:
        return False


def smtpaccount(*args: str, stdin: str = "") -> str:
    out = io.StringIO()
    real = sys.stdin
    sys.stdin = Tty(stdin)
    try:
        call_command("smtpaccount", *args, stdout=out)
    finally:
        sys.stdin = real
    return out.getvalue()


# --- the service


def test_password_is_hashed_and_checked():
    accounts.create_account("alice", SECRET, allowed_senders="Alice@Example.ORG, example.net")
    stored = SmtpAccount.objects.get()
    assert stored.password.startswith("md5$") and SECRET not in stored.password
    assert stored.allowed_senders == ["alice@example.org", "example.net"]
    grant = accounts.authenticate("alice", SECRET)
    assert grant is not None and grant.username == "alice"
    assert accounts.authenticate("alice", "nope") is None
    assert accounts.authenticate("nobody", SECRET) is None
    accounts.set_enabled("alice", False)
    assert accounts.authenticate("alice", SECRET) is None


def test_a_verified_password_is_not_hashed_again_until_it_changes(monkeypatch):
    accounts.create_account("alice", SECRET)
    checks = []
    real = accounts.check_password

    def counting(password, encoded):
        checks.append(password)
        return real(password, encoded)

    monkeypatch.setattr(accounts, "check_password", counting)
    assert accounts.authenticate("alice", SECRET) is not None
    assert accounts.authenticate("alice", SECRET) is not None
    assert len(checks) == 1  # the second login: no hash
    assert accounts.authenticate("alice", "wrong") is None
    assert len(checks) == 2  # a wrong password is always hashed
    accounts.set_password("alice", "new one")
    assert accounts.authenticate("alice", SECRET) is None  # the old one is forgotten
    accounts.set_enabled("alice", False)
    assert accounts.authenticate("alice", "new one") is None


def test_sender_allowed():
    allowed = ("alice@example.org", "example.net", "xn--bcher-kva.example")
    assert accounts.sender_allowed(allowed, "ALICE@example.org")
    assert accounts.sender_allowed(allowed, "anyone@Example.NET")
    assert accounts.sender_allowed(allowed, "x@bücher.example")
    assert accounts.sender_allowed(allowed, "")  # the null sender claims no address
    assert not accounts.sender_allowed(allowed, "bob@example.org")
    assert not accounts.sender_allowed(allowed, "x@sub.example.net")
    assert not accounts.sender_allowed((), "alice@example.org")


@pytest.mark.parametrize("name", ["", "has space", "a/b", "x" * 151])
def test_bad_usernames_are_refused(name):
    with pytest.raises(accounts.AccountError):
        accounts.create_account(name, SECRET)


def test_rate_limited_counts_the_last_hour():
    accounts.create_account("bulk", SECRET, max_messages_per_hour=2)
    grant = accounts.authenticate("bulk", SECRET)
    assert not accounts.rate_limited(grant)
    for _ in range(2):
        message = make_message()
        Message.objects.filter(pk=message.pk).update(auth_account="bulk")
    assert accounts.rate_limited(grant)


# --- the command


def test_command_add_list_passwd_disable():
    assert "added alice" in smtpaccount(
        "add", "alice", "--sender", "alice@example.org", "--rate", "100", stdin=SECRET + "\n"
    )
    assert accounts.authenticate("alice", SECRET) is not None
    listing = smtpaccount("list")
    assert "alice\tenabled\talice@example.org\trate=100" in listing
    assert SECRET not in listing
    rows = json.loads(smtpaccount("list", "--json"))
    assert rows[0]["username"] == "alice" and "password" not in rows[0]
    smtpaccount("passwd", "alice", stdin="new-password\n")
    assert accounts.authenticate("alice", SECRET) is None
    assert accounts.authenticate("alice", "new-password") is not None
    assert "disabled alice" in smtpaccount("disable", "alice")
    assert "alice\tdisabled" in smtpaccount("list")
    assert accounts.authenticate("alice", "new-password") is None
    actions = list(AuditEntry.objects.order_by("id").values_list("action", "via"))
    assert actions == [
        ("smtp_account_add", "cli"),
        ("smtp_account_passwd", "cli"),
        ("smtp_account_disable", "cli"),
    ]
    assert not AuditEntry.objects.filter(detail__contains="password").exists()


def test_command_errors():
    smtpaccount("add", "alice", stdin=SECRET + "\n")
    with pytest.raises(CommandError, match="exists already"):
        smtpaccount("add", "alice", stdin=SECRET + "\n")
    with pytest.raises(CommandError, match="no account"):
        smtpaccount("disable", "bob")
    with pytest.raises(CommandError, match="password is required"):
        smtpaccount("add", "carol", stdin="\n")


# --- the API (admin role)


def test_api_manages_accounts_and_never_returns_the_password():
    admin = api_client(make_user("admin"))
    created = admin.post(
        "/api/v1/smtp-accounts/",
        {"username": "app", "password": SECRET, "allowed_senders": ["example.org"]},
        format="json",
    )
    assert created.status_code == 201, created.json()
    assert created.json()["allowed_senders"] == ["example.org"]
    assert "password" not in created.json()
    listing = admin.get("/api/v1/smtp-accounts/")
    assert [row["username"] for row in listing.json()["results"]] == ["app"]
    assert SECRET not in listing.content.decode()
    changed = admin.patch(
        "/api/v1/smtp-accounts/app/",
        {"enabled": False, "max_messages_per_hour": 50, "password": "other"},
        format="json",
    )
    assert changed.status_code == 200
    assert changed.json()["enabled"] is False and changed.json()["max_messages_per_hour"] == 50
    assert accounts.get_account("app").password.startswith("md5$")
    bad = admin.post("/api/v1/smtp-accounts/", {"username": "x", "password": ""}, format="json")
    assert bad.status_code == 400 and "password" in bad.json()["detail"]
    assert admin.get("/api/v1/smtp-accounts/nobody/").status_code == 404
    assert admin.delete("/api/v1/smtp-accounts/app/").status_code == 204
    assert not SmtpAccount.objects.exists()
    assert AuditEntry.objects.filter(via="api", action__startswith="smtp_account_").count() == 3
    assert not AuditEntry.objects.filter(detail__contains=SECRET).exists()


@pytest.mark.parametrize("role", ["viewer", "operator"])
def test_api_needs_the_admin_role(role):
    client = api_client(make_user(role))
    assert client.get("/api/v1/smtp-accounts/").status_code == 403
    response = client.post(
        "/api/v1/smtp-accounts/", {"username": "x", "password": SECRET}, format="json"
    )
    assert response.status_code == 403
    assert not SmtpAccount.objects.exists()


# --- the Queue Viewer (admin role)


def _ui(role: str) -> Client:
    client = Client()
    client.force_login(make_user(role, f"{role}-ui"))
    return client


def test_ui_adds_changes_and_removes_an_account():
    client = _ui("admin")
    page = client.get("/smtp-accounts/")
    assert page.status_code == 200 and b"Add an account" in page.content
    response = client.post(
        "/smtp-accounts/",
        {"username": "web", "password": SECRET, "allowed_senders": "web@example.org"},
    )
    assert response.status_code == 302
    page = client.get("/smtp-accounts/")
    assert b"web@example.org" in page.content and SECRET.encode() not in page.content
    detail = client.get("/smtp-accounts/web/")
    assert detail.status_code == 200 and SECRET.encode() not in detail.content
    client.post(
        "/smtp-accounts/web/",
        {"allowed_senders": "example.com", "max_messages_per_hour": "10", "password": ""},
    )
    account = accounts.get_account("web")
    assert account.enabled is False  # the checkbox was not sent
    assert account.allowed_senders == ["example.com"] and account.max_messages_per_hour == 10
    assert accounts.authenticate("web", SECRET) is None  # disabled; password unchanged
    accounts.set_enabled("web", True)
    assert accounts.authenticate("web", SECRET) is not None
    assert client.post("/smtp-accounts/web/delete/").status_code == 302
    assert not SmtpAccount.objects.exists()


def test_ui_needs_the_admin_role():
    client = _ui("operator")
    assert client.get("/smtp-accounts/").status_code == 403
    client.post("/smtp-accounts/", {"username": "x", "password": SECRET})
    assert not SmtpAccount.objects.exists()


# --- the account filter and the message detail


def test_account_filter_api_ui_cli_and_detail():
    mine = make_message(subject="from alice")
    Message.objects.filter(pk=mine.pk).update(auth_account="alice")
    make_message(subject="from the network")
    assert list(MessageFilter.from_params({"account": "alice"}).queryset()) == [mine]
    api = api_client(make_user("viewer")).get("/api/v1/messages/?account=alice")
    assert [row["id"] for row in api.json()["results"]] == [mine.pk]
    client = _ui("viewer")
    listing = client.get("/messages/?account=alice")
    assert b"from alice" in listing.content and b"from the network" not in listing.content
    detail = client.get(f"/messages/{mine.pk}/")
    assert b'id="auth-account"' in detail.content and b"?account=alice" in detail.content
    envelope = api_client(make_user("viewer", "vera")).get(f"/api/v1/messages/{mine.pk}/").json()
    assert envelope["envelope"]["auth_account"] == "alice"
    out = io.StringIO()
    call_command("message", "list", "--account", "alice", stdout=out)
    assert mine.qid in out.getvalue()


def test_command_set_enable_delete():
    smtpaccount("add", "bob", "--sender", "bob@example.org", stdin=SECRET + "\n")
    smtpaccount("set", "bob", "--sender", "example.com", "--rate", "5")
    account = accounts.get_account("bob")
    assert account.allowed_senders == ["example.com"] and account.max_messages_per_hour == 5
    smtpaccount("set", "bob", "--rate", "0")
    assert accounts.get_account("bob").max_messages_per_hour is None
    smtpaccount("disable", "bob")
    assert "enabled bob" in smtpaccount("enable", "bob")
    assert accounts.authenticate("bob", SECRET) is not None
    assert "deleted bob" in smtpaccount("delete", "bob")
    assert not SmtpAccount.objects.exists()
