"""The operator surface's hardening (issue #15): production refuses unsafe
defaults, logins are throttled, viewers see and filter the same in the UI and
the API, out-of-range filters are a 400, the admin is read-only, the schema
needs a login, and the client address behind trusted proxies."""

from __future__ import annotations

import ipaddress
import os
import re
import stat
import subprocess
import sys
from itertools import count
from pathlib import Path

import pytest
from django.test import Client, RequestFactory

from queues import throttle
from queues.access import client_address, client_in_networks
from queues.models import AuditEntry, Event, Link, Message, Queue
from tests.support.operator_factories import api_client, make_message, make_queue, make_user

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
_addresses = count(10)


# --- production refuses unsafe defaults ------------------------------------------------


def _production_environment() -> dict[str, str]:
    """README "Production"'s example, as an environment (so the two cannot drift)."""
    section = README.read_text().split("## Production", 1)[1]
    block = section.split("```sh", 1)[1].split("```", 1)[0]
    env = {}
    for line in block.splitlines():
        match = re.match(r"^([A-Z_]+)=(\S+)", line.strip())
        if match:
            name, value = match.groups()
            if value.startswith("$("):
                value = "k" + os.urandom(32).hex()  # what the command prints: 50+ random
            elif value == "...":
                value = os.urandom(16).hex()
            env[name] = value
    assert "DJANGO_SECRET_KEY" in env and "DJANGO_SECURE_PROXY_SSL_HEADER" in env
    return env


def _manage(args: list[str], tmp_path: Path, **environ: str) -> subprocess.CompletedProcess:
    drop = ("DJANGO_", "MAILRELAY_", "PYTEST")
    env = {k: v for k, v in os.environ.items() if not k.startswith(drop)}
    env.update(MAILRELAY_DATA_DIR=str(tmp_path / "var"), **environ)
    return subprocess.run(
        [sys.executable, str(ROOT / "manage.py"), *args],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )


