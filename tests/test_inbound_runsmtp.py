"""`manage.py runsmtp` as a process, and the pieces of the server that need no client."""

from __future__ import annotations

import asyncio
import re
import smtplib
import socket
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from delivery.smtpd.config import format_address, parse_listen
from delivery.smtpd.server import CoalescedBell
from queues.models import Message
from tests.support import processes


def ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6) as sock:
            sock.bind(("::1", 0))
        return True
    except OSError:
        return False


@pytest.mark.django_db(transaction=True)
def test_runsmtp_listens_where_configured_and_stops_cleanly_on_sigterm():
    listen = "127.0.0.1:0,[::1]:0" if ipv6_loopback() else "127.0.0.1:0"
    proc = processes.Proc(
        "runsmtp",
        [sys.executable, "manage.py", "runsmtp"],
        processes.test_env(MAILRELAY_SMTP_LISTEN=listen, MAILRELAY_HOSTNAME="relay.test"),
    )
    try:
        proc.wait_for("smtp: listening on 127.0.0.1:")
        if "::1" in listen:
            proc.wait_for("smtp: listening on [::1]:")
        ports = {
            host: int(port)
            for line in proc.lines
            if (match := re.search(r"listening on \[?([\d.:]+?)\]?:(\d+)$", line))
            for host, port in [match.groups()]
        }
        with smtplib.SMTP("127.0.0.1", ports["127.0.0.1"], timeout=10) as client:
            client.ehlo("client.test")
            client.mail("a@example.org")
            client.rcpt("b@example.net")
            code, text = client.data(b"Subject: via runsmtp\r\n\r\nbody\r\n")
        assert code == 250
        assert Message.objects.filter(qid=text.decode().rsplit(" ", 1)[1]).exists()
        if "::1" in listen:
            with smtplib.SMTP("::1", ports["::1"], timeout=10) as client:
                assert client.noop()[0] == 250

        idle = smtplib.SMTP("127.0.0.1", ports["127.0.0.1"], timeout=10)
        idle.ehlo("client.test")
        proc.stop()  # SIGTERM
        assert proc.popen.returncode == 0, proc.lines
        assert idle.getreply()[0] == 421
        idle.close()
        proc.wait_for("smtp: stopped")
    finally:
        proc.kill()


@pytest.mark.parametrize(
    ("text", "address"),
    [
        ("127.0.0.1:2525", ("127.0.0.1", 2525)),
        ("[::1]:25", ("::1", 25)),
        ("0.0.0.0:25", ("0.0.0.0", 25)),
        ("*:25", ("", 25)),
        ("mx.example.com:2525", ("mx.example.com", 2525)),
    ],
)
def test_it_reads_listen_addresses(text, address):
    assert parse_listen(text) == address


@pytest.mark.parametrize("text", ["127.0.0.1", "::1:25", "[::1]25", "host:port", "h:70000"])
def test_it_refuses_bad_listen_addresses(text):
    with pytest.raises(ValueError):
        parse_listen(text)


def test_it_prints_ipv6_listen_addresses_in_brackets():
    assert format_address("::1", 2525) == "[::1]:2525"
    assert format_address("127.0.0.1", 2525) == "127.0.0.1:2525"


def test_the_doorbell_coalesces_rings_and_rings_again_after_one_in_flight():
    interval = 0.05

    async def scenario() -> list[float]:
        loop = asyncio.get_running_loop()
        started: list[float] = []
        ringing = asyncio.Event()
        release = threading.Event()

        def ring() -> None:
            started.append(time.monotonic())
            loop.call_soon_threadsafe(ringing.set)
            release.wait(5)

        with ThreadPoolExecutor(2) as executor:
            doorbell = CoalescedBell(loop, executor, interval=interval, ring=ring)
            for _ in range(100):  # a burst of commits: one ring
                doorbell.request()
            await ringing.wait()
            ringing.clear()
            doorbell.request()  # commits while that ring is in flight: one more ring,
            doorbell.request()  # after it, not before the interval has passed
            release.set()
            await ringing.wait()
            await doorbell.flush()
        return started

    started = asyncio.run(scenario())
    assert len(started) == 2
    assert started[1] - started[0] >= interval * 0.8
