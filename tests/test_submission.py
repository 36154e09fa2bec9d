"""Submission with AUTH on the wire (issue #11): STARTTLS on 587, implicit TLS on 465.

Real sockets on loopback, a test CA from trustme (``tls_files``), real
PostgreSQL. No loopback client is in MAILRELAY_RELAY_NETWORKS and no domain is
accepted: whatever relays here relays because it authenticated.
"""

from __future__ import annotations

import base64
import ipaddress
import re
import smtplib
import socket
import ssl
import sys
from types import SimpleNamespace

import pytest

from delivery.smtpd.auth import plain_credentials
from delivery.smtpd.authlimit import AuthFailures
from delivery.smtpd.config import TlsCertificate
from delivery.smtpd.server import InboundServer
from delivery.smtpd.session import protocol_keyword
from queues.models import Event, Message
from queues.services import accounts
from tests.support import processes
from tests.support.ingress import Ingress, RawClient

pytestmark = pytest.mark.django_db(transaction=True)

RAW = b"From: alice@example.org\r\nSubject: submitted\r\n\r\nbody\r\n"
PASSWORD = "correct horse battery staple"


@pytest.fixture
def submission(settings, tls_files, start_ingress):
    """A server with submission (587-style) and submissions (465-style) listeners."""
    # A fast hasher: these tests check many passwords (production uses Django's default).
    settings.PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]
    settings.MAILRELAY_RELAY_NETWORKS = [ipaddress.ip_network("192.0.2.0/24")]
    settings.MAILRELAY_ACCEPTED_DOMAINS = []
    accounts.create_account("alice", PASSWORD, allowed_senders=["alice@example.org", "example.net"])
    return start_ingress(submission=True, submissions=True, max_auth_failures=3)


def starttls_client(ingress, tls_files) -> smtplib.SMTP:
    client = smtplib.SMTP(ingress.host, ingress.submission_port, "client.test", timeout=10)
    client.ehlo()
    client.starttls(context=tls_files.client_context())
    client.ehlo()
    return client


def plain(username: str, password: str) -> str:
    return base64.b64encode(f"\0{username}\0{password}".encode()).decode()


def stored_text(message: Message) -> str:
    return bytes(Message.objects.values_list("data", flat=True).get(pk=message.pk)).decode()


def test_auth_over_starttls_relays_to_any_domain(submission, tls_files):
    with smtplib.SMTP(submission.host, submission.submission_port, timeout=10) as client:
        client.ehlo("client.test")
        assert client.has_extn("starttls")
        assert not client.has_extn("auth")  # never advertised in cleartext
        client.starttls(context=tls_files.client_context())
        client.ehlo("client.test")
        assert client.esmtp_features["auth"].split() == ["PLAIN", "LOGIN"]
        assert not client.has_extn("starttls")
        assert client.login("alice", PASSWORD) == (235, b"2.7.0 Authentication successful")
        refused = client.sendmail("alice@example.org", ["bob@anywhere.example"], RAW)
        assert refused == {}
    message = Message.objects.get()
    assert message.auth_account == "alice"
    assert list(message.recipients.values_list("address", flat=True)) == ["bob@anywhere.example"]
    assert " with ESMTPSA id " in stored_text(message)
    assert accounts.get_account("alice").last_login_at is not None


def test_cleartext_auth_is_refused_538_and_mail_needs_starttls(submission):
    with RawClient(submission.host, submission.submission_port) as client:
        code, lines = client.command("EHLO client.test")
        assert code == 250 and "STARTTLS" in lines and not any("AUTH" in x for x in lines)
        assert client.command(f"AUTH PLAIN {plain('alice', PASSWORD)}")[0] == 538
        assert client.command("MAIL FROM:<alice@example.org>") == (
            530,
            ["5.7.0 Must issue a STARTTLS command first"],
        )
    # The relay port with STARTTLS on offer: AUTH in cleartext is refused too.
    with RawClient(submission.host, submission.port) as client:
        client.command("EHLO client.test")
        code, lines = client.command("AUTH LOGIN")
        assert (code, lines[-1][:6]) == (538, "5.7.11")
    assert not Message.objects.exists()


def test_submission_needs_auth_before_mail(submission, tls_files):
    with starttls_client(submission, tls_files) as client:
        code, text = client.mail("alice@example.org")
        assert (code, text) == (530, b"5.7.0 Authentication required")


