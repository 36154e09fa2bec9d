"""The inbound SMTP server end to end: a real server on loopback, smtplib and raw sockets."""

from __future__ import annotations

import re
import ssl
import threading

import pytest

from delivery.qmgr import tasks
from delivery.smtpd import server
from delivery.smtpd import session as smtpd_session
from queues.accept import prepared_accept
from queues.models import Message
from tests.support.sinks import make_certificate

pytestmark = pytest.mark.django_db(transaction=True)

RAW = (
    b"From: Sender <sender@example.org>\r\n"
    b"To: rcpt@example.net\r\n"
    b"Subject: full path\r\n"
    b"Message-ID: <full-path@example.org>\r\n"
    b"\r\n"
    b"line one\r\n"
    b".a line that starts with a dot\r\n"
    b"..two dots\r\n"
    b"\r\n"
    b"last line\r\n"
)
ENHANCED = re.compile(r"^\d{3} [245]\.\d{1,3}\.\d{1,3} ")


def qid_of(text: str) -> str:
    match = re.fullmatch(r"2\.0\.0 Ok: queued as (\w+)", text)
    assert match, text
    return match.group(1)


def test_it_commits_the_message_and_its_recipients_before_it_names_the_qid(settings, start_ingress):
    settings.MAILRELAY_HOSTNAME = "relay.test"
    ingress = start_ingress()
    with ingress.smtp(helo="client.test") as client:
        assert client.mail(
            "sender@example.org", ["SIZE=300", "BODY=8BITMIME", "RET=HDRS", "ENVID=Env+2B1"]
        ) == (250, b"2.1.0 Ok")
        assert (
            client.rcpt("a@Example.NET", ["NOTIFY=SUCCESS,FAILURE", "ORCPT=rfc822;A@Example.NET"])[
                0
            ]
            == 250
        )
        assert client.rcpt("b@example.com", ["NOTIFY=NEVER"])[0] == 250
        code, text = client.data(RAW)
        # Visible to another connection the moment 250 arrives: it was committed.
        message = Message.objects.get(qid=qid_of(text.decode()))
    assert code == 250

    data = bytes(message.data)
    assert data.endswith(RAW)
    received = data[: -len(RAW)].decode()
    assert re.fullmatch(
        rf"Received: from client\.test \(unknown \[127\.0\.0\.1\]\)\r\n"
        rf"\tby relay\.test \(mailrelay\) with ESMTP id {message.qid}; [^\r\n]+\r\n",
        received,
    ), received
    assert (message.mail_from, message.client_address, message.client_helo) == (
        "sender@example.org",
        "127.0.0.1",
        "client.test",
    )
    assert (message.declared_size, message.body_type, message.ret, message.envid) == (
        300,
        "8BITMIME",
        "HDRS",
        "Env+2B1",
    )
    assert (message.source, message.smtputf8, message.size) == ("smtp", False, len(data))
    assert message.message_id == "<full-path@example.org>"
    rows = list(
        message.recipients.order_by("id").values_list("address", "domain", "orcpt", "notify")
    )
    assert rows == [
        ("a@Example.NET", "example.net", "rfc822;A@Example.NET", "SUCCESS,FAILURE"),
        ("b@example.com", "example.com", "", "NEVER"),
    ]


def test_it_advertises_the_esmtp_extensions_of_a_relay(start_ingress):
    ingress = start_ingress(max_message_size=123456)
    with ingress.raw() as client:
        assert client.greeting[0] == 220
        code, lines = client.command("EHLO client.test")
    assert code == 250
    assert lines[1:] == [
        "PIPELINING",
        "SIZE 123456",
        "8BITMIME",
        "SMTPUTF8",
        "ENHANCEDSTATUSCODES",
        "DSN",
    ]


def test_every_reply_after_the_greeting_carries_an_enhanced_status_code(ingress):
    commands = [
        "MAIL FROM:<a@example.org>",  # before EHLO
        "EHLO client.test",
        "NOOP",
        "HELP",
        "VRFY <a@example.org>",
        "EXPN staff",
        "RCPT TO:<a@example.net>",
        "DATA",
        "MAIL FROM:<bad",
        "MAIL FROM:<a@example.org> FOO=1",
        "MAIL TO:<a@example.org>",
        "MAIL FROM:<a@example.org>",
        "MAIL FROM:<b@example.org>",
        "RCPT TO:<postmaster>",
        "RCPT TO:<x@example.net> NOTIFY=bogus",
        "RCPT FROM:<x@example.net>",
        "DATA now",
        "RSET",
        "AUTH PLAIN AGFhAGI=",
        "STARTTLS",
        "BOGUS",
        "",
        "NOOP " + "x" * 600,
        "QUIT",
    ]
    with ingress.raw() as client:
        for command in commands:
            code, lines = client.command(command)
            if command.startswith("EHLO"):
                continue
            assert ENHANCED.match(f"{code} {lines[-1]}"), (command, code, lines)


def test_it_accepts_the_null_sender(ingress):
    code, text = ingress.send(RAW, mail_from="")
    assert code == 250
    assert Message.objects.get(qid=qid_of(text)).mail_from == ""


