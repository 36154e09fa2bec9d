"""Webhooks: signed POSTs to a real receiver on loopback, from the outbox written
with the tracking rows; a receiver that is down gets its events later while
mail flows; a day of failures marks a webhook failed, shown on its endpoint."""

from __future__ import annotations

import hashlib
import hmac
import json
import socket
import threading
import time
from collections.abc import Iterator
from datetime import timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from django.test import Client

from queues.accept import IncomingEnvelope, IncomingRecipient, message_accept
from queues.lib import clock
from tests.support.history import history
from tests.support.operator_factories import make_user
from tests.support.pipeline import drain
from tracking import endpoints, record, sender
from tracking.models import DeliveryState, WebhookAttempt, WebhookDelivery

pytestmark = pytest.mark.django_db

BODY = b"From: a@example.org\r\nTo: x\r\nMessage-ID: <w1@example.org>\r\nSubject: t\r\n\r\nhi\r\n"
SECRET = "s3cret-for-tests-of-at-least-32-chars"


class Receiver:
    """An HTTP server on loopback that records each POST (headers, body)."""

    def __init__(self, port: int = 0, status: int = 204, delay: float = 0.0) -> None:
        self.requests: list[tuple[dict[str, str], str]] = []
        self.status, self.delay = status, delay
        self.arrived = threading.Condition()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - http.server's name
                body = self.rfile.read(int(self.headers["Content-Length"])).decode()
                if receiver.delay:
                    time.sleep(receiver.delay)
                self.send_response(receiver.status)
                self.send_header("Content-Length", "0")
                self.end_headers()
                with receiver.arrived:
                    receiver.requests.append((dict(self.headers.items()), body))
                    receiver.arrived.notify_all()

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
        self.port = self.server.server_address[1]
        self.url = f"http://127.0.0.1:{self.port}/hooks/mailrelay?x=1"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    r = Receiver()
    yield r
    r.stop()


@pytest.fixture(autouse=True)
def _fresh_endpoint_cache():
    record.invalidate()
    yield
    record.invalidate()  # no endpoint of this test's (rolled back) database stays cached


@pytest.fixture
def relay(dns_settings, settings, smtp_port, sink_factory):
    settings.MAILRELAY_REMOTE_SMTP_PORT = smtp_port
    settings.MAILRELAY_SMTP_CONNECT_TIMEOUT = timedelta(seconds=2)
    settings.MAILRELAY_SMTP_CLIENT_TIMEOUT = timedelta(seconds=5)
    settings.MAILRELAY_WEBHOOK_TIMEOUT = timedelta(seconds=2)
    dns_settings.a("example.net", "127.0.0.2")
    return sink_factory(
        "127.0.0.2",
        data_reply="250 2.0.0 Ok: queued as 4Xyz",
        rcpt_replies={"nobody@example.net": "550 5.1.1 no such user"},
    )


def accept(*rcpts: str) -> None:
    env = IncomingEnvelope(
        mail_from="a@example.org",
        recipients=[IncomingRecipient(r) for r in rcpts],
        client_address="192.0.2.7",
    )
    message_accept(env, BODY)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def verify(secret: str, signature_header: str, body: bytes, tolerance: int = 300) -> bool:
    """The verification example of docs/webhooks.md, word for word."""
    fields = dict(part.split("=", 1) for part in signature_header.split(","))
    timestamp = int(fields["t"])
    if abs(time.time() - timestamp) > tolerance:
        return False
    expected = hmac.new(
        secret.encode(), f"{timestamp}.".encode() + body, hashlib.sha256
    ).hexdigest()
    return hmac.compare_digest(expected, fields["v1"])


def test_a_receiver_gets_signed_events_exactly_as_documented(relay, receiver):
    endpoints.create(
        "root", "cli", name="siem", url=receiver.url, events=["delivered", "bounced"], secret=SECRET
    )
    accept("bob@example.net", "nobody@example.net")
    drain()
    assert receiver.requests == []  # delivery never waits on a webhook
    # Its two recipients, and the DSN's failure (example.org has no MX here).
    assert sender.send_due() == 3
    assert len(receiver.requests) == 3
    (row,) = history(event="delivered")
    by_type = {}
    for headers, body in receiver.requests:
        signature = headers["X-Mailrelay-Signature"]
        assert verify(SECRET, signature, body.encode())
        assert not verify("another secret", signature, body.encode())
        assert not verify(SECRET, signature, body.encode() + b" ")
        assert headers["Content-Type"] == "application/json"
        payload = json.loads(body)
        assert headers["X-Mailrelay-Event-Id"] == payload["id"]
        assert headers["X-Mailrelay-Event"] == payload["type"]
        if payload["qid"] == row.qid:
            by_type[payload["type"]] = payload
    delivered, bounced = by_type["delivered"], by_type["bounced"]
    assert delivered["id"] == str(row.event_id)
    assert (delivered["qid"], delivered["message_id"]) == (row.qid, "<w1@example.org>")
    assert (delivered["sender"], delivered["recipient"]) == ("a@example.org", "bob@example.net")
    assert delivered["reply"] == "250 2.0.0 Ok: queued as 4Xyz"
    assert delivered["remote_id"] == "4Xyz"
    assert bounced["recipient"] == "nobody@example.net"
    assert bounced["reply"].startswith("550 5.1.1")
    assert WebhookDelivery.objects.filter(state=DeliveryState.DELIVERED).count() == 3
    assert sender.send_due() == 0  # exactly once when the receiver says 2xx


