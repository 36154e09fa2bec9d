"""The early record of deliveries (issue #22 "durable before the next
transaction", made cheap for issue #24): a finished delivery owing no
"relayed" report is one statement of the store
(``Recipient.objects.record_delivered``) and its tracking rows.

Real PostgreSQL, real sinks on loopback, the loopback DNS server.
"""

from __future__ import annotations

import threading
from datetime import timedelta

import pytest
from django.db import DatabaseError

from delivery.qmgr.tasks import categorize_pending
from delivery.smtp import deliver
from delivery.smtp.outcome import Carried
from delivery.smtp.types import RecipientResult
from queues.accept import IncomingEnvelope, IncomingRecipient, message_accept
from queues.lib import clock
from queues.models import (
    Attempt,
    AttemptOutcome,
    AttemptPhase,
    Link,
    Message,
    MessageState,
    Recipient,
    RecipientState,
)
from tests.support.history import history
from tracking import record

BODY = b"From: a@example.org\r\nTo: x\r\nSubject: early\r\n\r\nbody\r\n"


def accept(*rcpts: IncomingRecipient) -> Message:
    env = IncomingEnvelope(
        mail_from="a@example.org",
        recipients=list(rcpts),
        client_address="127.0.0.1",
        client_helo="client.test",
    )
    return message_accept(env, BODY)


@pytest.fixture
def relay(dns_settings, settings, smtp_port):
    settings.MAILRELAY_REMOTE_SMTP_PORT = smtp_port
    settings.MAILRELAY_SMTP_CONNECT_TIMEOUT = timedelta(seconds=2)
    settings.MAILRELAY_SMTP_CLIENT_TIMEOUT = timedelta(seconds=10)
    settings.MAILRELAY_MAX_CONNECTIONS_PER_DESTINATION = 1  # one message after the other
    dns_settings.a("example.net", "127.0.0.2")
    return dns_settings


def routed() -> Link:
    while categorize_pending():
        pass
    return Link.objects.get()


@pytest.mark.django_db(transaction=True)
def test_a_round_of_early_records_leaves_each_row_as_the_round_record_would(relay, sink_factory):
    """Delivered, deferred and "relayed"-report recipients side by side: each
    recipient written once, an attempt each, a message done only when nothing
    is left to try, one tracking row per attempt, the report owed sent."""
    sink = sink_factory("127.0.0.2", rcpt_replies={"later@example.net": "450 4.2.1 busy"})
    plain = accept(IncomingRecipient("a@example.net"))
    mixed = accept(IncomingRecipient("b@example.net"), IncomingRecipient("later@example.net"))
    report = accept(IncomingRecipient("c@example.net", notify="SUCCESS"))
    link = routed()

    assert deliver.deliver_link(link.pk) == 4

    assert len(sink.messages) == 3
    states = dict(
        Recipient.objects.filter(address__endswith="@example.net").values_list("address", "state")
    )
    assert states == {
        "a@example.net": RecipientState.DELIVERED,
        "b@example.net": RecipientState.DELIVERED,
        "later@example.net": RecipientState.DEFERRED,
        "c@example.net": RecipientState.DELIVERED,
    }
    delivered = Recipient.objects.get(address="a@example.net")
    assert delivered.attempt_count == 1
    assert delivered.lease_owner == "" and delivered.lease_until is None
    assert delivered.final_at is not None and delivered.last_code == 250
    assert delivered.last_host == "example.net [127.0.0.2]"
    assert Attempt.objects.count() == 4
    assert Attempt.objects.get(recipient=delivered).queue_id == delivered.queue_id
    assert Message.objects.get(pk=plain.pk).state == MessageState.DONE
    assert Message.objects.get(pk=report.pk).state == MessageState.DONE
    assert Message.objects.get(pk=mixed.pk).state != MessageState.DONE  # "later" waits
    events = history(  # tracking partitions outlive a test's flush
        event__in=("delivered", "deferred"), message_pk__in=[plain.pk, mixed.pk, report.pk]
    )
    assert sorted((e.recipient, e.event) for e in events) == [
        ("a@example.net", "delivered"),
        ("b@example.net", "delivered"),
        ("c@example.net", "delivered"),
        ("later@example.net", "deferred"),
    ]
    # c asked for NOTIFY=SUCCESS from a peer without DSN: a "relayed" report.
    reports = Message.objects.filter(mail_from="").exclude(pk__in=[plain.pk, mixed.pk, report.pk])
    assert reports.count() == 1


