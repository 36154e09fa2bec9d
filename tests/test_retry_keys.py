"""Retry data keyed by long addresses (issue #20, item 3).

Exim keeps RCPT 4xx retry data per address and sender; both come from the
client, so the key is bounded (a readable head and tail and a digest of the
whole), and retry data that cannot be written never undoes the round it
belongs to: the other messages of the round stay delivered, once.

Mail comes in over SMTP (the ingress), the workers run in-process
(tests/support/pipeline.drain), and a real sink answers 4xx at RCPT for the
long address.
"""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.db import OperationalError, connection, transaction

from queues import database
from queues.accept import IncomingEnvelope, IncomingRecipient, message_accept
from queues.database import is_outage
from queues.lib import MAX_KEY_BYTES, address_key, bounded_key, clock
from queues.models import DeliveryType, Message, Recipient, RecipientState, RetryHint
from queues.transitions import flow
from tests.support.pipeline import drain

pytestmark = pytest.mark.django_db(transaction=True)

BODY = b"From: a@example.org\r\nTo: u@example.net\r\nSubject: hello\r\n\r\nbody\r\n"
INNOCENT = "u@example.net"
# Over RetryHint.key's 700 characters (a varchar overflow: DataError).
LONG_RCPT = "l" * 260 + "@example.net"
LONG_SENDER = "s" * 445 + "@example.org"


def wide(n: int, start: int = 0) -> str:
    """``n`` different 4-octet characters (CJK Extension B): PostgreSQL cannot
    compress them below the index's row limit, as it would a repeated one."""
    return "".join(chr(0x20000 + ((start + i) * 7919) % 40000) for i in range(n))


# Under 700 characters, over the 2704 bytes of a btree index row
# (ProgramLimitExceeded, which psycopg files under OperationalError). The
# ingress holds MAIL and RCPT lines to 1000 octets, so such a pair comes from
# the store (a pickup or replay file, an operator's edit), not over SMTP.
WIDE_RCPT = wide(340) + "@example.net"
WIDE_SENDER = wide(330, start=5000) + "@example.org"


@pytest.fixture
def relay(dns_settings, settings, smtp_port):
    settings.MAILRELAY_REMOTE_SMTP_PORT = smtp_port
    settings.MAILRELAY_SMTP_CONNECT_TIMEOUT = timedelta(seconds=2)
    settings.MAILRELAY_SMTP_CLIENT_TIMEOUT = timedelta(seconds=5)
    dns_settings.a("example.net", "127.0.0.2")
    dns_settings.a("example.org", "127.0.0.3")
    return dns_settings


@pytest.fixture
def no_outage_retries(monkeypatch):
    """Fail at once (instead of waiting out an "outage" for as long as the claim
    holds) if the recording takes a database error for a lost connection."""
    seen: list[str] = []

    def drop_connection() -> None:
        seen.append("outage")
        raise AssertionError("a data error was taken for a database outage")

    monkeypatch.setattr(database, "drop_connection", drop_connection)  # retry_outages
    monkeypatch.setattr(flow, "drop_connection", drop_connection)  # Claim.renew
    return seen


def rcpt(address: str) -> Recipient:
    return Recipient.objects.get(address=address)


def delivered_to(sink, address: str) -> int:
    return sum(m.rcpt_tos.count(address) for m in sink.messages)


@pytest.mark.parametrize(
    ("long_rcpt", "long_sender", "smtputf8"),
    [(LONG_RCPT, LONG_SENDER, False), (WIDE_RCPT, WIDE_SENDER, True)],
    ids=["over-700-characters", "over-the-btree-row-size"],
)
def test_a_4xx_for_a_long_address_defers_it_and_leaves_its_round_delivered_once(
    relay, sink_factory, start_ingress, no_outage_retries, long_rcpt, long_sender, smtputf8
):
    sink = sink_factory("127.0.0.2", rcpt_tempfail={long_rcpt: 1}, command_size_limit=8192)
    ingress = start_ingress()
    assert ingress.send(BODY, rcpt_to=[INNOCENT])[0] == 250
    if smtputf8:
        env = IncomingEnvelope(long_sender, [IncomingRecipient(long_rcpt)], smtputf8=True)
        message_accept(env, BODY)
    else:
        assert ingress.send(BODY, mail_from=long_sender, rcpt_to=[long_rcpt])[0] == 250
    raw = f"R:{long_rcpt}:<{long_sender}>"  # the key as it was built before
    assert len(raw) > 700 or len(raw.encode()) > 2704
    key = address_key(long_rcpt, long_sender)

    drain()  # one round: the innocent message and the long one

    assert no_outage_retries == []
    innocent = rcpt(INNOCENT)
    assert innocent.state == RecipientState.DELIVERED
    assert delivered_to(sink, INNOCENT) == 1
    deferred = rcpt(long_rcpt)
    assert (deferred.state, deferred.last_code) == (RecipientState.DEFERRED, 450)
    assert not Message.objects.filter(crash_count__gt=0).exists()
    hint = RetryHint.objects.get(key=key)
    assert hint.error == "rcpt_450" and hint.next_try == deferred.next_attempt_at
    assert len(hint.key.encode()) <= MAX_KEY_BYTES and hint.key.startswith("R:")

    clock.advance(timedelta(minutes=16))
    drain()  # the long one goes; nothing is sent twice; its retry data is cleared

    assert rcpt(long_rcpt).state == RecipientState.DELIVERED
    assert delivered_to(sink, long_rcpt) == 1
    assert delivered_to(sink, INNOCENT) == 1
    assert not RetryHint.objects.filter(key=key).exists()
    assert not Recipient.objects.filter(queue__delivery_type=DeliveryType.POISON).exists()


