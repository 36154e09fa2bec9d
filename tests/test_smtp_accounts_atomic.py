"""An SMTP account change is all or nothing, and audited (issue #20): a password
sent with a change that is refused is not saved (it escaped the audit log)."""

from __future__ import annotations

import pytest
from django.contrib.auth.hashers import check_password
from django.test import Client

from queues.models import AuditEntry
from queues.services import accounts
from tests.support.operator_factories import api_client, make_user

pytestmark = pytest.mark.django_db

OLD, NEW = "old-Password!", "new-Password!"


@pytest.fixture(autouse=True)
def _fast_hasher(settings):
    settings.PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]


@pytest.fixture
def account():
    return accounts.create_account("app", OLD, allowed_senders=["example.org"])


def _unchanged() -> None:
    stored = accounts.get_account("app")
    assert check_password(OLD, stored.password) and not check_password(NEW, stored.password)
    assert (stored.enabled, stored.allowed_senders) == (True, ["example.org"])
    assert not AuditEntry.objects.exists()


@pytest.mark.parametrize(
    "rest",
    [
        {"enabled": "yes"},  # not a boolean
        {"max_messages_per_hour": -1},
        {"allowed_senders": ["not an address"]},
        {"enabled": False, "allowed_senders": ["@"]},
    ],
)
def test_an_api_patch_that_fails_changes_no_password(account, rest):
    admin = api_client(make_user("admin"))
    refused = admin.patch("/api/v1/smtp-accounts/app/", {"password": NEW, **rest}, format="json")
    assert refused.status_code == 400 and refused.json()["detail"]
    _unchanged()


def test_an_api_patch_that_succeeds_is_saved_whole_and_audited(account):
    admin = api_client(make_user("admin"))
    body = {"password": NEW, "enabled": False}
    assert admin.patch("/api/v1/smtp-accounts/app/", body, format="json").status_code == 200
    stored = accounts.get_account("app")
    assert check_password(NEW, stored.password) and stored.enabled is False
    entry = AuditEntry.objects.get()
    assert (entry.action, entry.detail) == ("smtp_account_change", "app: enabled, password")


def test_a_ui_change_that_fails_changes_no_password(account):
    admin = Client()
    admin.force_login(make_user("admin", "root"))
    page = admin.post(
        "/smtp-accounts/app/",
        {
            "password": NEW,
            "allowed_senders": "example.org",
            "max_messages_per_hour": "-1",
            "enabled": "on",
        },
    )
    assert page.status_code == 200
    _unchanged()