def _python(code: str, tmp_path: Path, **environ: str) -> subprocess.CompletedProcess:
    drop = ("DJANGO_", "MAILRELAY_", "PYTEST")
    env = {k: v for k, v in os.environ.items() if not k.startswith(drop)}
    env.update(
        MAILRELAY_DATA_DIR=str(tmp_path / "var"),
        DJANGO_SETTINGS_MODULE="mailrelay.settings",
        **environ,
    )
    return subprocess.run(
        [sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True, text=True, timeout=60
    )


def test_check_deploy_is_clean_for_the_documented_production_configuration(tmp_path):
    done = _manage(
        ["check", "--deploy", "--fail-level", "WARNING"], tmp_path, **_production_environment()
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "System check identified no issues" in done.stdout


@pytest.mark.parametrize(
    "key, why",
    [
        ("insecure-development-key-change-me", "published"),
        ("change-me-to-a-long-random-string", "published"),
        ("short-key", "too short"),
    ],
)
def test_a_published_or_weak_secret_key_stops_start_up(tmp_path, key, why):
    done = _manage(["check"], tmp_path, DJANGO_SECRET_KEY=key)
    assert done.returncode != 0
    assert "DJANGO_SECRET_KEY" in done.stderr and why in done.stderr


def test_a_missing_secret_key_with_postgresql_stops_the_web_app_only(tmp_path):
    url = os.environ["DATABASE_URL"]
    web = _python("from mailrelay.wsgi import application", tmp_path, DATABASE_URL=url)
    assert web.returncode != 0
    assert "DJANGO_SECRET_KEY is not set" in web.stderr
    # The SMTP ingress and the workers sign nothing: they start.
    assert _manage(["check"], tmp_path, DATABASE_URL=url).returncode == 0


def test_the_embedded_default_keeps_one_generated_key_in_the_data_folder(tmp_path):
    env = {k: v for k, v in os.environ.items() if k in ("PATH",)}
    code = "from django.conf import settings; print(settings.SECRET_KEY)"
    keys = []
    for _ in range(2):
        done = _manage(["shell", "-c", code], tmp_path, DATABASE_URL="", **env)
        assert done.returncode == 0, done.stderr
        keys.append(done.stdout.strip().splitlines()[-1])
    key_file = tmp_path / "var" / "secret-key.txt"
    assert keys[0] == keys[1] == key_file.read_text().strip()
    assert len(keys[0]) >= 50
    assert stat.S_IMODE(key_file.stat().st_mode) == 0o600


def test_debug_keeps_the_development_key(tmp_path):
    code = "from django.conf import settings; print(settings.SECRET_KEY)"
    url = "postgres://nobody@127.0.0.1:1/none"
    done = _manage(["shell", "-c", code], tmp_path, DJANGO_DEBUG="true", DATABASE_URL=url)
    assert done.stdout.strip().splitlines()[-1] == "insecure-development-key-change-me", done.stderr


# --- login throttling --------------------------------------------------------------------


@pytest.fixture
def fast_passwords(settings):
    settings.PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]
    settings.MAILRELAY_LOGIN_FAILURE_LIMIT = 5


@pytest.fixture
def address():
    """A client address of this test's own, and its throttle state lifted afterwards."""
    value = f"198.51.100.{next(_addresses)}"
    yield value
    throttle.forget(address=value)


def _user_with_password(name: str, role: str | None = "operator"):
    user = make_user(role, name)
    user.set_password("correct horse")
    user.save()
    throttle.forget(username=name)
    return user


def _login(address: str, username: str, password: str):
    return Client(REMOTE_ADDR=address).post(
        "/accounts/login/", {"username": username, "password": password}
    )


@pytest.mark.django_db
def test_five_failures_for_a_user_name_lock_the_login_page(fast_passwords, address):
    _user_with_password("olga")
    for _ in range(4):
        assert _login(address, "olga", "wrong").status_code == 200
    fifth = _login(address, "olga", "wrong")
    assert fifth.status_code == 429
    # Locked: even the right password is refused, with a clear message.
    locked = _login(address, "OLGA", "correct horse")
    assert locked.status_code == 429
    assert b"Too many failed logins for this user name" in locked.content
    assert int(locked["Retry-After"]) > 800
    event = Event.objects.get(kind="login_lockout")  # one, though both counts reached 5
    assert "'olga'" in event.text and address in event.text and event.level == "warning"
    entry = AuditEntry.objects.get(action="login_lockout")
    assert entry.actor_name == "olga" and entry.via == "ui" and entry.filter["address"] == address
    throttle.forget(username="olga", address=address)  # what an administrator can do
    assert _login(address, "olga", "correct horse").status_code == 302


@pytest.mark.django_db
def test_five_failures_from_one_address_lock_it_for_every_user_name(fast_passwords, address):
    _user_with_password("vera", "viewer")
    guesses = [f"guess{n}" for n in range(5)]
    for name in guesses:
        throttle.forget(username=name)  # the cache outlives the test database
        _login(address, name, "wrong")
    refused = _login(address, "vera", "correct horse")
    assert refused.status_code == 429
    assert b"for this address" in refused.content
    assert _login("198.51.100.250", "vera", "correct horse").status_code == 302
    assert AuditEntry.objects.filter(action="login_lockout").count() == 1
    throttle.forget(address="198.51.100.250")
    for name in guesses:
        throttle.forget(username=name)


@pytest.mark.django_db
def test_a_success_clears_the_user_names_failures(fast_passwords, address):
    _user_with_password("olga")
    for _ in range(4):
        _login(address, "olga", "wrong")
    assert _login(address, "olga", "correct horse").status_code == 302
    throttle.forget(address=address)  # the address keeps its count: not this test's point
    for _ in range(4):
        assert _login(address, "olga", "wrong").status_code == 200
    assert not Event.objects.filter(kind="login_lockout").exists()


@pytest.mark.django_db
def test_token_creation_is_throttled_too(fast_passwords, address):
    user = _user_with_password("olga")
    client = api_client(None)
    url = "/api/v1/auth/token/"
    ok = client.post(url, {"username": "olga", "password": "correct horse"}, REMOTE_ADDR=address)
    assert ok.status_code == 200 and ok.json()["token"] == user.auth_token.key
    for _ in range(4):
        bad = client.post(url, {"username": "olga", "password": "x"}, REMOTE_ADDR=address)
        assert bad.status_code == 401
    fifth = client.post(url, {"username": "olga", "password": "x"}, REMOTE_ADDR=address)
    assert fifth.status_code == 429
    right = client.post(url, {"username": "olga", "password": "correct horse"}, REMOTE_ADDR=address)
    assert right.status_code == 429 and "Too many failed logins" in right.json()["detail"]
    assert right["Retry-After"]
    assert AuditEntry.objects.get(action="login_lockout").via == "api"
    throttle.forget(username="olga")


@pytest.mark.django_db
def test_the_admin_login_is_throttled(fast_passwords, address):
    _user_with_password("root", "superuser")
    client = Client(REMOTE_ADDR=address)
    for _ in range(5):
        client.post("/admin/login/", {"username": "root", "password": "wrong"})
    page = client.post("/admin/login/", {"username": "root", "password": "correct horse"})
    assert page.status_code == 200 and b"Too many failed logins" in page.content
    throttle.forget(username="root")


@pytest.mark.django_db
def test_with_the_cache_down_logins_still_work_unthrottled(fast_passwords, settings):
    user = make_user("operator", "olga")
    user.set_password("correct horse")
    user.save()
    address = "198.51.100.251"
    settings.CACHES = {
        "default": {
            "BACKEND": "django.core.cache.backends.redis.RedisCache",
            "LOCATION": "redis://127.0.0.1:1/0",  # nothing listens there
        }
    }
    for _ in range(6):
        assert _login(address, "olga", "wrong").status_code == 200
    assert _login(address, "olga", "correct horse").status_code == 302


# --- every endpoint has a role (the walk is tests/test_url_roles.py) ------------------


@pytest.mark.django_db
def test_the_schema_and_docs_need_a_login_unless_published(settings):
    settings.MAILRELAY_API_DOCS_PUBLIC = False
    assert api_client(None).get("/api/schema/").status_code == 401
    docs = Client().get("/api/docs/")
    assert docs.status_code == 302 and docs["Location"].startswith("/accounts/login/?next=")
    assert api_client(make_user(None, "nobody")).get("/api/schema/").status_code == 200
    settings.MAILRELAY_API_DOCS_PUBLIC = True
    assert api_client(None).get("/api/schema/").status_code == 200
    assert Client().get("/api/docs/").status_code == 200


@pytest.mark.django_db
def test_back_pressure_needs_the_viewer_role():
    assert api_client(make_user(None, "nobody")).get("/api/v1/backpressure/").status_code == 403
    assert api_client(make_user("viewer")).get("/api/v1/backpressure/").status_code == 200


# --- viewer privacy: the same in the UI and the API ------------------------------------


@pytest.mark.django_db
def test_a_viewer_sees_no_message_id_in_the_ui_or_the_api_and_an_operator_does():
    message = make_message("u@example.net", queue=make_queue(), subject="secret plans")
    viewer, operator = make_user("viewer"), make_user("operator")
    assert message.message_id == "<secret-plans@example.org>"
    for user, visible in ((viewer, False), (operator, True)):
        client = Client()
        client.force_login(user)
        page = client.get(f"/messages/{message.pk}/").content.decode()
        api = api_client(user).get(f"/api/v1/messages/{message.pk}/").json()
        listed = api_client(user).get("/api/v1/messages/").json()["results"][0]
        assert ("secret-plans@example.org" in page) is visible
        assert (api["message_id"] == message.message_id) is visible
        assert (listed["message_id"] == message.message_id) is visible
        assert (api["headers"] is not None) is visible


@pytest.mark.django_db
def test_a_viewer_cannot_filter_by_message_id():
    make_message("u@example.net", queue=make_queue(), subject="secret plans")
    url = "/api/v1/messages/?message_id=secret-plans"
    refused = api_client(make_user("viewer")).get(url)
    assert refused.status_code == 403 and "message_id" in refused.json()["detail"]
    assert len(api_client(make_user("operator")).get(url).json()["results"]) == 1
    client = Client()
    client.force_login(make_user("viewer", "vera"))
    page = client.get("/messages/?message_id=secret-plans").content.decode()
    assert "message_id: this filter needs the operator role" in page
    assert 'name="message_id"' not in page  # no such field in a viewer's filter bar
    assert "secret plans" not in page


# --- no input gives a 500 ---------------------------------------------------------------


@pytest.mark.django_db
@pytest.mark.parametrize(
    "query, parameter",
    [
        ("older_than=99999999999w", "older_than"),
        ("newer_than=99999999999999d", "newer_than"),
        ("newer_than=2026-02-30T00:00:00Z", "newer_than"),
        ("older_than=0001-01-01T00:00:00%2B05:00", "older_than"),
        ("min_size=99999999999999999999GB", "min_size"),
        ("queue=99999999999999999999", "queue"),
        ("subject=a%00b", "subject"),
        ("error_group=" + "%23+" * 60, "error_group"),
    ],
)
def test_out_of_range_filters_are_a_400_naming_the_parameter(query, parameter):
    response = api_client(make_user("operator")).get(f"/api/v1/messages/?{query}")
    assert response.status_code == 400
    assert response.json()["detail"].startswith(f"{parameter}:")


@pytest.mark.django_db
def test_a_forged_cursor_with_a_huge_id_is_a_400():
    import base64
    import json

    raw = json.dumps(["2026-01-01T00:00:00+00:00", 10**30, "n"]).encode()
    cursor = base64.urlsafe_b64encode(raw).decode().rstrip("=")
    response = api_client(make_user("viewer")).get(f"/api/v1/messages/?cursor={cursor}")
    assert response.status_code == 400 and response.json()["detail"].startswith("cursor:")


# --- the admin is read-only for the mail models -----------------------------------------


@pytest.mark.django_db
def test_the_admin_shows_the_mail_models_and_changes_none_of_them():
    queue = make_queue("example.net")
    message = make_message("u@example.net", queue=queue)
    root = make_user("superuser", "root")
    root.is_staff = True
    root.save()
    client = Client()
    client.force_login(root)
    page = client.get(f"/admin/queues/queue/{queue.pk}/change/")
    assert page.status_code == 200 and b"example.net" in page.content
    assert b'name="_save"' not in page.content
    edit = {"name": "evil.test", "delivery_type": queue.delivery_type, "link": ""}
    assert client.post(f"/admin/queues/queue/{queue.pk}/change/", edit).status_code == 403
    assert (
        client.post(f"/admin/queues/link/{queue.link_id}/change/", {"hosts": "[]"}).status_code
        == 403
    )
    delete = client.post(f"/admin/queues/message/{message.pk}/delete/", {"post": "yes"})
    assert delete.status_code == 403
    bulk = client.post(
        "/admin/queues/message/", {"action": "delete_selected", "_selected_action": [message.pk]}
    )
    assert bulk.status_code in (200, 302)
    assert Message.objects.filter(pk=message.pk).exists()
    assert Queue.objects.get(pk=queue.pk).name == "example.net"
    assert Link.objects.get(pk=queue.link_id).hosts == queue.link.hosts
    # Staff without the admin role do not get in.
    staff = make_user("operator", "staffer")
    staff.is_staff = True
    staff.save()
    other = Client()
    other.force_login(staff)
    assert other.get("/admin/queues/queue/").status_code == 302


# --- the client's address behind trusted proxies ---------------------------------------


def _request(remote: str, forwarded: str = ""):
    meta = {"REMOTE_ADDR": remote}
    if forwarded:
        meta["HTTP_X_FORWARDED_FOR"] = forwarded
    return RequestFactory().get("/", **meta)


def test_x_forwarded_for_is_believed_only_from_a_trusted_proxy(settings):
    settings.MAILRELAY_TRUSTED_PROXIES = [ipaddress.ip_network("10.0.0.0/24")]
    # From the proxy: the right-most address that is not a proxy (the left is the client's word).
    assert client_address(_request("10.0.0.2", "1.2.3.4, 203.0.113.9, 10.0.0.7")) == "203.0.113.9"
    # Not from a proxy: the header is ignored.
    assert client_address(_request("192.0.2.1", "127.0.0.1")) == "192.0.2.1"
    assert client_address(_request("::ffff:192.0.2.1")) == "192.0.2.1"
    settings.MAILRELAY_TRUSTED_PROXIES = []
    assert client_address(_request("10.0.0.2", "203.0.113.9")) == "10.0.0.2"


def test_client_in_networks(settings):
    settings.MAILRELAY_TRUSTED_PROXIES = []
    private = [ipaddress.ip_network(n) for n in ("127.0.0.0/8", "::1/128", "10.0.0.0/8")]
    assert client_in_networks(_request("127.0.0.1"), private)
    assert client_in_networks(_request("::1"), private)
    assert not client_in_networks(_request("192.0.2.1"), private)
    assert not client_in_networks(_request("not-an-address"), private)
