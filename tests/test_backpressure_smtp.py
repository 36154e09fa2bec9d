"""Back pressure on the wire: the real SMTP server with its monitor ticking every
50 ms. Clients on 127.0.0.1 are trusted (MAILRELAY_RELAY_NETWORKS); clients
bound to 127.0.0.5 are not, and send to our accepted domain relay.test. The
workers are stopped: nothing leaves the submission queue until a test drains
it in-process."""

from __future__ import annotations

import ipaddress
import smtplib
import socket
import threading
import time
from datetime import timedelta

import pytest

from delivery.backpressure.config import BackPressureConfig
from delivery.backpressure.engine import Action, GiB, Level, Resource
from delivery.backpressure.monitor import Monitor
from delivery.backpressure.samplers import ManualSampler
from delivery.smtpd import server as inbound_server
from delivery.smtpd.config import InboundConfig
from delivery.smtpd.server import InboundServer
from queues.models import Event, EventLevel, Message, MessageState
from tests.support.ingress import Ingress, RawClient
from tests.support.pipeline import drain

pytestmark = pytest.mark.django_db(transaction=True)

UNTRUSTED = "127.0.0.5"
OURS = "relay.test"
RAW = b"From: a@example.org\r\nSubject: back pressure\r\n\r\nbody\r\n"
SQ = Resource.SUBMISSION_QUEUE
TARPIT_START = 0.3


def quiet() -> dict[Resource, ManualSampler]:
    """Disks, memory and the broker read by hand as normal, so the machine the
    tests run on cannot change their outcome."""
    return {
        Resource.DATABASE_DISK_SPACE: ManualSampler(50, 100 * GiB),
        Resource.LOG_DISK_SPACE: ManualSampler(50, 100 * GiB),
        Resource.BATCH_POINTS: ManualSampler(0),
        Resource.PRIVATE_BYTES: ManualSampler(1, 8 * GiB),
        Resource.PHYSICAL_MEMORY: ManualSampler(10, 8 * GiB),
    }


@pytest.fixture
def bp_settings(settings):
    settings.MAILRELAY_RELAY_NETWORKS = [ipaddress.ip_network("127.0.0.1/32")]
    settings.MAILRELAY_ACCEPTED_DOMAINS = [OURS]
    settings.MAILRELAY_NODE_NAME = "mx-test"
    settings.MAILRELAY_BP_MONITORING_INTERVAL = timedelta(milliseconds=50)
    settings.MAILRELAY_BP_TARPIT_START = timedelta(seconds=TARPIT_START)
    settings.MAILRELAY_BP_TARPIT_STEP = timedelta(milliseconds=50)
    settings.MAILRELAY_BP_TARPIT_MAX = timedelta(milliseconds=500)
    settings.MAILRELAY_BP_SUBMISSION_QUEUE_NORMAL = 3
    settings.MAILRELAY_BP_SUBMISSION_QUEUE_MEDIUM = 6
    settings.MAILRELAY_BP_SUBMISSION_QUEUE_HIGH = 12
    settings.MAILRELAY_BP_SUBMISSION_QUEUE_HISTORY_DEPTH = 20  # 1 s
    return settings


@pytest.fixture
def start_bp_ingress(bp_settings, transactional_db):
    """The ingress with a monitor: the submission queue and version buckets are
    measured for real, the rest by the ``samplers`` given (default: quiet())."""
    started: list[Ingress] = []

    def start(samplers=None) -> tuple[Ingress, Monitor]:
        config = InboundConfig.from_settings()
        monitor = Monitor(BackPressureConfig.from_settings(), quiet() | (samplers or {}))
        ingress = Ingress(config)
        ingress.server = InboundServer(config, db_threads=4, monitor=monitor)
        started.append(ingress)
        ingress.start()
        return ingress, monitor

    yield start
    for ingress in started:
        ingress.stop()


def untrusted(ingress: Ingress) -> smtplib.SMTP:
    client = smtplib.SMTP(
        ingress.host,
        ingress.port,
        local_hostname="outside.test",
        timeout=10,
        source_address=(UNTRUSTED, 0),
    )
    assert client.ehlo()[0] == 250
    return client


def timed_mail(client: smtplib.SMTP, sender: str = "a@example.org") -> tuple[int, str, float]:
    started = time.monotonic()
    code, text = client.mail(sender)
    return code, text.decode(), time.monotonic() - started


def finish(client: smtplib.SMTP, rcpt: str = f"x@{OURS}") -> int:
    assert client.rcpt(rcpt)[0] == 250
    code, _ = client.data(RAW)
    client.quit()
    return code


def send_trusted(ingress: Ingress, count: int = 1) -> None:
    for i in range(count):
        code, _ = ingress.send(RAW, rcpt_to=[f"t{i}@{OURS}"])
        assert code == 250


def level_is(level: Level):
    return lambda snapshot: snapshot.level(SQ) is level


