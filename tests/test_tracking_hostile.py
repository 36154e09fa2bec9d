"""Tracking against hostile senders (issue #20): a Message-ID no btree entry can
hold is tracked and found, and never takes the rows of its batch-mates with it;
a row the table refuses loses only itself. Real SMTP ingress, sink and DNS."""

from __future__ import annotations

import random
from datetime import timedelta

import pytest
from django.test import Client

from queues.lib import clock
from queues.models import Message
from tests.support.history import history
from tests.support.operator_factories import make_user
from tests.support.pipeline import drain
from tracking import record
from tracking.models import TrackingEvent

pytestmark = pytest.mark.django_db


@pytest.fixture
def relay(dns_settings, settings, smtp_port, sink_factory):
    settings.MAILRELAY_REMOTE_SMTP_PORT = smtp_port
    settings.MAILRELAY_SMTP_CONNECT_TIMEOUT = timedelta(seconds=2)
    settings.MAILRELAY_SMTP_CLIENT_TIMEOUT = timedelta(seconds=5)
    dns_settings.a("example.net", "127.0.0.2")
    return sink_factory("127.0.0.2", data_reply="250 2.0.0 Ok: queued as 4Xyz")


def hostile_message_id() -> str:
    """About 4,000 bytes of UTF-8 that do not compress: past a btree entry's 2,704."""
    rng = random.Random(20)
    return "<" + "".join(chr(rng.randrange(0x10000, 0x10FFFF)) for _ in range(996)) + ">"


def message(message_id: str) -> bytes:
    # Folded: no line longer than 998 octets; the relay unfolds it with spaces.
    folded = "\r\n ".join(message_id[i : i + 200] for i in range(0, len(message_id), 200))
    return (
        f"From: a@example.org\r\nTo: b@example.net\r\nMessage-ID: {folded}\r\n"
        "Subject: t\r\n\r\nhi\r\n"
    ).encode()


def test_a_huge_utf8_message_id_is_tracked_and_its_batch_mates_too(relay, ingress):
    hostile = hostile_message_id()
    for data in (message(hostile), message("<plain@example.org>")):
        code, _ = ingress.send(data, rcpt_to=["b@example.net"], mail_options=["SMTPUTF8"])
        assert code == 250
    drain()  # both are categorized and delivered in the same batches
    stored = Message.objects.exclude(message_id="<plain@example.org>").get().message_id
    assert len(stored.encode()) > 3000
    for msgid in (stored, "<plain@example.org>"):
        events = {row.event for row in history(message_id=msgid)}
        assert events == {"received", "routed", "delivered"}, msgid
    # Searched by its Message-ID, exactly (cut at 998 characters: no ">" left).
    operator = Client()
    operator.force_login(make_user("operator", "olga"))
    for asked in (stored, "plain@example.org"):
        found = operator.get("/api/v1/tracking/", {"message_id": asked})
        assert found.status_code == 200, found.content[:300]
        results = found.json()["results"]
        assert {r["event"] for r in results} == {"received", "routed", "delivered"}
        assert {r["message_id"] for r in results} == {stored if asked == stored else f"<{asked}>"}
    assert operator.get("/api/v1/tracking/", {"message_id": stored[:-2] + ">"}).json() == {
        "results": [],
        "next": None,
    }


def test_a_row_the_table_refuses_loses_only_itself():
    """Its batch-mates are written (row by row after the batch failed)."""
    now = clock.now()
    rows = [
        record.new("received", now, qid="GOOD1"),
        # jsonb holds no NUL: this row's INSERT fails in the database.
        record.new("operator", now, qid="BAD", detail={"text": "a\x00b"}),
        record.new("received", now, qid="GOOD2"),
    ]
    record.write(rows)
    assert sorted(TrackingEvent.objects.values_list("qid", flat=True)) == ["GOOD1", "GOOD2"]
