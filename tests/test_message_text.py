"""The text the Queue Viewer's substring filters on the sender, the Subject and
the Message-ID search (``MessageText``, migration 0012): written by the
database once a message, whoever inserts it; written again only when an
operator corrects the sender; never touched by a message's state changes;
gone with its message (issue #24: the trigram entries a state change cost)."""

from __future__ import annotations

import pytest
from django.db import connection

from queues.accept import IncomingEnvelope, IncomingRecipient, messages_accept
from queues.filters import MessageFilter
from queues.models import Message, MessageState, MessageText
from queues.services.envelope_edits import Edits
from tests.support.operator_factories import body, make_message

pytestmark = pytest.mark.django_db


def text_of(message: Message) -> tuple[str, str, str]:
    row = MessageText.objects.get(message=message)
    return row.mail_from, row.subject, row.msgid


def found(**params: str) -> list[int]:
    return sorted(MessageFilter(**params).queryset().values_list("pk", flat=True))


def test_an_inserted_message_has_its_text():
    message = make_message("b@example.net", sender="s@example.org", subject="Quarterly report")
    assert message.message_id
    assert text_of(message) == ("s@example.org", "Quarterly report", message.message_id)


def test_a_group_commit_writes_each_message_its_own_text():
    envelopes = [
        IncomingEnvelope(
            mail_from=f"s{n}@example.org", recipients=[IncomingRecipient(f"r{n}@example.net")]
        )
        for n in range(3)
    ]
    stored = messages_accept([(env, body(f"subject {n}")) for n, env in enumerate(envelopes)])
    for n, message in enumerate(stored):
        assert isinstance(message, Message)
        assert text_of(message) == (
            f"s{n}@example.org",
            f"subject {n}",
            f"<subject-{n}@example.org>",
        )


def test_the_filters_search_the_text():
    a = make_message("x@one.example", sender="alice@example.org", subject="Invoice 7")
    b = make_message("y@two.example", sender="bob@example.org", subject="Minutes")
    assert found(sender="ALICE@") == [a.pk]
    assert found(sender="<bob@example.org>") == [b.pk]
    assert found(subject="invoice") == [a.pk]
    assert found(message_id=b.message_id.strip("<>")[:7]) == [b.pk]
    assert found(sender="example.org", subject="minutes") == [b.pk]
    assert found(sender="carol@") == []


def test_a_corrected_sender_is_searched_and_the_old_one_is_not():
    message = make_message("x@example.net", sender="typo@exmaple.org")
    Edits(sender="right@example.org").apply(message.pk, message.recipients.none())
    assert text_of(message)[0] == "right@example.org"
    assert found(sender="right@example.org") == [message.pk]
    assert found(sender="typo@") == []


def test_a_save_of_every_field_keeps_the_text_as_it_is():
    message = make_message("x@example.net", sender="s@example.org", subject="Same")
    message.state = MessageState.QUEUED
    message.save()  # every column in the UPDATE, none of the three changed
    assert text_of(message) == ("s@example.org", "Same", message.message_id)


@pytest.mark.skipif(connection.vendor != "postgresql", reason="xmin and GIN: PostgreSQL")
def test_state_changes_leave_the_text_row_alone_and_the_message_has_no_trigram_index():
    message = make_message("u@example.net")

    def version() -> str:
        with connection.cursor() as cur:
            cur.execute(
                "SELECT xmin::text FROM queues_messagetext WHERE message_id = %s", [message.pk]
            )
            return cur.fetchone()[0]

    before = version()
    Message.objects.filter(pk=message.pk).update(state=MessageState.CATEGORIZING, lease_owner="x")
    Message.objects.filter(pk=message.pk).update(state=MessageState.QUEUED, lease_owner="")
    Message.objects.filter(pk=message.pk).update(state=MessageState.DONE)
    assert version() == before
    with connection.cursor() as cur:
        cur.execute(
            "SELECT tablename, indexname FROM pg_indexes "
            "WHERE indexdef LIKE '%%gin_trgm_ops%%' ORDER BY 1, 2"
        )
        trigram = cur.fetchall()
    assert trigram == [
        ("queues_messagetext", "messagetext_mail_from_trgm"),
        ("queues_messagetext", "messagetext_msgid_trgm"),
        ("queues_messagetext", "messagetext_subject_trgm"),
        ("queues_recipient", "recipient_address_trgm"),
        ("queues_recipient", "recipient_error_trgm"),
    ]


def test_the_text_goes_with_its_message():
    kept = make_message("k@example.net")
    gone = [make_message("u@example.net"), make_message("v@example.net")]
    Message.objects.filter(pk__in=[m.pk for m in gone]).delete()
    assert list(MessageText.objects.values_list("message_id", flat=True)) == [kept.pk]


@pytest.mark.skipif(connection.vendor != "postgresql", reason="TRUNCATE: PostgreSQL")
@pytest.mark.django_db(transaction=True)  # no deferred foreign-key checks pending
def test_a_truncate_of_the_messages_empties_the_text_and_the_ids_start_again():
    make_message("u@example.net")
    with connection.cursor() as cur:
        cur.execute("TRUNCATE queues_message RESTART IDENTITY CASCADE")
    assert not MessageText.objects.exists()
    again = make_message("v@example.net", subject="After")
    assert again.pk == 1
    assert text_of(again)[1] == "After"
