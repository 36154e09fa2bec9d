"""The webhook sender's review fixes: a resting endpoint's rows are given up after
MAILRELAY_WEBHOOK_RETRY_FOR like the tried ones (and by one UPDATE from beat);
a disabled endpoint's rows are not claimed; a receiver trickling its answer is
cut at the POST's deadline and the lease outlasts a claim; internal addresses
refused when MAILRELAY_WEBHOOK_ALLOW_PRIVATE is false; the secret is shown once.
Real receivers on loopback."""

from __future__ import annotations

import socket
import threading
import time
import uuid
from collections.abc import Iterator
from datetime import timedelta

import pytest
from django.test import Client

from queues.lib import clock
from queues.models import AuditEntry
from tests.support.operator_factories import make_user
from tests.test_webhooks import Receiver, free_port
from tracking import endpoints, record, sender, signing, tasks
from tracking.models import DeliveryState, WebhookAttempt, WebhookDelivery, WebhookEndpoint

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


def endpoint(name: str = "hook", url: str | None = None, **fields) -> WebhookEndpoint:
    return (
        endpoints.create(
            "root",
            "cli",
            name=name,
            url=url or f"http://127.0.0.1:{free_port()}/",
            events=["delivered"],
        )
        if not fields
        else WebhookEndpoint.objects.create(
            name=name,
            url=url or f"http://127.0.0.1:{free_port()}/",
            events=["delivered"],
            secret="x" * 32,
            created_at=clock.now(),
            updated_at=clock.now(),
            **fields,
        )
    )


def pending(ep: WebhookEndpoint, n: int, age: timedelta = timedelta(0)) -> list[WebhookDelivery]:
    at = clock.now() - age
    return [
        WebhookDelivery.objects.create(
            endpoint=ep,
            event_id=uuid.uuid4(),
            event="delivered",
            body="{}",
            created_at=at,
            next_attempt_at=clock.now(),
        )
        for _ in range(n)
    ]


def states(ep: WebhookEndpoint) -> list[str]:
    return sorted(ep.deliveries.values_list("state", flat=True))


def test_rows_waiting_on_a_resting_endpoint_are_given_up_after_the_retry_period():
    dead = endpoint("dead")
    pending(dead, 5, age=timedelta(hours=23, minutes=59, seconds=45))  # 30 s rest: too late
    assert sender.send_due() == 5  # one try (refused), the endpoint rests 30 s
    # The tried row and the four that waited untried: all past the day now.
    assert states(dead) == ["failed"] * 5
    assert WebhookAttempt.objects.count() == 1
    assert set(dead.deliveries.values_list("last_error", flat=True)) <= {
        sender.GAVE_UP,
        WebhookAttempt.objects.get().error,
    }


def test_beat_fails_every_expired_pending_row_in_one_update(django_assert_max_num_queries):
    resting = endpoint("resting", down_until=clock.now() + timedelta(hours=1), failures=9)
    off = endpoint("off", enabled=False)
    pending(resting, 3, age=timedelta(hours=25))
    pending(off, 2, age=timedelta(hours=25))
    young = pending(off, 1, age=timedelta(hours=1))
    held = pending(resting, 1, age=timedelta(hours=25))[0]
    WebhookDelivery.objects.filter(pk=held.pk).update(
        lease_owner="other", lease_until=clock.now() + timedelta(minutes=5)
    )
    with django_assert_max_num_queries(2):  # the UPDATE, and whether any is due
        tasks.webhook_sweep()
    assert states(resting) == ["failed", "failed", "failed", "pending"]  # not the leased one
    assert states(off) == ["failed", "failed", "pending"]
    assert WebhookDelivery.objects.get(pk=young[0].pk).state == DeliveryState.PENDING
    assert set(
        WebhookDelivery.objects.filter(state="failed").values_list("last_error", flat=True)
    ) == {sender.GAVE_UP}


def test_a_disabled_endpoints_rows_are_not_claimed_and_wait_for_it(receiver):
    ep = endpoint("later", url=receiver.url, enabled=False)
    rows = pending(ep, 3)
    before = {r.pk: r.next_attempt_at for r in WebhookDelivery.objects.all()}
    assert not sender.has_due()
    assert not tasks.webhook_sweep()  # no ring: nothing to churn on
    assert tasks.send_webhooks() == 0
    assert {r.pk: r.next_attempt_at for r in WebhookDelivery.objects.all()} == before
    WebhookEndpoint.objects.filter(pk=ep.pk).update(enabled=True)
    assert tasks.send_webhooks() == 3
    assert len(receiver.requests) == 3 and states(ep) == ["delivered"] * 3
    assert {r.pk for r in rows} == set(before)