def test_wrong_password_535_and_an_event_without_the_password(submission, tls_files):
    with starttls_client(submission, tls_files) as client:
        code, text = client.docmd("AUTH", f"PLAIN {plain('alice', 'wrong password')}")
        assert (code, text) == (535, b"5.7.8 Authentication credentials invalid")
        # an unknown user gets the same answer
        code, _ = client.docmd("AUTH", f"PLAIN {plain('mallory', 'x')}")
        assert code == 535
    events = list(Event.objects.filter(kind="smtp_auth_failed").order_by("id"))
    assert [e.data["username"] for e in events] == ["alice", "mallory"]
    assert all("wrong password" not in e.text + str(e.data) for e in events)


def test_too_many_failures_421_for_that_address(submission, tls_files):
    with starttls_client(submission, tls_files) as client:
        for _ in range(3):  # max_auth_failures=3
            assert client.docmd("AUTH", f"PLAIN {plain('alice', 'guess')}")[0] == 535
        code, text = client.docmd("AUTH", f"PLAIN {plain('alice', PASSWORD)}")
        assert (code, text[:5]) == (421, b"4.7.0")
    # New connections to the submission listeners are refused for a while.
    with RawClient(submission.host, submission.submission_port) as client:
        assert client.greeting[0] == 421
        assert client.closed_by_server()
    assert Event.objects.filter(kind="smtp_auth_failed").count() == 3
    assert Event.objects.filter(kind="smtp_auth_failed", data__locked_out=True).count() == 1


def test_disallowed_sender_553(submission, tls_files):
    with starttls_client(submission, tls_files) as client:
        client.login("alice", PASSWORD)
        code, text = client.mail("ceo@example.org")
        assert (code, text[:5]) == (553, b"5.7.1")
        client.rset()
        assert client.mail("anyone@EXAMPLE.net")[0] == 250  # an allowed domain


def test_rate_limit_per_hour(submission, tls_files):
    accounts.update_account("alice", max_messages_per_hour=1)
    with starttls_client(submission, tls_files) as client:
        client.login("alice", PASSWORD)
        client.sendmail("alice@example.org", ["bob@anywhere.example"], RAW)
        code, text = client.mail("alice@example.org")
        assert code == 451 and b"4.7.1" in text and b"1 messages this hour" in text


def test_implicit_tls_on_465_with_login(submission, tls_files):
    context = tls_files.client_context()
    with smtplib.SMTP_SSL(
        submission.host, submission.submissions_port, "client.test", context=context, timeout=10
    ) as client:
        client.ehlo()
        assert not client.has_extn("starttls")
        assert "LOGIN" in client.esmtp_features["auth"]
        client.user, client.password = "alice", PASSWORD
        assert client.auth("LOGIN", client.auth_login)[0] == 235
        client.sendmail("x@example.net", ["bob@anywhere.example"], RAW)
    message = Message.objects.get()
    assert message.auth_account == "alice"
    assert " with ESMTPSA id " in stored_text(message)


def test_implicit_tls_refuses_mail_without_auth(submission, tls_files):
    context = tls_files.client_context()
    with smtplib.SMTP_SSL(
        submission.host, submission.submissions_port, "client.test", context=context, timeout=10
    ) as client:
        client.ehlo()
        assert client.mail("alice@example.org")[0] == 530


def _serial_over_465(ingress, tls_files) -> int:
    context = tls_files.client_context()
    raw = socket.create_connection((ingress.host, ingress.submissions_port), timeout=10)
    with context.wrap_socket(raw, server_hostname="127.0.0.1") as tls:
        return int(tls.getpeercert()["serialNumber"], 16)


def _serial_over_starttls(ingress, tls_files) -> int:
    with starttls_client(ingress, tls_files) as client:
        return int(client.sock.getpeercert()["serialNumber"], 16)


def test_certificate_renewal_is_picked_up_without_restart(submission, tls_files):
    first = tls_files.serial()
    assert _serial_over_465(submission, tls_files) == first
    assert _serial_over_starttls(submission, tls_files) == first
    tls_files.renew()
    second = tls_files.serial()
    assert second != first
    assert _serial_over_465(submission, tls_files) == second
    assert _serial_over_starttls(submission, tls_files) == second
    assert submission.config.tls.loads == 2


def test_half_written_renewal_keeps_the_old_certificate(submission, tls_files):
    first = tls_files.serial()
    # A new key without its certificate: the pair does not load; the old one serves on.
    tls_files.ca.issue_cert("127.0.0.1").private_key_pem.write_to_path(str(tls_files.key_file))
    assert _serial_over_465(submission, tls_files) == first


def test_relay_port_offers_auth_inside_starttls(submission, tls_files):
    with smtplib.SMTP(submission.host, submission.port, "client.test", timeout=10) as client:
        client.starttls(context=tls_files.client_context())
        client.ehlo()
        client.login("alice", PASSWORD)
        client.sendmail("alice@example.org", ["bob@anywhere.example"], RAW)
    assert Message.objects.get().auth_account == "alice"