def test_a_full_submission_queue_tarpits_then_refuses_untrusted_clients_then_everyone(
    start_bp_ingress, sink_factory, smtp_port, settings
):
    ingress, monitor = start_bp_ingress()

    # Past medium: an untrusted client's MAIL FROM waits, then gets through.
    send_trusted(ingress, 6)
    monitor.wait_for(level_is(Level.MEDIUM))
    client = untrusted(ingress)
    code, _, waited = timed_mail(client)
    assert code == 250 and waited >= TARPIT_START
    assert finish(client) == 250
    # A trusted client is not held back.
    started = time.monotonic()
    send_trusted(ingress)
    assert time.monotonic() - started < TARPIT_START

    # Not back to normal within the history depth: untrusted clients are refused.
    monitor.wait_for(lambda s: s.status(SQ).action is Action.REFUSE_UNTRUSTED)
    client = untrusted(ingress)
    code, text, waited = timed_mail(client)
    assert code == 452 and text.startswith("4.3.1 Insufficient system resources")
    assert waited < TARPIT_START  # refused at once, not after a tarpit
    assert client.noop()[0] == 250 and client.quit()[0] == 221
    send_trusted(ingress)  # the trusted client still sends

    # Past high: everyone is refused, but connections, EHLO and QUIT still work.
    send_trusted(ingress, 12 - Message.objects.filter(state=MessageState.SUBMISSION).count())
    monitor.wait_for(level_is(Level.HIGH))
    with smtplib.SMTP(ingress.host, ingress.port, timeout=10) as trusted:
        assert trusted.ehlo("inside.test")[0] == 250
        code, text = trusted.mail("a@example.org")
        assert (code, text.decode()[:5]) == (452, "4.3.1")
    client = untrusted(ingress)
    assert client.mail("a@example.org")[0] == 452
    assert client.quit()[0] == 221

    # The workers drain the queue: the level falls and mail is accepted again.
    settings.MAILRELAY_SMART_HOST = f"[127.0.0.2]:{smtp_port}"
    sink = sink_factory("127.0.0.2")
    drain()
    assert len(sink.messages) == Message.objects.count() == 12
    monitor.wait_for(lambda s: s.level(SQ) is Level.NORMAL and s.untrusted.delay_seconds == 0)
    client = untrusted(ingress)
    code, _, waited = timed_mail(client)
    assert code == 250 and waited < TARPIT_START
    assert finish(client) == 250

    events = Event.objects.filter(kind="backpressure").order_by("id")
    changes = [(e.level, e.data.get("old"), e.data.get("new")) for e in events]
    assert changes[:3] == [
        (EventLevel.ERROR, "normal", "medium"),
        (EventLevel.WARNING, None, None),  # the history depth ran out
        (EventLevel.ERROR, "medium", "high"),
    ]
    assert changes[-1] == (EventLevel.INFO, changes[-1][1], "normal")
    assert all(level == EventLevel.INFO for level, _, _ in changes[3:])
    assert all(e.data["node"] == "mx-test" and e.data["resource"] == SQ for e in events)
    assert monitor.counters["tarpitted"] == 1
    assert monitor.counters["refused_untrusted"] == 2
    assert monitor.counters["refused_trusted"] == 1


class UntrustedRaw(RawClient):
    """RawClient from the untrusted source address."""

    def __init__(self, host: str, port: int) -> None:
        self.sock = socket.create_connection(
            (host, port), timeout=10, source_address=(UNTRUSTED, 0)
        )
        self._buffer = b""
        self.greeting = self.reply()


def test_a_tarpit_holds_only_its_own_session(start_bp_ingress, bp_settings):
    bp_settings.MAILRELAY_BP_TARPIT_START = timedelta(seconds=1)
    bp_settings.MAILRELAY_BP_TARPIT_MAX = timedelta(seconds=1)
    queue = ManualSampler(8)  # medium, for far longer than the test
    bp_settings.MAILRELAY_BP_SUBMISSION_QUEUE_HISTORY_DEPTH = 10000
    ingress, monitor = start_bp_ingress({SQ: queue})
    assert monitor.snapshot.untrusted.delay_seconds == 1

    with UntrustedRaw(ingress.host, ingress.port) as slow:
        assert slow.command("EHLO outside.test")[0] == 250
        started = time.monotonic()
        slow.send(b"MAIL FROM:<a@example.org>\r\n")
        send_trusted(ingress)  # a whole message while the other session waits
        trusted_done = time.monotonic() - started
        assert monitor.counters["tarpitted"] == 1  # the tarpit had begun meanwhile
        assert slow.reply_line() == "250 2.1.0 Ok"
        untrusted_done = time.monotonic() - started
    assert trusted_done < 0.5 <= 1.0 <= untrusted_done


def test_stopping_the_server_ends_a_tarpit_with_421_at_once(start_bp_ingress, bp_settings):
    bp_settings.MAILRELAY_BP_TARPIT_START = timedelta(seconds=30)
    bp_settings.MAILRELAY_BP_TARPIT_MAX = timedelta(seconds=30)
    bp_settings.MAILRELAY_BP_SUBMISSION_QUEUE_HISTORY_DEPTH = 10000
    ingress, monitor = start_bp_ingress({SQ: ManualSampler(8)})
    with UntrustedRaw(ingress.host, ingress.port) as slow:
        slow.command("EHLO outside.test")
        slow.send(b"MAIL FROM:<a@example.org>\r\n")
        started = time.monotonic()
        ingress.stop()  # grace 5 s: a session still sleeping would be aborted, not told 421
        assert slow.reply_line().startswith("421 4.3.2")
    assert time.monotonic() - started < 5
    assert monitor.counters["tarpitted"] == 1


def test_the_ingress_counts_messages_received_and_not_yet_committed(start_bp_ingress, monkeypatch):
    release = threading.Event()
    real_store = inbound_server._store

    def slow_store(envelope, data):
        release.wait(10)
        return real_store(envelope, data)

    monkeypatch.setattr(inbound_server, "_store", slow_store)
    ingress, monitor = start_bp_ingress()
    sender = threading.Thread(target=send_trusted, args=(ingress, 1))
    sender.start()
    try:
        monitor.wait_for(lambda s: s.status(Resource.VERSION_BUCKETS).reading == 1)
    finally:
        release.set()
        sender.join(10)
    monitor.wait_for(lambda s: s.status(Resource.VERSION_BUCKETS).reading == 0)
    assert ingress.server.uncommitted.value == 0