def test_it_answers_pipelined_commands_in_order(ingress):
    with ingress.raw() as client:
        client.command("EHLO client.test")
        client.send(
            b"MAIL FROM:<a@example.org>\r\n"
            b"RCPT TO:<b@example.net>\r\n"
            b"RCPT TO:<c%example.net@relay.test>\r\n"
            b"RCPT TO:<d@example.net>\r\n"
            b"DATA\r\n"
        )
        assert [client.reply_line() for _ in range(5)] == [
            "250 2.1.0 Ok",
            "250 2.1.5 Ok",
            "554 5.7.1 Sender-specified routing (%, !, @ or source route) is not relayed",
            "250 2.1.5 Ok",
            "354 End data with <CR><LF>.<CR><LF>",
        ]
        client.send(RAW + b".\r\nNOOP\r\nQUIT\r\n")
        code, lines = client.reply()
        assert code == 250
        assert client.reply_line() == "250 2.0.0 OK"
        assert client.reply_line() == "221 2.0.0 Bye"
    message = Message.objects.get(qid=qid_of(lines[0]))
    assert sorted(message.recipients.values_list("address", flat=True)) == [
        "b@example.net",
        "d@example.net",
    ]


def test_it_marks_helo_and_smtputf8_sessions_in_the_received_header(ingress):
    with ingress.raw() as client:
        client.command("HELO old.client.test")
        client.send(b"MAIL FROM:<a@example.org>\r\nRCPT TO:<b@example.net>\r\nDATA\r\n")
        assert [client.reply()[0] for _ in range(3)] == [250, 250, 354]
        client.send(RAW + b".\r\n")
        helo_qid = qid_of(client.reply()[1][0])

        client.command("EHLO new.client.test")
        client.send(
            "MAIL FROM:<jöran@exämple.org> SMTPUTF8\r\n"
            "RCPT TO:<ådne@exämple.net>\r\n"
            "DATA\r\n".encode()
        )
        assert [client.reply()[0] for _ in range(3)] == [250, 250, 354]
        client.send(RAW + b".\r\n")
        utf8_qid = qid_of(client.reply()[1][0])
    helo = Message.objects.get(qid=helo_qid)
    assert f"with SMTP id {helo_qid}".encode() in bytes(helo.data)
    utf8 = Message.objects.get(qid=utf8_qid)
    assert f"with UTF8SMTP id {utf8_qid}".encode() in bytes(utf8.data)
    assert (utf8.mail_from, utf8.smtputf8) == ("jöran@exämple.org", True)
    assert utf8.recipients.get().address == "ådne@exämple.net"


def test_it_rings_the_categorizer_after_the_commit(ingress, monkeypatch):
    rung = threading.Event()
    committed_when_rung: list[int] = []

    class App:
        def send_task(self, name: str, *args: object, **kwargs: object) -> None:
            assert name == tasks.CATEGORIZE
            committed_when_rung.append(Message.objects.count())
            rung.set()

    monkeypatch.setattr(tasks, "current_app", App())
    assert ingress.send(RAW)[0] == 250
    assert rung.wait(5)
    assert committed_when_rung == [1]


def test_it_says_421_to_open_sessions_when_it_stops(ingress):
    with ingress.raw() as client:
        client.command("EHLO client.test")
        ingress.stop()
        assert client.reply_line().startswith("421 4.3.2 ")


def test_it_answers_a_message_being_committed_before_it_stops(ingress, monkeypatch):
    committing, release, stopping = threading.Event(), threading.Event(), threading.Event()

    def slow_accept(prepared):
        committing.set()
        assert release.wait(10)
        return prepared_accept(prepared)

    def shutdown(session) -> None:
        original_shutdown(session)
        stopping.set()

    original_shutdown = smtpd_session.InboundSMTP.shutdown
    monkeypatch.setattr(server, "prepared_accept", slow_accept)  # the commit
    monkeypatch.setattr(smtpd_session.InboundSMTP, "shutdown", shutdown)
    with ingress.raw() as client:
        client.command("EHLO client.test")
        client.send(b"MAIL FROM:<a@example.org>\r\nRCPT TO:<b@example.net>\r\nDATA\r\n")
        assert [client.reply()[0] for _ in range(3)] == [250, 250, 354]
        client.send(RAW + b".\r\n")
        assert committing.wait(10)
        stopper = threading.Thread(target=ingress.stop)
        stopper.start()
        assert stopping.wait(10)  # the server is stopping while the commit runs
        release.set()
        code, lines = client.reply()
        assert client.reply_line().startswith("421 4.3.2 ")
        stopper.join(20)
    assert code == 250
    assert Message.objects.filter(qid=qid_of(lines[0])).exists()


def test_it_says_421_before_closing_an_idle_session(start_ingress):
    ingress = start_ingress(timeout=0.2)
    with ingress.raw() as client:
        client.command("EHLO client.test")
        assert client.reply_line().startswith("421 4.4.2 ")


@pytest.fixture
def certificate(tmp_path):
    cert, key = make_certificate(tmp_path, "relay.test")
    return str(cert), str(key)


def test_it_offers_starttls_when_a_certificate_is_configured(settings, start_ingress, certificate):
    settings.MAILRELAY_TLS_CERT_FILE, settings.MAILRELAY_TLS_KEY_FILE = certificate
    ingress = start_ingress()
    with ingress.smtp() as client:
        assert client.has_extn("starttls")
        client.starttls(context=ssl._create_unverified_context())
        client.ehlo()
        assert not client.has_extn("starttls")
        assert client.has_extn("enhancedstatuscodes")
        client.mail("a@example.org")
        client.rcpt("b@example.net")
        code, text = client.data(RAW)
    assert code == 250
    qid = qid_of(text.decode())
    assert f"with ESMTPS id {qid}".encode() in bytes(Message.objects.get(qid=qid).data)