def test_protocol_keyword_rfc3848():
    assert protocol_keyword(extended=True, tls=True, utf8=False, auth=True) == "ESMTPSA"
    assert protocol_keyword(extended=True, tls=True, utf8=False) == "ESMTPS"
    assert protocol_keyword(extended=True, tls=False, utf8=False, auth=True) == "ESMTPA"
    assert protocol_keyword(extended=True, tls=True, utf8=True, auth=True) == "UTF8SMTPSA"


def test_plain_credentials():
    assert plain_credentials(b"\0alice\0pw") == ("alice", "pw")
    assert plain_credentials(b"alice\0alice\0pw") == ("alice", "pw")
    assert plain_credentials(b"bob\0alice\0pw") == ("alice", "")  # no proxy authorization
    assert plain_credentials(b"alice\0pw") is None


def test_auth_failures_window():
    failures = AuthFailures(limit=2, window=900)
    assert not failures.add("192.0.2.1", now=0)
    assert failures.add("192.0.2.1", now=10)
    assert not failures.locked_out("192.0.2.2", now=10)
    assert failures.locked_out("192.0.2.1", now=899)
    assert not failures.locked_out("192.0.2.1", now=901)  # the first failure left the window


def test_tls_context_has_no_weak_protocols(tls_files):
    context = TlsCertificate(str(tls_files.cert_file), str(tls_files.key_file)).current()
    assert context.minimum_version == ssl.TLSVersion.TLSv1_2


class RefusingUntrusted:
    """A back-pressure monitor stand-in that refuses every untrusted MAIL FROM."""

    def __init__(self) -> None:
        from delivery.backpressure.samplers import InFlight

        self.uncommitted = InFlight()
        self.seen: list[bool] = []

    async def start(self) -> None:
        pass

    async def stop(self) -> None:
        pass

    def mail_from_decision(self, trusted: bool) -> SimpleNamespace:
        self.seen.append(trusted)
        refuse = None if trusted else "452 4.3.1 Insufficient system resources"
        return SimpleNamespace(refuse_reply=refuse, delay_seconds=0)


def test_back_pressure_treats_an_authenticated_client_as_trusted(submission, tls_files):
    monitor = RefusingUntrusted()
    ingress = Ingress(submission.config, submission=True)
    ingress.server = InboundServer(submission.config, db_threads=2, monitor=monitor)
    ingress.start()
    try:
        with RawClient(ingress.host, ingress.port) as client:  # the relay port, no AUTH
            client.command("EHLO client.test")
            assert client.command("MAIL FROM:<alice@example.org>")[0] == 452
        with starttls_client(ingress, tls_files) as client:
            client.login("alice", PASSWORD)
            assert client.mail("alice@example.org")[0] == 250
    finally:
        ingress.stop()
    assert monitor.seen == [False, True]


def test_runsmtp_listens_for_submission_and_submissions(tls_files):
    """`manage.py runsmtp` with both listeners, as a process: 465 relays after AUTH."""
    accounts.create_account("alice", PASSWORD, allowed_senders=["example.org"])
    proc = processes.Proc(
        "runsmtp",
        [sys.executable, "manage.py", "runsmtp"],
        processes.test_env(
            MAILRELAY_SMTP_LISTEN="127.0.0.1:0",
            MAILRELAY_SUBMISSION_LISTEN="127.0.0.1:0",
            MAILRELAY_SUBMISSIONS_LISTEN="127.0.0.1:0",
            MAILRELAY_TLS_CERT_FILE=str(tls_files.cert_file),
            MAILRELAY_TLS_KEY_FILE=str(tls_files.key_file),
            MAILRELAY_RELAY_NETWORKS="192.0.2.0/24",
        ),
    )
    try:
        proc.wait_for("(submissions)")
        ports = {
            kind: int(port)
            for line in proc.lines
            if (match := re.search(r"listening on 127\.0\.0\.1:(\d+) \((\w+)\)$", line))
            for port, kind in [match.groups()]
        }
        assert set(ports) == {"submission", "submissions"}
        context = tls_files.client_context()
        with smtplib.SMTP_SSL(
            "127.0.0.1", ports["submissions"], "client.test", context=context, timeout=10
        ) as client:
            client.login("alice", PASSWORD)
            client.sendmail("alice@example.org", ["bob@anywhere.example"], RAW)
        with smtplib.SMTP("127.0.0.1", ports["submission"], "client.test", timeout=10) as client:
            client.starttls(context=context)
            client.ehlo()
            assert client.has_extn("auth")
        proc.stop()
        assert proc.popen.returncode == 0, proc.lines
    finally:
        proc.kill()
    assert Message.objects.get().auth_account == "alice"
