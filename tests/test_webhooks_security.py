"""Webhooks against hostile or careless input (issue #20): one bad URL never
stalls the other endpoints, URLs are checked and IDNA-encoded on save (API and
UI share the check), credentials in URLs are kept out of the audit log, the
private-address guard sees IPv4 inside IPv6, weak secrets are refused, and a
slow receiver does not hold the others. Real receivers on loopback."""

from __future__ import annotations

import importlib
import threading
import time
from collections.abc import Iterator
from datetime import timedelta

import pytest
from django.apps import apps as django_apps
from django.test import Client

from queues.lib import clock
from queues.models import AuditEntry
from tests.support.operator_factories import make_user
from tests.test_webhook_sender import pending
from tests.test_webhooks import Receiver, free_port
from tracking import endpoints, record, sender
from tracking.models import DeliveryState, WebhookAttempt, WebhookEndpoint

pytestmark = pytest.mark.django_db


@pytest.fixture(autouse=True)
def _fresh_endpoint_cache():
    record.invalidate()
    yield
    record.invalidate()


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    r = Receiver()
    yield r
    r.stop()


@pytest.fixture
def admin() -> Client:
    client = Client()
    client.force_login(make_user("superuser", "root"))
    return client


def stored(name: str, url: str) -> WebhookEndpoint:
    """An endpoint as a database from before the URL check may hold it."""
    return WebhookEndpoint.objects.create(
        name=name,
        url=url,
        events=["delivered"],
        secret="x" * 32,
        created_at=clock.now(),
        updated_at=clock.now(),
    )


BAD_URLS = [
    "http://" + "x" * 64 + ".example/",  # a label longer than 63: IDNA refuses it
    "http://ex..ample.com/",  # an empty label
    f"http://127.0.0.1:{free_port()}/hoöks",  # not ASCII: http.client refuses to send it
]


def test_one_bad_url_never_stalls_the_other_endpoints(receiver):
    bad = [stored(f"bad{i}", url) for i, url in enumerate(BAD_URLS)]
    for ep in bad:  # claimed first (oldest)
        pending(ep, 1)
    good = stored("good", receiver.url)
    pending(good, 2)
    assert sender.send_due() == len(BAD_URLS) + 2
    assert len(receiver.requests) == 2
    assert set(good.deliveries.values_list("state", flat=True)) == {DeliveryState.DELIVERED}
    for ep in bad:  # tried once, the failure recorded on the delivery; retried later
        delivery = ep.deliveries.get()
        assert (delivery.state, delivery.attempts) == (DeliveryState.PENDING, 1), ep.url
        assert delivery.last_error and delivery.lease_owner == ""
        assert WebhookAttempt.objects.get(delivery=delivery).error == delivery.last_error


@pytest.mark.parametrize("allow_private", [True, False])
@pytest.mark.parametrize(
    "url",
    [*BAD_URLS[:2], "http://exa mple.com/", "http://exa\x00mple.com/", "http://h.example:99999/"],
)
def test_a_url_that_cannot_be_sent_to_is_refused_on_save(admin, settings, url, allow_private):
    settings.MAILRELAY_WEBHOOK_ALLOW_PRIVATE = allow_private
    body = {"name": "siem", "url": url, "events": ["delivered"]}
    api = admin.post("/api/v1/webhooks/", body, content_type="application/json")
    assert api.status_code == 400, api.content
    assert "url" in api.json()
    ui = admin.post("/webhooks/", body)
    assert ui.status_code == 200 and "url:" in ui.content.decode()
    assert not WebhookEndpoint.objects.exists()


def test_a_url_is_saved_idna_and_percent_encoded_and_posted_so(admin, receiver):
    # The path and query percent-encoded (posted to the receiver); an
    # internationalised host name IDNA-encoded (saved through the page).
    body = {
        "name": "siem",
        "url": f"http://127.0.0.1:{receiver.port}/hoöks?q=ä",
        "events": ["delivered"],
    }
    created = admin.post("/api/v1/webhooks/", body, content_type="application/json")
    assert created.status_code == 201, created.content
    assert created.json()["url"] == f"http://127.0.0.1:{receiver.port}/ho%C3%B6ks?q=%C3%A4"
    ui = admin.post("/webhooks/", {**body, "name": "ui", "url": "https://Bücher.Example/in"})
    assert ui.status_code == 200
    assert WebhookEndpoint.objects.get(name="ui").url == "https://xn--bcher-kva.example/in"
    pending(WebhookEndpoint.objects.get(name="siem"), 1)
    sender.send_due()
    assert len(receiver.requests) == 1