def test_a_receiver_that_is_down_gets_its_events_later_and_mail_flows_meanwhile(relay):
    port = free_port()
    url = f"http://127.0.0.1:{port}/hook"
    endpoints.create("root", "cli", name="down", url=url, events=["delivered"], secret=SECRET)
    accept("bob@example.net")
    drain()
    assert sender.send_due() == 1
    pending = WebhookDelivery.objects.get()
    assert (pending.state, pending.attempts) == (DeliveryState.PENDING, 1)
    assert "ConnectionRefusedError" in pending.last_error
    assert pending.next_attempt_at == pending.tries.get().at + timedelta(seconds=30)
    # Mail flows while the receiver is down.
    accept("carol@example.net")
    drain()
    assert len(relay.messages) == 2
    assert sender.send_due() == 0  # not due yet
    late = Receiver(port)
    try:
        clock.advance(timedelta(seconds=31))
        while sender.send_due():
            pass
        received = [json.loads(body) for _, body in late.requests]
    finally:
        late.stop()
    assert sorted(p["recipient"] for p in received) == ["bob@example.net", "carol@example.net"]
    first = next(p for p in received if p["recipient"] == "bob@example.net")
    assert first["id"] == str(pending.event_id)  # the same event id on every try
    assert WebhookDelivery.objects.filter(state=DeliveryState.DELIVERED).count() == 2
    assert WebhookAttempt.objects.filter(delivery=pending).count() == 2


def test_after_a_day_of_failures_a_webhook_is_failed_and_shown_on_its_endpoint(relay):
    endpoint = endpoints.create(
        "root",
        "cli",
        name="gone",
        url=f"http://127.0.0.1:{free_port()}/",
        events=["delivered"],
    )
    accept("bob@example.net")
    drain()
    tries = 0
    while True:
        sender.send_due()
        tries += 1
        delivery = WebhookDelivery.objects.get()
        if delivery.state != DeliveryState.PENDING:
            break
        clock.advance(delivery.next_attempt_at - clock.now())
    assert delivery.state == DeliveryState.FAILED
    assert tries == delivery.attempts and 20 < tries < 40
    assert delivery.finished_at - delivery.created_at <= timedelta(hours=24)
    admin = Client()
    admin.force_login(make_user("superuser", "root"))
    page = admin.get(f"/webhooks/{endpoint.pk}/").content.decode()
    assert str(delivery.event_id) in page and "ConnectionRefusedError" in page
    api = admin.get(f"/api/v1/webhooks/{endpoint.pk}/deliveries/").json()
    assert api["failed"] == 1 and api["failures"][0]["event_id"] == str(delivery.event_id)
    assert len(api["attempts"]) == tries


def test_a_slow_endpoint_times_out_without_holding_the_others(relay, receiver, settings):
    settings.MAILRELAY_WEBHOOK_TIMEOUT = timedelta(seconds=0.5)
    slow = Receiver(delay=2.0)
    try:
        endpoints.create("root", "cli", name="slow", url=slow.url, events=["delivered"])
        endpoints.create("root", "cli", name="fast", url=receiver.url, events=["delivered"])
        accept("bob@example.net", "carol@example.net")
        drain()
        started = time.monotonic()
        sender.send_due()
        assert time.monotonic() - started < 1.5  # one timeout, not one per event
    finally:
        slow.stop()
    assert len(receiver.requests) == 2
    slow_rows = WebhookDelivery.objects.filter(endpoint__name="slow")
    assert all(d.state == DeliveryState.PENDING for d in slow_rows)
    assert sorted(d.attempts for d in slow_rows) == [0, 1]  # the second waited untried
    assert "timed out" in WebhookAttempt.objects.get(endpoint__name="slow").error


def test_without_endpoints_an_event_costs_no_query(django_assert_num_queries):
    record.endpoints()  # the cache is filled once
    rows = [record.new("delivered", clock.now(), qid="Q1")]
    with django_assert_num_queries(0):
        assert record.enqueue(rows) == 0


