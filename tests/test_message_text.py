"""The text the Queue Viewer's substring filters search (``MessageText``,
migration 0011): written by the database once a message, whoever inserts the
recipients; written again only when an operator corrects the envelope; never
touched by a message's state changes (issue #24: the GIN entries a message
costs)."""

from __future__ import annotations

import pytest
from django.db import connection

from queues.accept import IncomingEnvelope, IncomingRecipient, messages_accept
from queues.filters import MessageFilter
from queues.lib import clock
from queues.models import Message, MessageState, MessageText, Recipient, RecipientState
from queues.services.envelope_edits import Edits
from tests.support.operator_factories import body, make_message

pytestmark = pytest.mark.django_db


def text_of(message: Message) -> MessageText:
    return MessageText.objects.get(message=message)


def test_the_accept_writes_the_text_once_with_every_recipient_in_order():
    message = make_message("b@example.net", "a@example.com", subject="Quarterly report")
    text = text_of(message)
    assert text.mail_from == "a@example.org"
    assert text.subject == "Quarterly report"
    assert text.msgid == message.message_id and text.msgid
    assert text.recipients == "b@example.net\na@example.com"


def test_a_group_commit_writes_each_message_its_own_text():
    envelopes = [
        IncomingEnvelope(
            mail_from=f"s{n}@example.org",
            recipients=[
                IncomingRecipient(f"r{n}a@example.net"),
                IncomingRecipient(f"r{n}b@x.test"),
            ],
        )
        for n in range(3)
    ]
    stored = messages_accept([(env, body(f"subject {n}")) for n, env in enumerate(envelopes)])
    for n, message in enumerate(stored):
        assert isinstance(message, Message)
        text = text_of(message)
        assert (text.mail_from, text.subject) == (f"s{n}@example.org", f"subject {n}")
        assert text.recipients == f"r{n}a@example.net\nr{n}b@x.test"


def test_recipients_inserted_by_any_code_are_in_the_text():
    message = make_message("first@example.net")
    Recipient.objects.create(
        message=message,
        address="later@example.org",
        domain="example.org",
        next_attempt_at=clock.now(),
    )
    assert text_of(message).recipients == "first@example.net\nlater@example.org"


def test_an_envelope_correction_is_in_the_text():
    message = make_message("typo@exmaple.net")
    dead = Recipient.objects.filter(message=message)
    Edits(recipient="right@example.net", sender="new@example.org").apply(message.pk, dead)
    text = text_of(message)
    assert text.recipients == "right@example.net"
    assert text.mail_from == "new@example.org"
    found = MessageFilter(recipient="right@example.net", sender="new@example.org")
    assert list(found.queryset().values_list("pk", flat=True)) == [message.pk]
    assert not MessageFilter(recipient="typo@").queryset().exists()


def test_the_filters_search_the_text():
    a = make_message("x@one.example", sender="alice@example.org", subject="Invoice 7")
    b = make_message("y@two.example", "z@three.example", sender="bob@example.org")

    def found(**params: str) -> list[int]:
        return sorted(MessageFilter(**params).queryset().values_list("pk", flat=True))

    assert found(sender="ALICE@") == [a.pk]
    assert found(recipient="z@three") == [b.pk]
    assert found(recipient="two.example") == [b.pk]
    assert found(subject="invoice") == [a.pk]
    assert found(message_id=b.message_id.strip("<>")[:12]) == [b.pk]
    # The addresses are one a line: no search spans two of them.
    assert found(recipient="two.example\nz@") == []


@pytest.mark.skipif(connection.vendor != "postgresql", reason="xmin and GIN: PostgreSQL")
def test_state_changes_leave_the_text_row_alone_and_its_indexes_are_the_trigram_ones():
    message = make_message("u@example.net")

    def version() -> str:
        with connection.cursor() as cur:
            cur.execute(
                "SELECT xmin::text FROM queues_messagetext WHERE message_id = %s", [message.pk]
            )
            return cur.fetchone()[0]

    before = version()
    Message.objects.filter(pk=message.pk).update(state=MessageState.QUEUED, lease_owner="x")
    Recipient.objects.filter(message=message).update(state=RecipientState.DELIVERED)
    Message.objects.filter(pk=message.pk).update(state=MessageState.DONE)
    assert version() == before
    with connection.cursor() as cur:
        cur.execute(
            "SELECT tablename, indexname FROM pg_indexes WHERE indexdef LIKE '%gin_trgm_ops%'"
        )
        trigram = sorted(cur.fetchall())
    assert trigram == [
        ("queues_messagetext", "messagetext_mail_from_trgm"),
        ("queues_messagetext", "messagetext_msgid_trgm"),
        ("queues_messagetext", "messagetext_recipients_trgm"),
        ("queues_messagetext", "messagetext_subject_trgm"),
        ("queues_recipient", "recipient_error_trgm"),
    ]


def test_the_text_goes_with_its_message():
    message = make_message("u@example.net")
    Message.objects.filter(pk=message.pk).delete()
    assert not MessageText.objects.filter(message_id=message.pk).exists()