class Trickler:
    """A receiver that answers one byte a second (the headers never end in time)."""

    def __init__(self) -> None:
        self.server = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.server.getsockname()[1]}/"
        self.stop = threading.Event()
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        conn, _ = self.server.accept()
        with conn:
            conn.recv(65536)
            for byte in b"HTTP/1.1 204 No Content\r\nContent-Length: 0\r\n\r\n":
                if self.stop.wait(1.0):
                    return
                try:
                    conn.sendall(bytes([byte]))
                except OSError:
                    return

    def close(self) -> None:
        self.stop.set()
        self.server.close()


def test_the_timeout_bounds_the_whole_post_of_a_trickling_receiver(settings):
    settings.MAILRELAY_WEBHOOK_TIMEOUT = timedelta(seconds=1.5)
    trickler = Trickler()
    try:
        started = time.monotonic()
        result = sender.post(trickler.url, "{}", {"Content-Type": "application/json"}, 1.5)
        elapsed = time.monotonic() - started
    finally:
        trickler.close()
    assert result.status is None and "timed out" in result.error
    assert 1.4 < elapsed < 3.0  # not one second per byte of the answer


def test_a_claims_lease_outlasts_posting_all_of_it(settings):
    settings.MAILRELAY_WEBHOOK_TIMEOUT = timedelta(seconds=30)
    timeout = settings.MAILRELAY_WEBHOOK_TIMEOUT.total_seconds()
    assert sender.lease_for(sender.CLAIM, timeout) > timedelta(seconds=sender.CLAIM * timeout)
    ep = endpoint("slow", down_until=clock.now() + timedelta(minutes=1))
    row = pending(ep, 1)[0]
    WebhookEndpoint.objects.filter(pk=ep.pk).update(down_until=None)
    now = clock.now()
    sender.claim("me", now, sender.CLAIM, sender.lease_for(sender.CLAIM, timeout))
    row.refresh_from_db()
    assert row.lease_until - now > timedelta(seconds=sender.CLAIM * timeout)


def test_internal_addresses_are_refused_at_save_and_at_send_when_not_allowed(settings, receiver):
    # Allowed by default (an internal SIEM): saved and sent.
    local = endpoints.create(
        "root",
        "cli",
        name="siem",
        url=receiver.url.replace("127.0.0.1", "localhost"),
        events=["delivered"],
    )
    settings.MAILRELAY_WEBHOOK_ALLOW_PRIVATE = False
    for url in (
        "http://127.0.0.1:8080/",
        "http://10.1.2.3/",
        "http://169.254.169.254/latest/meta-data/",
        "http://[::1]/",
        "http://localhost/x",  # resolved: 127.0.0.1
    ):
        with pytest.raises(endpoints.EndpointError, match="private address"):
            endpoints.create("root", "cli", name=url, url=url, events=["delivered"])
    endpoints.create(
        "root", "cli", name="public", url="https://93.184.216.34/", events=["delivered"]
    )
    # At send time, after resolution: the saved internal endpoint gets nothing.
    pending(local, 1)
    sender.send_due()
    attempt = WebhookAttempt.objects.get(endpoint=local)
    assert attempt.status is None and attempt.error.startswith("refused: localhost")
    assert receiver.requests == []