def test_operator_actions_reach_the_endpoints_that_want_them(receiver):
    from queues.services import actions
    from tests.support.operator_factories import make_queue

    endpoints.create("root", "cli", name="ops", url=receiver.url, events=["queue_suspend"])
    queue = make_queue("example.com")
    actions.queue_suspend(queue, make_user("operator", "olga"), "ui")
    sender.send_due()
    ((headers, body),) = receiver.requests
    payload = json.loads(body)
    assert (payload["type"], payload["queue"], payload["actor"]) == (
        "queue_suspend",
        "example.com",
        "olga",
    )


def test_endpoints_are_managed_by_admins_through_the_api():
    admin, operator = Client(), Client()
    admin.force_login(make_user("superuser", "root"))
    operator.force_login(make_user("operator", "olga"))
    body = {
        "name": "siem",
        "url": "https://siem.example.com/in",
        "events": ["delivered", "bounced"],
    }
    assert (
        operator.post("/api/v1/webhooks/", body, content_type="application/json").status_code == 403
    )
    created = admin.post("/api/v1/webhooks/", body, content_type="application/json")
    assert created.status_code == 201, created.content
    data = created.json()
    assert len(data["secret"]) >= 32 and data["events"] == ["delivered", "bounced"]
    bad = admin.post(
        "/api/v1/webhooks/",
        {**body, "name": "x", "events": ["nope"]},
        content_type="application/json",
    )
    assert bad.status_code == 400
    changed = admin.patch(
        f"/api/v1/webhooks/{data['id']}/", {"enabled": False}, content_type="application/json"
    )
    assert changed.status_code == 200 and changed.json()["enabled"] is False
    assert record.endpoints() == []  # a disabled endpoint gets nothing
    assert admin.delete(f"/api/v1/webhooks/{data['id']}/").status_code == 204
    from queues.models import AuditEntry

    assert list(
        AuditEntry.objects.filter(target_type="webhook")
        .values_list("action", flat=True)
        .order_by("id")
    ) == [
        "webhook_create",
        "webhook_update",
        "webhook_delete",
    ]


@pytest.mark.django_db(transaction=True)  # the foreign key is checked at a real COMMIT
def test_an_endpoint_deleted_while_mail_flows_costs_no_delivery_record(relay, receiver):
    """The delivery process still has the endpoint cached (record.CONFIG_TTL) when
    an operator deletes it: the round's webhook rows must not fail its commit
    (the message would be sent again ~36 s later and be missing from tracking)."""
    from queues.models import Message, MessageState, Recipient, RecipientState

    endpoint = endpoints.create(
        "root", "cli", name="gone", url=receiver.url, events=["delivered"], secret=SECRET
    )
    accept("bob@example.net")
    drain()
    assert record.endpoints()  # cached in this process, as in a delivery worker
    endpoints.delete("root", "api", endpoint)
    record._config = (
        time.monotonic() + record.CONFIG_TTL,
        [(endpoint.pk, frozenset({"delivered"}))],
    )
    accept("carol@example.net")
    drain()
    assert sorted(m.rcpt_tos[0] for m in relay.messages) == ["bob@example.net", "carol@example.net"]
    assert set(Recipient.objects.values_list("state", flat=True)) == {RecipientState.DELIVERED}
    assert set(Message.objects.values_list("state", flat=True)) == {MessageState.DONE}
    # (the partitioned tracking table outlives transactional tests: count ours)
    qids = list(Message.objects.values_list("qid", flat=True))
    assert len(history(qid__in=qids, event="delivered")) == 2
    assert not WebhookDelivery.objects.exists()  # none for the deleted endpoint
    clock.advance(timedelta(minutes=5))
    drain()
    assert len(relay.messages) == 2  # exactly once


def test_the_endpoint_list_has_the_apis_paginated_shape():
    """docs/api.md "Lists and pagination": {"next", "previous", "results"}, by ``limit``."""
    admin = Client()
    admin.force_login(make_user("superuser", "root"))
    for name in ("c-siem", "a-crm", "b-audit"):
        endpoints.create(
            "root", "cli", name=name, url="https://hooks.example.com/in", events=["delivered"]
        )
    first = admin.get("/api/v1/webhooks/", {"limit": 2}).json()
    assert set(first) == {"next", "previous", "results"} and first["previous"] is None
    assert [e["name"] for e in first["results"]] == ["a-crm", "b-audit"]
    rest = admin.get(first["next"]).json()
    assert [e["name"] for e in rest["results"]] == ["c-siem"] and rest["next"] is None
    assert "secret" not in rest["results"][0] and rest["results"][0]["secret_hint"]
