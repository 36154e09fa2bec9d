"""Inbound limits: connections, session time, junk commands, DATA rate, a database restart.

Real sockets on loopback against the in-process ingress (tests/support/
ingress.py), or a `manage.py runsmtp` process where the file limit of the
process is what is tested. To be an untrusted client from 127.0.0.1, the
relay networks are set to a network the test does not come from.
"""

from __future__ import annotations

import ipaddress
import re
import resource
import socket
import sys
import threading
import time

import pytest
from django.db import OperationalError, connection

from delivery.smtpd import config, policy, server
from delivery.smtpd import session as smtpd_session
from queues import accept, database
from queues.accept import (
    IncomingEnvelope,
    IncomingRecipient,
    message_accept,
    prepared_accept,
)
from queues.models import Message
from tests.support import processes
from tests.support.ingress import Ingress, RawClient

pytestmark = pytest.mark.django_db(transaction=True)

ELSEWHERE = (ipaddress.ip_network("192.0.2.0/24"),)  # 127.0.0.1 is not trusted
MESSAGE = b"From: a@example.org\r\nSubject: limits\r\n\r\nbody\r\n"


def untrusted(start_ingress, **overrides: object) -> Ingress:
    return start_ingress(
        relay_networks=ELSEWHERE, accepted_domains=frozenset({"example.net"}), **overrides
    )


def send_message(client: RawClient, data: bytes = MESSAGE) -> tuple[int, list[str]]:
    client.send(b"MAIL FROM:<a@example.org>\r\nRCPT TO:<b@example.net>\r\nDATA\r\n")
    assert [client.reply()[0] for _ in range(3)] == [250, 250, 354]
    client.send(data + b".\r\n")
    return client.reply()


# ----------------------------------------------------------------- connection limits


def test_a_client_past_its_connection_limit_gets_421_and_others_are_served(start_ingress):
    ingress = untrusted(start_ingress, max_connections_per_client=3)
    clients = [ingress.raw() for _ in range(3)]
    try:
        assert all(client.greeting[0] == 220 for client in clients)
        extra = RawClient(ingress.host, ingress.port)
        assert extra.greeting[0] == 421
        assert extra.greeting[1][0].startswith("4.7.0 ")
        assert extra.closed_by_server()
        extra.close()
        # One session ends (the server closes it after 221): a new one is served.
        assert clients[0].command("QUIT")[0] == 221
        assert clients[0].closed_by_server()
        with ingress.raw() as again:
            assert again.greeting[0] == 220
            assert again.command("EHLO client.test")[0] == 250
        assert clients[1].command("NOOP")[0] == 250  # the others were never touched
    finally:
        for client in clients:
            client.close()


def test_clients_in_relay_networks_are_not_limited_per_client(start_ingress):
    ingress = start_ingress(max_connections_per_client=2)  # 127.0.0.0/8 is trusted
    clients = [ingress.raw() for _ in range(5)]
    try:
        assert [client.greeting[0] for client in clients] == [220] * 5
    finally:
        for client in clients:
            client.close()


def test_past_the_total_connection_limit_everyone_gets_421(start_ingress):
    ingress = start_ingress(max_connections=2)
    clients = [ingress.raw() for _ in range(2)]
    try:
        with RawClient(ingress.host, ingress.port) as extra:
            assert extra.greeting == (421, ["4.7.0 Too many connections, try again later"])
            assert extra.closed_by_server()
        assert clients[0].command("NOOP")[0] == 250
    finally:
        for client in clients:
            client.close()


def test_ipv6_clients_are_counted_per_64():
    key = policy.client_key
    assert key(ipaddress.ip_address("2001:db8:1:2::1")) == key(
        ipaddress.ip_address("2001:db8:1:2:ffff::9")
    )
    assert key(ipaddress.ip_address("2001:db8:1:3::1")) != key(
        ipaddress.ip_address("2001:db8:1:2::1")
    )
    assert key(ipaddress.ip_address("::ffff:192.0.2.7")) == "192.0.2.7"
    assert key(ipaddress.ip_address("192.0.2.7")) == "192.0.2.7"


def test_the_soft_file_limit_is_raised_towards_the_hard_limit():
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    new_soft, needed = config.raise_file_limit(soft)  # needs more than the soft limit
    assert needed == soft + config.FILE_LIMIT_SPARE
    expected = needed if hard == resource.RLIM_INFINITY else min(needed, hard)
    assert new_soft == expected == resource.getrlimit(resource.RLIMIT_NOFILE)[0]