def test_the_secret_is_shown_once_at_creation_and_rotation():
    admin = Client()
    admin.force_login(make_user("superuser", "root"))
    created = admin.post(
        "/api/v1/webhooks/",
        {"name": "siem", "url": "https://siem.example.com/in", "events": ["delivered"]},
        content_type="application/json",
    )
    data = created.json()
    secret = data["secret"]
    assert len(secret) >= 32 and created["Cache-Control"] == "no-store"
    listed = admin.get("/api/v1/webhooks/").content.decode()
    one = admin.get(f"/api/v1/webhooks/{data['id']}/").json()
    assert secret not in listed and "secret" not in one
    assert one["secret_hint"] == f"…{secret[-4:]}"
    page = admin.get(f"/webhooks/{data['id']}/").content.decode()
    assert secret not in page and f"…{secret[-4:]}" in page
    rotated = admin.post(f"/api/v1/webhooks/{data['id']}/rotate-secret/").json()
    assert rotated["secret"] != secret
    assert WebhookEndpoint.objects.get().secret == rotated["secret"]
    assert (
        admin.patch(
            f"/api/v1/webhooks/{data['id']}/", {"secret": "y" * 40}, content_type="application/json"
        )
        .json()
        .get("secret")
        is None
    )
    # The UI: shown in the answer to the creation and to a rotation, never after.
    ui = admin.post(
        "/webhooks/", {"name": "ui", "url": "https://siem.example.com/ui", "events": ["delivered"]}
    )
    ep = WebhookEndpoint.objects.get(name="ui")
    assert ui.status_code == 200 and ep.secret in ui.content.decode()
    assert ep.secret not in admin.get(f"/webhooks/{ep.pk}/").content.decode()
    again = admin.post(f"/webhooks/{ep.pk}/rotate-secret/")
    ep.refresh_from_db()
    assert ep.secret in again.content.decode() and again["Cache-Control"] == "no-store"
    assert ep.secret not in admin.get(f"/webhooks/{ep.pk}/").content.decode()
    operator = Client()
    operator.force_login(make_user("operator", "olga"))
    assert operator.post(f"/api/v1/webhooks/{ep.pk}/rotate-secret/").status_code == 403
    assert operator.post(f"/webhooks/{ep.pk}/rotate-secret/").status_code == 403
    assert AuditEntry.objects.filter(action="webhook_rotate_secret").count() == 2


# A PostgreSQL restart while the sender works (the owner's session ended, as a
# restart ends it): before a statement, or after its COMMIT with the reply lost.
CUT_AT = {
    "the claim's reply": (
        lambda sql: 'SET "lease_owner"' in sql and '"id" IN (' in sql,
        True,
    ),
    "the record": (lambda sql: sql.startswith('INSERT INTO "tracking_webhookattempt"'), False),
    "the record's reply": (
        lambda sql: 'SET "lease_owner"' in sql and '"lease_owner" = ' in sql.split("WHERE")[-1],
        True,
    ),
}


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("where", sorted(CUT_AT))
def test_a_database_restart_while_sending_costs_no_lease_and_no_second_post(receiver, where):
    from django.db import connection

    from tests.test_ownership import CutOnce

    ep = endpoint("hook", url=receiver.url)
    rows = pending(ep, 3)
    matches, after = CUT_AT[where]
    cut = CutOnce(matches, after=after)
    started = time.monotonic()
    with connection.execute_wrapper(cut):
        tasks.send_webhooks()
    assert cut.cut, "the statement to cut never ran"
    assert time.monotonic() - started < 10  # not the claim's lease (5 minutes)
    assert states(ep) == ["delivered"] * 3
    ids = sorted(headers[signing.EVENT_ID_HEADER] for headers, _ in receiver.requests)
    assert ids == sorted(str(r.event_id) for r in rows)  # each POSTed once
    assert WebhookAttempt.objects.count() == 3  # one attempt per POST
    assert not WebhookDelivery.objects.exclude(lease_owner="").exists()


@pytest.mark.django_db(transaction=True)
def test_a_failed_post_recorded_again_after_a_lost_reply_counts_one_failure():
    from django.db import connection

    from tests.test_ownership import CutOnce

    down = Receiver(status=500)
    try:
        ep = endpoint("down", url=down.url)
        pending(ep, 3)
        matches, _ = CUT_AT["the record's reply"]
        cut = CutOnce(matches, after=True)
        with connection.execute_wrapper(cut):
            tasks.send_webhooks()
    finally:
        down.stop()
    assert cut.cut
    assert len(down.requests) == 1  # the first failed; the others wait with the endpoint
    ep.refresh_from_db()
    assert ep.failures == 1 and ep.down_until is not None
    assert WebhookAttempt.objects.count() == 1
    assert states(ep) == ["pending"] * 3
    assert sorted(WebhookDelivery.objects.values_list("attempts", flat=True)) == [0, 0, 1]
    assert not WebhookDelivery.objects.exclude(lease_owner="").exists()
