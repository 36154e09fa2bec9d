"""Limits, SMTP smuggling, hop counts and a failing commit, against the real server."""

from __future__ import annotations

import socket
import threading

import pytest
from django.db import connection

from delivery.qmgr import tasks
from delivery.smtpd import server
from queues.accept import prepared_accept
from queues.models import Message
from tests.support.ingress import SMTPRefused

pytestmark = pytest.mark.django_db(transaction=True)

RAW = b"From: a@example.org\r\nSubject: data\r\n\r\nbody\r\n"
ENVELOPE = b"MAIL FROM:<a@example.org>\r\nRCPT TO:<b@example.net>\r\nDATA\r\n"


def open_data(client) -> None:
    """EHLO, then MAIL/RCPT/DATA pipelined; leaves the client after 354."""
    assert client.command("EHLO client.test")[0] == 250
    client.send(ENVELOPE)
    assert [client.reply()[0] for _ in range(3)] == [250, 250, 354]


def stuffed(message: bytes) -> bytes:
    """The message as sent after DATA: dot-stuffed, then CRLF.CRLF."""
    if message.startswith(b"."):
        message = b"." + message
    return message.replace(b"\r\n.", b"\r\n..") + b".\r\n"


def stored_body(qid_reply: tuple[int, list[str]]) -> bytes:
    code, lines = qid_reply
    assert code == 250, lines
    message = Message.objects.get(qid=lines[0].rsplit(" ", 1)[1])
    return bytes(message.data)


TRICKY = (
    b".starts with a dot\r\n"
    b"Subject: dots\r\n\r\n"
    b".\r\n"
    b"..\r\n"
    b"ends with a dot.\r\n"
    b"x.\r\n.x\r\n"
    + b"long line " * 600
    + b"\r\n"
    + (b"no terminator here " * 80 + b"\r\n") * 60
    + b"last.\r\n"
)


def test_it_keeps_the_exact_bytes_of_dots_long_lines_and_big_blocks(ingress):
    with ingress.raw() as client:
        open_data(client)
        client.send(stuffed(TRICKY))
        assert stored_body(client.reply()).endswith(TRICKY)


def test_it_finds_the_end_of_data_across_any_packet_boundary(ingress):
    message = b"Subject: slow\r\n\r\n.\r\nx.\r\n..\r\nend\r\n"
    with ingress.raw() as client:
        client.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        open_data(client)
        for byte in stuffed(message):
            client.send(bytes([byte]))
        assert stored_body(client.reply()).endswith(message)


def test_it_accepts_an_empty_message(ingress):
    with ingress.raw() as client:
        open_data(client)
        client.send(b".\r\n")
        assert stored_body(client.reply()).endswith(b"\r\n")


def test_it_stores_nothing_when_the_client_goes_away_during_data(ingress):
    with ingress.raw() as client:
        open_data(client)
        client.send(RAW[:20])
    # the server is still fine, and the half message left no trace
    assert ingress.send(RAW)[0] == 250
    assert Message.objects.count() == 1


def test_it_commits_and_rings_even_when_the_client_leaves_during_the_commit(ingress, monkeypatch):
    committing, release, rung = threading.Event(), threading.Event(), threading.Event()

    def slow_accept(prepared):
        committing.set()
        assert release.wait(10)
        return prepared_accept(prepared)

    monkeypatch.setattr(server, "prepared_accept", slow_accept)  # the commit

    class App:
        def send_task(self, name: str, *args: object, **kwargs: object) -> None:
            assert name == tasks.CATEGORIZE
            rung.set()

    monkeypatch.setattr(tasks, "current_app", App())
    with ingress.raw() as client:
        open_data(client)
        client.send(RAW + b".\r\n")
        assert committing.wait(10)
    release.set()  # the client is gone; the commit completes all the same
    assert rung.wait(10)
    assert Message.objects.count() == 1


def test_it_refuses_a_declared_size_over_the_limit(start_ingress):
    ingress = start_ingress(max_message_size=1000)
    with pytest.raises(SMTPRefused) as refused:
        ingress.send(RAW, mail_options=["SIZE=1001"])
    assert (refused.value.code, refused.value.text[:6]) == (552, "5.3.4 ")
    assert ingress.send(RAW, mail_options=["SIZE=1000"])[0] == 250


def test_it_refuses_data_over_the_size_limit_and_stays_usable(start_ingress):
    ingress = start_ingress(max_message_size=1000)
    with ingress.raw() as client:
        open_data(client)
        client.send(RAW + b"x" * 70 + b"\r\n" * 20 + b"y" * 998 + b"\r\n.\r\n")
        assert client.reply_line().startswith("552 5.3.4 ")
        client.send(ENVELOPE)
        assert [client.reply()[0] for _ in range(3)] == [250, 250, 354]
        client.send(RAW + b".\r\n")
        assert client.reply()[0] == 250
    assert Message.objects.count() == 1