def _slow_then_fast(slow: Receiver, fast: Receiver) -> tuple[float, float]:
    slow_ep, fast_ep = stored("slow", slow.url), stored("fast", fast.url)
    pending(slow_ep, 1)  # claimed first
    pending(fast_ep, 1)
    started = time.monotonic()
    arrived: list[float] = []

    def watch() -> None:
        with fast.arrived:
            fast.arrived.wait_for(lambda: fast.requests, timeout=5)
        arrived.append(time.monotonic() - started)

    watcher = threading.Thread(target=watch)
    watcher.start()
    sender.send_due()
    total = time.monotonic() - started
    watcher.join()
    return arrived[0], total


def test_a_slow_receiver_does_not_delay_another_endpoint(settings, receiver):
    settings.MAILRELAY_WEBHOOK_TIMEOUT = timedelta(seconds=3)
    slow = Receiver(delay=1.0)
    try:
        fast_after, total = _slow_then_fast(slow, receiver)
    finally:
        slow.stop()
    assert fast_after < 0.5  # not after the slow one's second
    assert 1.0 <= total < 2.0
    assert set(WebhookAttempt.objects.values_list("status", flat=True)) == {204}


CREDENTIALED = "https://hook:pa55word@siem.example.com/in?token=t0ken-abc&tenant=acme"


def test_viewers_never_read_webhook_credentials_in_the_audit_log(admin):
    body = {"name": "siem", "url": CREDENTIALED, "events": ["delivered"]}
    created = admin.post("/api/v1/webhooks/", body, content_type="application/json")
    assert created.status_code == 201
    pk = created.json()["id"]
    secret = created.json()["secret"]
    changed = admin.patch(
        f"/api/v1/webhooks/{pk}/",
        {"url": CREDENTIALED.replace("t0ken-abc", "t0ken-new")},
        content_type="application/json",
    )
    assert changed.status_code == 200
    admin.post(f"/webhooks/{pk}/rotate-secret/")
    viewer = Client()
    viewer.force_login(make_user("viewer", "vera"))
    for page in ("/api/v1/audit/", "/audit/"):
        text = viewer.get(page).content.decode()
        assert "siem.example.com/in" in text  # which endpoint, where
        for credential in ("pa55word", "t0ken-abc", "t0ken-new", "acme", secret):
            assert credential not in text, (page, credential)
    details = list(AuditEntry.objects.order_by("id").values_list("detail", flat=True))
    assert len(details) == 3
    assert details[0] == (
        "siem https://hook:***@siem.example.com/in?token=***&tenant=*** events=delivered"
    )
    # The endpoint itself keeps its URL: the sender needs it, admins see it.
    assert WebhookEndpoint.objects.get().url == CREDENTIALED.replace("t0ken-abc", "t0ken-new")


def test_audit_entries_written_before_are_redacted_by_the_migration():
    migration = importlib.import_module("tracking.migrations.0004_redact_webhook_audit")
    old = [
        AuditEntry.objects.create(
            created_at=clock.now(),
            actor_name="root",
            via="api",
            action="webhook_create",
            target_type="webhook",
            detail=f"siem {url} events=delivered",
        )
        for url in (CREDENTIALED, "http://T0KEN@h.example/x?s3cret", "https://h.example/x")
    ]
    other = AuditEntry.objects.create(
        created_at=clock.now(),
        actor_name="root",
        via="api",
        action="queue_suspend",
        target_type="queue",
        detail="see https://wiki.example/q?id=7",
    )
    migration.forwards(django_apps, None)
    assert [AuditEntry.objects.get(pk=e.pk).detail for e in old] == [
        "siem https://hook:***@siem.example.com/in?token=***&tenant=*** events=delivered",
        "siem http://***@h.example/x?*** events=delivered",
        "siem https://h.example/x events=delivered",
    ]
    assert AuditEntry.objects.get(pk=other.pk).detail == other.detail  # not a webhook's