@pytest.mark.django_db
def test_a_recipient_taken_back_before_the_early_record_keeps_its_new_owner(relay):
    """The store writes only rows the round still holds; the attempt that
    happened is recorded all the same, and a message is done only when all of
    its recipients are final."""
    first = accept(IncomingRecipient("a@example.net"))
    second = accept(IncomingRecipient("b@example.net"))
    link = routed()
    ids = deliver.claim_round(link.pk, "round/1", 10)
    assert len(ids) == 2
    taken = Recipient.objects.get(message=second)
    Recipient.objects.filter(pk=taken.pk).update(lease_owner="sweep/2")  # taken back meanwhile
    now = clock.now()
    results = [
        RecipientResult(
            recipient_id=r.pk,
            message_id=r.message_id,
            outcome=AttemptOutcome.DELIVERED,
            phase=AttemptPhase.DATA,
            code=250,
            enhanced="2.0.0",
            text="ok queued as ABC123",
            host="mx.example.net",
            ip="127.0.0.2",
            started_at=now,
        )
        for r in Recipient.objects.filter(pk__in=ids)
    ]
    carried = Carried()
    index = {r.id: (r, m) for m in deliver._load_batch(ids) for r in m.recipients}

    deliver._record_delivered(link, results, "round/1", carried, index)

    kept = Recipient.objects.get(message=first)
    assert kept.state == RecipientState.DELIVERED and kept.lease_owner == ""
    taken.refresh_from_db()
    assert taken.state == RecipientState.ACTIVE and taken.lease_owner == "sweep/2"
    assert Attempt.objects.count() == 2
    assert Message.objects.get(pk=first.pk).state == MessageState.DONE
    assert Message.objects.get(pk=second.pk).state != MessageState.DONE
    assert carried.delivered_queues == {kept.queue_id}
    (row,) = history(event="delivered", message_pk=first.pk)
    assert row.remote_id == "ABC123" and row.qid == first.qid


@pytest.mark.django_db(transaction=True)
def test_a_tracking_write_that_fails_undoes_the_early_record_and_the_round_records_it(
    relay, sink_factory, monkeypatch, webhook_endpoint
):
    """What tracking writes beside a delivery (its webhooks' outbox rows: the
    delivery itself is its attempt) goes in the early record's transaction
    without a savepoint of its own: when it fails, the early record rolls back
    whole and the round's final record writes those deliveries — once each."""
    webhook_endpoint("delivered")
    sink = sink_factory("127.0.0.2")
    ids = [accept(IncomingRecipient(f"u{i}@example.net")).pk for i in range(3)]
    link = routed()
    real_enqueue = record.enqueue
    failed = []

    def enqueue_failing_once(rows):
        if not failed:
            failed.append(rows)
            raise DatabaseError("tracking_webhookdelivery is locked")
        return real_enqueue(rows)

    monkeypatch.setattr(record, "enqueue", enqueue_failing_once)

    assert deliver.deliver_link(link.pk) == 3

    assert failed  # an early record's tracking write failed
    assert len(sink.messages) == 3
    assert set(Recipient.objects.values_list("state", flat=True)) == {RecipientState.DELIVERED}
    assert Attempt.objects.count() == 3
    assert set(Message.objects.values_list("state", flat=True)) == {MessageState.DONE}
    delivered = history(event="delivered", message_pk__in=ids)
    assert sorted(row.recipient for row in delivered) == [
        "u0@example.net",
        "u1@example.net",
        "u2@example.net",
    ]


@pytest.mark.django_db(transaction=True)
def test_an_early_record_whose_commit_answer_is_lost_is_not_written_twice(
    relay, sink_factory, monkeypatch
):
    """The connection drops after the COMMIT went through (its answer lost): the
    deliveries are written again by the decided path, which writes only rows the
    round still holds — none — so each attempt and tracking row exists once."""
    from django.db import OperationalError

    sink = sink_factory("127.0.0.2")
    ids = [accept(IncomingRecipient(f"v{i}@example.net")).pk for i in range(3)]
    link = routed()
    real = deliver._record_delivered
    lost = []

    def committed_then_lost(*args, **kwargs):
        real(*args, **kwargs)
        lost.append(args[1])
        raise OperationalError("server closed the connection unexpectedly")

    monkeypatch.setattr(deliver, "_record_delivered", committed_then_lost)

    assert deliver.deliver_link(link.pk) == 3

    assert lost  # every early record "lost" its answer
    assert len(sink.messages) == 3
    assert set(Recipient.objects.values_list("state", flat=True)) == {RecipientState.DELIVERED}
    assert Attempt.objects.count() == 3
    assert Recipient.objects.filter(attempt_count=1).count() == 3
    assert len(history(event="delivered", message_pk__in=ids)) == 3


