import pytest

from queues.accept import IncomingEnvelope, IncomingRecipient, message_accept, new_qid
from queues.lib import inspect_headers
from queues.models import Message, MessageState, Recipient, RecipientState

RAW = (
    b"From: a@example.org\r\nTo: b@example.net\r\n"
    b"Subject: =?utf-8?q?caf=C3=A9?= and\r\n more\r\n"
    b"Message-ID: <abc@example.org>\r\n\r\nbody line\r\n"
)


def test_it_copies_out_subject_message_id_and_hop_count():
    info = inspect_headers(b"Received: x\r\nReceived: y\r\n" + RAW)
    assert info.subject == "café and more"
    assert info.message_id == "<abc@example.org>"
    assert info.received_count == 2


def test_it_makes_unique_sortable_queue_ids():
    ids = [new_qid() for _ in range(2000)]
    assert len(set(ids)) == len(ids)
    assert all(len(i) == 14 and i.isalnum() for i in ids)


@pytest.mark.django_db
def test_it_stores_exact_bytes_after_our_received_header(settings):
    settings.MAILRELAY_HOSTNAME = "relay.test"
    env = IncomingEnvelope(
        mail_from="a@example.org",
        recipients=[
            IncomingRecipient(
                "b@Example.NET", orcpt="rfc822;B@example.net", notify="SUCCESS,FAILURE"
            )
        ],
        ret="HDRS",
        envid="Env-1",
        client_address="192.0.2.1",
        client_helo="client.example.org",
    )
    message = message_accept(env, RAW)
    stored = Message.objects.get(pk=message.pk)
    data = bytes(stored.data)
    assert data.endswith(RAW)
    assert data.startswith(b"Received: from client.example.org (unknown [192.0.2.1])\r\n")
    assert f"with ESMTP id {stored.qid}".encode() in data
    assert stored.message_id == "<abc@example.org>"
    assert stored.state == MessageState.SUBMISSION
    assert (stored.ret, stored.envid) == ("HDRS", "Env-1")
    rcpt = Recipient.objects.get(message=stored)
    assert (rcpt.address, rcpt.domain) == ("b@Example.NET", "example.net")
    assert (rcpt.orcpt, rcpt.notify) == ("rfc822;B@example.net", "SUCCESS,FAILURE")
    assert rcpt.state == RecipientState.SUBMITTED


@pytest.mark.django_db
def test_it_adds_a_message_id_when_missing(settings):
    settings.MAILRELAY_HOSTNAME = "relay.test"
    raw = b"Subject: hi\r\n\r\nbody\r\n"
    message = message_accept(
        IncomingEnvelope(mail_from="", recipients=[IncomingRecipient("x@example.net")]), raw
    )
    data = bytes(Message.objects.get(pk=message.pk).data)
    assert data.endswith(raw)
    assert f"Message-ID: <{message.qid}.".encode() in data
    assert message.message_id.endswith("@relay.test>")
    assert inspect_headers(data).message_id == message.message_id


@pytest.mark.django_db
def test_a_body_the_database_compresses_is_compressed_with_lz4(settings):
    """PostgreSQL compresses a body that does not fit in the row with LZ4, not
    pglz (migration 0011: a quarter of the server's CPU for it), and gives the
    exact bytes back."""
    from django.db import connection

    assert connection.vendor == "postgresql"
    settings.MAILRELAY_HOSTNAME = "relay.test"
    body = b"".join(b"line %d of a body that compresses well\r\n" % i for i in range(400))
    raw = RAW + body
    env = IncomingEnvelope(mail_from="a@example.org", recipients=[IncomingRecipient("b@x.net")])
    message = message_accept(env, raw)
    with connection.cursor() as cur:
        cur.execute(
            "SELECT pg_column_compression(data), pg_column_size(data), length(data) "
            "FROM queues_message WHERE id = %s",
            [message.pk],
        )
        method, stored_size, length = cur.fetchone()
    assert method == "lz4"
    assert stored_size < length / 4
    assert bytes(Message.objects.get(pk=message.pk).data).endswith(raw)