@pytest.mark.parametrize(
    "host",
    [
        "[64:ff9b::7f00:1]",  # NAT64 of 127.0.0.1
        "[64:ff9b::a9fe:a9fe]",  # NAT64 of 169.254.169.254
        "[64:ff9b:1::a00:1]",  # local-use NAT64 prefix (RFC 8215)
        "[2002:a00:1::1]",  # 6to4 of 10.0.0.1
        "[2002:7f00:1::]",  # 6to4 of 127.0.0.1
        "[::127.0.0.1]",  # IPv4-compatible
        "[::a9fe:a9fe]",  # IPv4-compatible 169.254.169.254
        "[::ffff:10.0.0.1]",  # IPv4-mapped (refused before too)
    ],
)
def test_the_private_guard_sees_ipv4_inside_ipv6(admin, settings, host):
    settings.MAILRELAY_WEBHOOK_ALLOW_PRIVATE = False
    body = {"name": "x", "url": f"http://{host}/in", "events": ["delivered"]}
    refused = admin.post("/api/v1/webhooks/", body, content_type="application/json")
    assert refused.status_code == 400 and "private address" in refused.content.decode()
    # At send time too (a row of an endpoint saved while they were allowed).
    ep = stored("old", f"http://{host}:9/in")
    pending(ep, 1)
    sender.send_due()
    assert WebhookAttempt.objects.get(endpoint=ep).error.startswith("refused:")


def test_public_ipv4_inside_ipv6_stays_allowed(settings):
    settings.MAILRELAY_WEBHOOK_ALLOW_PRIVATE = False
    for address in ("64:ff9b::5db8:d822", "2002:5db8:d822::1", "2606:2800:220:1::1"):
        assert endpoints.is_public(address), address
    assert not endpoints.is_public("::1") and not endpoints.is_public("::")


def test_a_weak_secret_is_refused_and_none_gets_a_strong_one(admin):
    body = {"name": "siem", "url": "https://siem.example.com/in", "events": ["delivered"]}
    weak = admin.post(
        "/api/v1/webhooks/", {**body, "secret": "hunter2"}, content_type="application/json"
    )
    assert weak.status_code == 400 and "32" in weak.json()["secret"][0]
    ui = admin.post("/webhooks/", {**body, "secret": "hunter2"})
    assert "secret: at least 32 characters" in ui.content.decode()
    assert not WebhookEndpoint.objects.exists()
    created = admin.post("/api/v1/webhooks/", body, content_type="application/json")
    assert created.status_code == 201 and len(created.json()["secret"]) >= 32
    pk = created.json()["id"]
    again = admin.patch(
        f"/api/v1/webhooks/{pk}/", {"secret": "y" * 31}, content_type="application/json"
    )
    assert again.status_code == 400
    admin.post(f"/webhooks/{pk}/", {"url": body["url"], "events": ["delivered"], "secret": "z" * 8})
    assert WebhookEndpoint.objects.get().secret == created.json()["secret"]  # kept
    own = admin.patch(
        f"/api/v1/webhooks/{pk}/", {"secret": "y" * 32}, content_type="application/json"
    )
    assert own.status_code == 200 and WebhookEndpoint.objects.get().secret == "y" * 32


def test_an_http_url_is_saved_with_a_warning(admin):
    body = {"name": "siem", "url": "http://siem.example.com/in", "events": ["delivered"]}
    created = admin.post("/api/v1/webhooks/", body, content_type="application/json")
    assert created.status_code == 201
    (warning,) = created.json()["warnings"]
    assert "http://" in warning and "https://" in warning
    pk = created.json()["id"]
    changed = admin.patch(
        f"/api/v1/webhooks/{pk}/", {"enabled": False}, content_type="application/json"
    )
    assert changed.json()["warnings"] == [warning]
    secure = admin.patch(
        f"/api/v1/webhooks/{pk}/",
        {"url": "https://siem.example.com/in"},
        content_type="application/json",
    )
    assert secure.json()["warnings"] == []
    ui = admin.post("/webhooks/", {**body, "name": "ui"}, follow=True)
    assert warning in ui.content.decode()
    ui_saved = admin.post(
        f"/webhooks/{WebhookEndpoint.objects.get(name='ui').pk}/",
        {"url": body["url"], "events": ["delivered"]},
        follow=True,
    )
    assert warning in ui_saved.content.decode()