def _in_transaction_thread(write, statement_done, go, after=None) -> threading.Thread:
    """``write()`` in a transaction of a thread of its own (its own connection),
    then ``statement_done``; COMMIT once ``go``; then ``after(written)``."""
    from django.db import connection, transaction

    def run() -> None:
        try:
            with transaction.atomic():
                written = write()
                statement_done.set()
                assert go.wait(10)
            if after is not None:
                after(written)
        finally:
            connection.close()

    thread = threading.Thread(target=run)
    thread.start()
    return thread


def _record_in_thread(rcpt: Recipient, owner: str, statement_done, go) -> threading.Thread:
    """A link's early record of ``rcpt``: the statement, then ``statement_done``;
    COMMIT once ``go``; the rows read after it, as deliver._record_delivered does."""
    from delivery.smtp.outcome import attempt_values

    now = clock.now()
    res = RecipientResult(
        rcpt.id, rcpt.message_id, AttemptOutcome.DELIVERED, AttemptPhase.DATA, 250, "2.0.0", "ok"
    )
    values = [attempt_values(res, now, None) | {"last_host": "mx"}]
    return _in_transaction_thread(
        lambda: Recipient.objects.record_delivered(values, owner, now),
        statement_done,
        go,
        after=lambda written: written(),
    )


@pytest.mark.django_db(transaction=True)
def test_two_links_recording_a_messages_last_recipients_at_once_finish_it():
    """Two rounds (two links) record the last two recipients of one message at
    the same moment: each statement sees the other's recipient still in flight
    (its transaction has not committed), so neither finishes the message in
    its own statement; the check after each commit does, and the message is
    done, not left "queued" until it expires."""
    message = accept(IncomingRecipient("a@example.net"), IncomingRecipient("b@example.com"))
    first, second = Recipient.objects.filter(message=message).order_by("id")
    until = clock.now() + timedelta(minutes=1)
    for rcpt, owner in ((first, "link-a/1"), (second, "link-b/1")):
        Recipient.objects.filter(pk=rcpt.pk).update(
            state=RecipientState.ACTIVE, lease_owner=owner, lease_until=until
        )
    a_ran, b_ran, a_go, b_go = (threading.Event() for _ in range(4))
    a = _record_in_thread(first, "link-a/1", a_ran, a_go)
    assert a_ran.wait(10)  # a's statement ran; a has not committed
    b = _record_in_thread(second, "link-b/1", b_ran, b_go)
    assert b_ran.wait(10)  # b's statement saw a's recipient still active
    b_go.set()
    b.join(10)
    assert Message.objects.get(pk=message.pk).state != MessageState.DONE  # a is not in yet
    a_go.set()
    a.join(10)
    assert set(Recipient.objects.filter(message=message).values_list("state", flat=True)) == {
        RecipientState.DELIVERED
    }
    assert Message.objects.get(pk=message.pk).state == MessageState.DONE


def _finish_in_thread(rcpt: Recipient, statement_done, go) -> threading.Thread:
    """A transaction that finalizes ``rcpt`` and finishes its message as the
    round's final record, an expiry or an operator's removal do
    (``finish_ids`` inside the transaction); COMMIT once ``go``."""
    now = clock.now()

    def write() -> None:
        Recipient.objects.filter(pk=rcpt.pk).update(
            state=RecipientState.FAILED, lease_owner="", lease_until=None, final_at=now
        )
        Message.objects.finish_ids([rcpt.message_id], now)

    return _in_transaction_thread(write, statement_done, go)


@pytest.mark.django_db(transaction=True)
def test_two_transactions_finishing_a_message_at_once_finish_it_after_their_commits():
    """The same race through ``finish_ids`` inside the writing transaction: the
    check runs after the commit (``transaction.on_commit``), and the later of
    the two sees both recipients final."""
    message = accept(IncomingRecipient("a@example.net"), IncomingRecipient("b@example.com"))
    first, second = Recipient.objects.filter(message=message).order_by("id")
    a_ran, b_ran, a_go, b_go = (threading.Event() for _ in range(4))
    a = _finish_in_thread(first, a_ran, a_go)
    assert a_ran.wait(10)
    b = _finish_in_thread(second, b_ran, b_go)
    assert b_ran.wait(10)
    b_go.set()
    b.join(10)
    assert Message.objects.get(pk=message.pk).state != MessageState.DONE  # a is not in yet
    a_go.set()
    a.join(10)
    assert Message.objects.get(pk=message.pk).state == MessageState.DONE