def test_it_defers_the_recipient_over_the_limit(start_ingress):
    ingress = start_ingress(max_recipients=3)
    with ingress.raw() as client:
        client.command("EHLO client.test")
        client.command("MAIL FROM:<a@example.org>")
        codes = [client.command(f"RCPT TO:<r{i}@example.net>") for i in range(5)]
        assert [code for code, _ in codes] == [250, 250, 250, 452, 452]
        assert codes[3][1] == ["4.5.3 Too many recipients"]
        assert client.command("DATA")[0] == 354
        client.send(RAW + b".\r\n")
        assert client.reply()[0] == 250
    assert Message.objects.get().recipients.count() == 3


SMUGGLED = (
    b"MAIL FROM:<admin@example.org>\r\n"
    b"RCPT TO:<victim@example.net>\r\n"
    b"DATA\r\n"
    b"From: admin@example.org\r\nSubject: smuggled\r\n\r\nsmuggled body\r\n"
)


# CVE-2023-51764 and friends: an end of data that only some servers see.
FAKE_ENDS = [b"\n.\r\n", b"\r\n.\n", b"\n.\n", b"\r.\r\n", b"\r\n.\r", b"\r.\r"]


def test_it_rejects_smuggling_and_never_stores_the_smuggled_message(ingress):
    with ingress.raw() as client:
        for fake_end in FAKE_ENDS:
            open_data(client)
            client.send(RAW + b"first" + fake_end + SMUGGLED + b".\r\n")
            assert client.reply_line().startswith("550 5.6.0 "), fake_end
            # exactly one reply came for all of that: the next one answers NOOP
            assert client.command("NOOP")[0] == 250, fake_end
        assert not Message.objects.exists()
        # the session is clean: a proper message is accepted, alone
        client.send(ENVELOPE)
        assert [client.reply()[0] for _ in range(3)] == [250, 250, 354]
        client.send(RAW + b".\r\n")
        assert client.reply()[0] == 250
    message = Message.objects.get()
    assert b"smuggled" not in bytes(message.data)


def test_it_rejects_a_bare_lf_or_cr_inside_a_line(ingress):
    with ingress.raw() as client:
        for line in [b"Subject: a\nBcc: b@example.net\r\n", b"lone\rcarriage\r\n"]:
            open_data(client)
            client.send(b"From: a@example.org\r\n" + line + b"\r\nbody\r\n.\r\n")
            assert client.reply_line().startswith("550 5.6.0 "), line
    assert not Message.objects.exists()


def test_it_rejects_a_message_that_has_looped_too_often(ingress):
    looped = b"Received: from x by y; Mon, 1 Jan 2024 00:00:00 +0000\r\n" * 101 + RAW
    with ingress.raw() as client:
        open_data(client)
        client.send(looped + b".\r\n")
        assert client.reply_line().startswith("554 5.4.6 ")
        client.send(ENVELOPE)
        assert [client.reply()[0] for _ in range(3)] == [250, 250, 354]
        client.send(looped[len(looped) // 101 :] + b".\r\n")  # 100 Received headers pass
        assert client.reply()[0] == 250
    assert Message.objects.count() == 1


@pytest.fixture
def failing_commit():
    """A deferred constraint trigger: every message INSERT fails at COMMIT."""
    with connection.cursor() as cursor:
        cursor.execute(
            "CREATE FUNCTION test_refuse_commit() RETURNS trigger LANGUAGE plpgsql AS "
            "$$ BEGIN RAISE EXCEPTION 'commit refused by the test'; END $$"
        )
        cursor.execute(
            "CREATE CONSTRAINT TRIGGER test_refuse_commit AFTER INSERT ON queues_message "
            "DEFERRABLE INITIALLY DEFERRED FOR EACH ROW EXECUTE FUNCTION test_refuse_commit()"
        )

    def drop() -> None:
        with connection.cursor() as cursor:
            cursor.execute("DROP TRIGGER IF EXISTS test_refuse_commit ON queues_message")
            cursor.execute("DROP FUNCTION IF EXISTS test_refuse_commit()")

    yield drop
    drop()


def test_it_answers_451_when_the_commit_fails_and_accepts_the_next_message(
    start_ingress, failing_commit
):
    ingress = start_ingress(db_threads=1)  # the next message uses the same connection
    with ingress.raw() as client:
        open_data(client)
        client.send(RAW + b".\r\n")
        assert client.reply_line() == "451 4.3.0 Error: message not stored; try again later"
        assert not Message.objects.exists()

        failing_commit()
        client.send(ENVELOPE)
        assert [client.reply()[0] for _ in range(3)] == [250, 250, 354]
        client.send(RAW + b".\r\n")
        assert client.reply()[0] == 250
    assert Message.objects.count() == 1