@pytest.fixture
def hints_refused():
    """Every RCPT retry-data write fails in PostgreSQL, as an index row over its
    limit does (SQLSTATE 54000, ProgramLimitExceeded)."""
    table = RetryHint._meta.db_table
    with connection.cursor() as cursor:
        cursor.execute(
            "CREATE OR REPLACE FUNCTION mr_test_refuse_hint() RETURNS trigger AS $$ BEGIN "
            "IF NEW.key LIKE 'R:%' THEN RAISE EXCEPTION 'hint refused' USING ERRCODE = '54000'; "
            "END IF; RETURN NEW; END $$ LANGUAGE plpgsql"
        )
        cursor.execute(
            f"CREATE TRIGGER mr_test_refuse_hint BEFORE INSERT OR UPDATE ON {table} "
            "FOR EACH ROW EXECUTE FUNCTION mr_test_refuse_hint()"
        )
    yield
    with connection.cursor() as cursor:
        cursor.execute(f"DROP TRIGGER IF EXISTS mr_test_refuse_hint ON {table}")
        cursor.execute("DROP FUNCTION IF EXISTS mr_test_refuse_hint()")


def test_retry_data_that_cannot_be_written_does_not_undo_its_round(
    relay, sink_factory, start_ingress, no_outage_retries, hints_refused
):
    sink = sink_factory("127.0.0.2", rcpt_tempfail={"later@example.net": 1})
    ingress = start_ingress()
    assert ingress.send(BODY, rcpt_to=[INNOCENT])[0] == 250
    assert ingress.send(BODY, rcpt_to=["later@example.net"])[0] == 250

    drain()

    assert no_outage_retries == []
    assert rcpt(INNOCENT).state == RecipientState.DELIVERED
    assert delivered_to(sink, INNOCENT) == 1
    later = rcpt("later@example.net")
    assert (later.state, later.last_code) == (RecipientState.DEFERRED, 450)
    assert not Message.objects.filter(crash_count__gt=0).exists()
    assert not RetryHint.objects.filter(key__startswith="R:").exists()  # dropped, logged

    clock.advance(timedelta(minutes=16))
    drain()
    assert delivered_to(sink, "later@example.net") == 1
    assert delivered_to(sink, INNOCENT) == 1


def test_a_long_key_is_bounded_readable_and_distinct():
    tail = "@example.net:<s@example.org>"
    a, b = bounded_key("R:" + "a" * 900 + tail), bounded_key("R:" + "a" * 901 + tail)
    assert a != b
    assert a.startswith("R:aaaa") and tail in a
    assert len(a.encode()) <= MAX_KEY_BYTES and len(a) < 700
    assert len(bounded_key("R:" + wide(600)).encode()) <= MAX_KEY_BYTES
    assert bounded_key("R:u@example.net:<s@example.org>") == "R:u@example.net:<s@example.org>"


def test_a_row_too_large_for_its_index_is_a_data_error_not_an_outage():
    """A real ProgramLimitExceeded (psycopg files it under OperationalError)."""
    now = clock.now()
    with pytest.raises(OperationalError) as caught, transaction.atomic():
        RetryHint.objects.create(
            key="R:" + wide(690), first_failed=now, last_tried=now, next_try=now
        )
    assert not is_outage(caught.value)
    assert is_outage(OperationalError("server closed the connection unexpectedly"))


def test_while_connected_does_not_wait_out_a_data_error(no_outage_retries):
    calls: list[int] = []
    now = clock.now()

    def work() -> None:
        calls.append(1)
        with transaction.atomic():
            RetryHint.objects.create(
                key="R:" + wide(690), first_failed=now, last_tried=now, next_try=now
            )

    claim = flow.Claim("test", lambda until: True)
    with pytest.raises(OperationalError):
        flow.while_connected(claim, work)
    assert calls == [1] and no_outage_retries == []
