"""A queue id already taken (issue #20, item 4): the message is stored under a
new one, never answered 250 on the strength of another message's row."""

from __future__ import annotations

import concurrent.futures
import threading
import time
from collections.abc import Callable

import pytest
from django.db import OperationalError

from delivery.smtpd import server
from queues import accept
from queues.accept import IncomingEnvelope, IncomingRecipient, message_accept
from queues.models import Message, Recipient

pytestmark = pytest.mark.django_db(transaction=True)

TAKEN = "TAKENQUEUEID01"
BODY = b"Subject: new\r\n\r\nthe new message\r\n"
OLD_BODY = b"Subject: old\r\n\r\nan older message, stored already\r\n"


@pytest.fixture
def colliding_qid(monkeypatch) -> Callable[[], None]:
    """An older message holds TAKEN; calling the fixture's value makes the next
    queue id drawn TAKEN again (as two random draws may)."""
    original = accept.new_qid
    pending = [True]
    monkeypatch.setattr(accept, "new_qid", lambda: TAKEN)
    message_accept(
        IncomingEnvelope("old@example.org", [IncomingRecipient("old@example.net")]), OLD_BODY
    )
    pending[0] = False

    def next_qid() -> str:
        if pending[0]:
            pending[0] = False
            return TAKEN
        return original()

    monkeypatch.setattr(accept, "new_qid", next_qid)

    def collide() -> None:
        pending[0] = True

    return collide


def stored_addresses() -> set[str]:
    return set(Recipient.objects.values_list("address", flat=True))


def test_over_smtp_a_batch_with_a_taken_queue_id_stores_every_message_it_answers_250(
    start_ingress, monkeypatch, colliding_qid
):
    """The batch fails on the taken queue id; the message that drew it must not
    be answered 250 for the older message's row: it is stored, under a new id."""
    entered, release = threading.Event(), threading.Event()
    batches: list[int] = []
    original = server._store_batch

    def held_store_batch(batch):
        batches.append(len(batch))
        if len(batches) == 1:
            entered.set()
            assert release.wait(10)
        else:
            colliding_qid()  # one message of this batch draws the taken id
        return original(batch)

    monkeypatch.setattr(server, "_store_batch", held_store_batch)
    ingress = start_ingress(db_threads=1)
    committer = ingress.server._committer
    assert committer is not None
    rcpts = [f"r{i}@example.net" for i in range(4)]
    with concurrent.futures.ThreadPoolExecutor(5) as pool:
        first = pool.submit(ingress.send, BODY, rcpt_to=["first@example.net"])
        assert entered.wait(10)
        replies = [pool.submit(ingress.send, BODY, rcpt_to=[r]) for r in rcpts]
        deadline = time.monotonic() + 10
        while committer._jobs.qsize() < len(rcpts):
            assert time.monotonic() < deadline
            time.sleep(0.01)
        release.set()
        assert first.result(10)[0] == 250
        codes = [r.result(10)[0] for r in replies]
    assert batches == [1, 4]
    assert codes == [250] * 4
    assert stored_addresses() == {"old@example.net", "first@example.net", *rcpts}
    old = Message.objects.get(qid=TAKEN)
    assert list(old.recipients.values_list("address", flat=True)) == ["old@example.net"]
    assert Message.objects.count() == 6


def test_over_smtp_a_message_that_draws_a_taken_queue_id_is_stored_under_a_new_one(
    start_ingress, colliding_qid
):
    ingress = start_ingress(db_threads=1)
    colliding_qid()
    code, text = ingress.send(BODY, rcpt_to=["new@example.net"])
    assert code == 250, text
    new = Recipient.objects.get(address="new@example.net").message
    assert new.qid != TAKEN and new.qid in text  # the 250 names the id it is stored under
    assert bytes(new.data).endswith(BODY) and f"id {new.qid}".encode() in bytes(new.data)
    assert Message.objects.get(qid=TAKEN).mail_from == "old@example.org"
    assert Message.objects.count() == 2


def test_a_lost_connection_does_not_take_another_message_s_row_for_this_one(
    monkeypatch, colliding_qid
):
    """The insert's connection is lost; the queue id is then found taken, by a
    different message: this one is stored (under a new id), not answered with
    the other's row."""
    original = accept.insert_with_children
    calls: list[str] = []

    def lose_the_first(message, *args, **kwargs):
        calls.append(message.qid)
        if len(calls) == 1:
            raise OperationalError("server closed the connection unexpectedly")
        return original(message, *args, **kwargs)

    monkeypatch.setattr(accept, "insert_with_children", lose_the_first)
    colliding_qid()
    result = message_accept(
        IncomingEnvelope("new@example.org", [IncomingRecipient("new@example.net")]), BODY
    )
    assert result.qid != TAKEN and calls[0] == TAKEN
    assert Message.objects.get(pk=result.pk).mail_from == "new@example.org"
    assert stored_addresses() == {"old@example.net", "new@example.net"}