def test_running_out_of_file_descriptors_only_pauses_accepting(transactional_db):
    """EMFILE on accept: asyncio stops accepting for a second, then resumes by itself."""
    limit = 64  # soft and hard: the command cannot raise it
    launcher = (
        "import os, resource, sys;"
        f"resource.setrlimit(resource.RLIMIT_NOFILE, ({limit}, {limit}));"
        "os.execv(sys.executable, [sys.executable, 'manage.py', 'runsmtp', '--db-threads', '1',"
        " '--processes', '1'])"  # one process: the limit is that process's
    )
    proc = processes.Proc(
        "runsmtp",
        [sys.executable, "-c", launcher],
        processes.test_env(MAILRELAY_SMTP_LISTEN="127.0.0.1:0", MAILRELAY_BP_ENABLED="false"),
    )
    clients: list[socket.socket] = []
    try:
        proc.wait_for("smtp: listening on 127.0.0.1:")
        assert any("below the" in line for line in proc.lines), proc.lines
        port = int(
            next(m[1] for line in proc.lines if (m := re.search(r"127\.0\.0\.1:(\d+)$", line)))
        )
        with RawClient("127.0.0.1", port) as first:  # a session open before the flood
            assert first.command("EHLO client.test")[0] == 250
            # Its database connection (and the broker's) are opened before the flood.
            assert send_message(first)[0] == 250
            for _ in range(limit + 20):  # more than the process can hold
                clients.append(socket.create_connection(("127.0.0.1", port), timeout=10))
            proc.wait_for("Too many open files")
            # The open session goes on, and mail is accepted meanwhile.
            assert send_message(first)[0] == 250
            for sock in clients:
                sock.close()
            clients.clear()
        with RawClient("127.0.0.1", port, timeout=15) as late:  # served once fds are free
            assert late.greeting[0] == 220
            assert late.command("EHLO client.test")[0] == 250
            assert send_message(late)[0] == 250
        assert proc.popen.poll() is None
    finally:
        for sock in clients:
            sock.close()
        proc.stop()
        proc.kill()


# ----------------------------------------------------------------- session bounds


def test_a_session_past_its_time_limit_gets_421(start_ingress):
    ingress = start_ingress(max_session_time=0.5)
    with ingress.raw() as client:
        started = time.monotonic()
        assert client.command("EHLO client.test")[0] == 250
        assert client.reply_line().startswith("421 4.4.2 ")
        assert time.monotonic() - started < 3
        assert client.closed_by_server()


def test_the_session_limit_waits_for_the_reply_to_a_message_being_committed(
    start_ingress, monkeypatch
):
    committing, expired = threading.Event(), threading.Event()

    def slow_accept(prepared):
        committing.set()
        assert expired.wait(10)  # the session time runs out during the commit
        return prepared_accept(prepared)

    def session_expired(session) -> None:
        original(session)
        expired.set()

    original = smtpd_session.InboundSMTP._session_expired
    monkeypatch.setattr(server, "prepared_accept", slow_accept)  # the commit
    monkeypatch.setattr(smtpd_session.InboundSMTP, "_session_expired", session_expired)
    ingress = start_ingress(max_session_time=1.0)
    with ingress.raw() as client:
        client.command("EHLO client.test")
        code, lines = send_message(client)
        assert code == 250 and "queued as" in lines[0]
        assert client.reply_line().startswith("421 4.4.2 ")
        assert client.closed_by_server()
    assert committing.is_set()
    assert Message.objects.filter(qid=lines[0].rsplit(" ", 1)[1]).count() == 1


@pytest.mark.parametrize("command", ["NOOP", "RSET", "VRFY <x@example.net>", "HELP", "EHLO a.test"])
def test_junk_commands_past_the_limit_get_421(start_ingress, command):
    ingress = start_ingress(junk_command_limit=5)
    with ingress.raw() as client:
        client.command("EHLO client.test")  # counts: one of the five
        for _ in range(4):
            assert client.command(command)[0] in (214, 250, 252)
        code, lines = client.command(command)
        assert (code, lines[0][:6]) == (421, "4.7.0 ")
        assert client.closed_by_server()


@pytest.mark.parametrize(
    "command",
    [
        "MAIL FROM:<no-at-sign>",
        "MAIL FROM <a@example.org>",
        "MAIL FROM:<a@example.org> BOGUS=1",
        "RCPT TO:<not an address>",
        "RCPT <b@example.net>",
    ],
)
def test_bad_mail_and_rcpt_commands_count_toward_the_limit(start_ingress, command):
    ingress = untrusted(start_ingress, junk_command_limit=5)
    with ingress.raw() as client:
        client.command("EHLO client.test")  # counts: one of the five
        if command.startswith("RCPT"):
            assert client.command("MAIL FROM:<a@example.org>")[0] == 250
        for _ in range(4):
            code, lines = client.command(command)
            assert code in (501, 553, 555) and lines[0][:2] == "5."
        code, lines = client.command(command)
        assert (code, lines[0][:6]) == (421, "4.7.0 ")
        assert client.closed_by_server()


