"""Tracking never costs mail: a tracking row that cannot be written leaves the
delivery it describes recorded (else the message would be sent again), and a
round that lost its claim does not report its recipients' fate."""

from __future__ import annotations

from datetime import timedelta
from types import SimpleNamespace

import pytest
from django.db import connection

from queues.accept import IncomingEnvelope, IncomingRecipient, message_accept
from queues.lib import clock
from queues.models import Attempt, Message, Recipient, RecipientState
from tests.support.history import history
from tests.support.pipeline import drain
from tracking import events, record
from tracking.models import TrackingEvent, WebhookDelivery

pytestmark = pytest.mark.django_db

BODY = b"From: a@example.org\r\nMessage-ID: <s1@example.org>\r\nSubject: t\r\n\r\nhi\r\n"


@pytest.fixture
def relay(dns_settings, settings, smtp_port):
    settings.MAILRELAY_REMOTE_SMTP_PORT = smtp_port
    settings.MAILRELAY_SMTP_CONNECT_TIMEOUT = timedelta(seconds=2)
    settings.MAILRELAY_SMTP_CLIENT_TIMEOUT = timedelta(seconds=5)
    dns_settings.a("example.net", "127.0.0.2")
    return dns_settings


def test_a_tracking_insert_that_fails_in_the_database_leaves_the_delivery_recorded(
    relay, sink_factory, monkeypatch, webhook_endpoint
):
    """What tracking writes beside a delivery is its webhooks' outbox rows (the
    delivery itself is its attempt, tracking.history): a real error there, in
    the round's transaction, loses those and nothing of the delivery."""
    sink = sink_factory("127.0.0.2")
    webhook_endpoint("delivered")
    message = message_accept(
        IncomingEnvelope(
            mail_from="a@example.org", recipients=[IncomingRecipient("b@example.net")]
        ),
        BODY,
    )
    real_enqueue = record.enqueue
    failed = []

    def failing_enqueue(rows):
        if any(r.event == events.DELIVERED for r in rows):
            failed.append(rows)
            with connection.cursor() as cur:
                cur.execute("SELECT 1 / 0")  # a real error, in the round's transaction
        return real_enqueue(rows)

    monkeypatch.setattr(record, "enqueue", failing_enqueue)
    drain()
    assert failed
    recipient = Recipient.objects.get(message_id=message.pk)
    assert recipient.state == RecipientState.DELIVERED
    assert Message.objects.get(pk=message.pk).state == "done"
    assert Attempt.objects.filter(recipient=recipient, outcome="delivered").count() == 1
    assert len(sink.messages) == 1  # sent once: nothing to send again
    assert [r.event for r in history(qid=message.qid)] == ["received", "routed", "delivered"]
    assert not WebhookDelivery.objects.filter(event="delivered").exists()  # the one lost


def _attempt(outcome: str, recipient_id: int = 7) -> Attempt:
    return Attempt(
        recipient_id=recipient_id,
        message_id=1,
        started_at=None,
        host="mx.example.net",
        phase="rcpt",
        code=550 if outcome == "failed" else 250,
        enhanced="5.1.1" if outcome == "failed" else "2.0.0",
        text="no such user" if outcome == "failed" else "ok",
        outcome=outcome,
    )


@pytest.mark.parametrize(
    ("owned", "expected"),
    [(None, events.FAILED), ({7}, events.FAILED), (set(), events.DEFERRED)],
)
def test_a_round_that_lost_its_claim_reports_no_failure(owned, expected, monkeypatch):
    written: list = []
    monkeypatch.setattr(record, "write", lambda rows, **_: written.extend(rows))

    row = SimpleNamespace(state=RecipientState.FAILED, address="b@example.net")
    record.attempted(
        [_attempt("failed")],
        {7: row},
        SimpleNamespace(name="example.net"),
        clock.now(),
        {1: ("QID1", "a@example.org", "<s1@example.org>")},
        owned=owned,
    )
    assert [r.event for r in written] == [expected]
    assert written[0].recipient == "b@example.net"


def test_a_bulk_action_by_filter_is_tracked_on_the_messages_it_changed(relay, sink_factory):
    from queues.services import actions
    from tests.support.operator_factories import make_user

    sink_factory("127.0.0.2", rcpt_tempfail={"slow@example.net": 100})
    waiting, in_flight = (
        message_accept(
            IncomingEnvelope(mail_from="a@example.org", recipients=[IncomingRecipient(r)]),
            BODY,
        )
        for r in ("slow@example.net", "slow@example.net")
    )
    drain()
    # The second one is held by a delivery round now: a remove skips it.
    Recipient.objects.filter(message_id=in_flight.pk).update(
        state=RecipientState.ACTIVE, lease_owner="round-1"
    )
    operator = make_user("operator", "olga")
    changed = actions.messages_apply(
        "remove", Message.objects.all(), operator, "api", filter={"status": "retry"}
    )
    assert changed == 1
    rows = TrackingEvent.objects.filter(event="operator")
    assert list(rows.values_list("qid", flat=True)) == [waiting.qid]
    assert rows.get().detail["action"] == "message_remove"