def test_an_accepted_message_restores_the_junk_command_budget(start_ingress):
    ingress = start_ingress(junk_command_limit=3)
    with ingress.raw() as client:
        client.command("EHLO client.test")
        assert [client.command("NOOP")[0] for _ in range(2)] == [250, 250]
        assert send_message(client)[0] == 250
        assert [client.command("NOOP")[0] for _ in range(3)] == [250, 250, 250]
        assert client.command("NOOP")[0] == 421


def test_a_client_sending_data_below_the_minimum_rate_is_cut_off(start_ingress):
    # 1 s to start with; each 50 bytes buy 0.05 s, and arrive every 0.25 s (200 B/s).
    ingress = start_ingress(timeout=1.0, min_data_rate=1000)
    with ingress.raw() as client:
        client.command("EHLO client.test")
        client.send(b"MAIL FROM:<a@example.org>\r\nRCPT TO:<b@example.net>\r\nDATA\r\n")
        assert [client.reply()[0] for _ in range(3)] == [250, 250, 354]
        started = time.monotonic()
        client.send(b"Subject: slow\r\n\r\n")
        with pytest.raises(OSError):  # the server closes while the client still sends
            for _ in range(40):  # 10 s at most
                client.send(b"x" * 48 + b"\r\n")
                time.sleep(0.25)  # the slow client under test, not a wait for an event
        elapsed = time.monotonic() - started
        assert client.reply_line().startswith("421 4.4.2 ")
    assert 1.0 <= elapsed < 3.0, elapsed
    assert not Message.objects.filter(subject="slow").exists()


def test_a_client_above_the_minimum_rate_may_take_longer_than_the_idle_timeout(start_ingress):
    ingress = start_ingress(timeout=0.5, min_data_rate=1000)  # 4000 B/s for 1.5 s
    with ingress.raw() as client:
        client.command("EHLO client.test")
        client.send(b"MAIL FROM:<a@example.org>\r\nRCPT TO:<b@example.net>\r\nDATA\r\n")
        assert [client.reply()[0] for _ in range(3)] == [250, 250, 354]
        client.send(b"Subject: steady\r\n\r\n")
        for _ in range(6):
            client.send(b"y" * 998 + b"\r\n")
            time.sleep(0.25)
        client.send(b".\r\n")
        assert client.reply()[0] == 250
    assert Message.objects.filter(subject="steady").count() == 1


# ----------------------------------------------------------------- the database coming back


def kill_other_backends() -> int:
    """pg_terminate_backend() every other session of this test database."""
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT count(pg_terminate_backend(pid, 5000)) FROM pg_stat_activity "
            "WHERE datname = current_database() AND pid <> pg_backend_pid()"
        )
        return cursor.fetchone()[0]


def test_after_a_database_restart_the_next_message_is_accepted_once(start_ingress):
    ingress = start_ingress(db_threads=1)  # every message on the same database thread
    assert ingress.send(b"Subject: before\r\n\r\nx\r\n")[0] == 250
    assert kill_other_backends() >= 1  # the ingress thread's connection is dead now
    code, text = ingress.send(b"Subject: after restart\r\n\r\nx\r\n")
    assert code == 250, text
    assert Message.objects.filter(subject="after restart").count() == 1
    assert ingress.send(b"Subject: then\r\n\r\nx\r\n")[0] == 250


def test_a_commit_whose_reply_was_lost_is_not_stored_twice(monkeypatch):
    inserts: list[str] = []
    original = database.insert_with_children

    def commit_then_lose_the_connection(parent, children, fk, **kwargs):
        original(parent, children, fk, **kwargs)
        inserts.append(parent.qid)
        if len(inserts) == 1:
            raise OperationalError("server closed the connection unexpectedly")

    monkeypatch.setattr(accept, "insert_with_children", commit_then_lose_the_connection)
    envelope = IncomingEnvelope("a@example.org", [IncomingRecipient("b@example.net")])
    message = message_accept(envelope, b"Subject: once\r\n\r\nx\r\n")
    assert len(inserts) == 1  # the retry found the committed row
    assert Message.objects.filter(subject="once").count() == 1
    assert message.qid == inserts[0]


def test_a_database_still_down_gets_451(start_ingress, monkeypatch):
    def down(*args, **kwargs):
        raise OperationalError("connection refused")

    monkeypatch.setattr(accept, "insert_with_children", down)  # the retry fails too
    ingress = start_ingress()
    code, text = ingress.send(MESSAGE)
    assert code == 451, text
