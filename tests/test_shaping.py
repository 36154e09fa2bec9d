"""Traffic shaping per destination (delivery.shaping), driven in-process.

Real PostgreSQL and Redis (the test broker's database), a real DNS server
and real SMTP sinks on loopback; the engine's functions are driven directly
with the movable clock, which the shared counters follow too. The same
limits across real worker processes: tests/test_shaping_processes.py.
"""

from __future__ import annotations

import io
import os
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path

import pytest
from django.core.management import call_command

from delivery.shaping import gate, limiter
from delivery.shaping.adaptive import describe, is_throttle
from delivery.shaping.policy import PolicyError, Rate, parse, parse_rate
from queues.accept import IncomingEnvelope, IncomingRecipient, message_accept
from queues.lib import clock
from queues.models import Attempt, Link, Recipient, RecipientState
from tests.support import sinks
from tests.support.pipeline import drain

pytestmark = pytest.mark.django_db

BODY = b"From: a@example.org\r\nTo: x\r\nSubject: shaped\r\n\r\nline\r\n"
PROVIDER = """
entries:
  - name: provider
    mx: "*.provider.test"
    max_connections: 2
    max_messages_per_connection: 3
    max_message_rate: 10/min
    on_throttle: {cooldown: 30s}
  - name: bound
    domain: bound.test
    source_address: 127.0.0.3
    helo_name: out3.shaped.test
"""


def accept(*rcpts: str) -> None:
    env = IncomingEnvelope(
        mail_from="a@example.org",
        recipients=[IncomingRecipient(r) for r in rcpts],
        client_address="127.0.0.1",
        client_helo="client.test",
    )
    message_accept(env, BODY)


@dataclass
class Shaping:
    path: Path
    wakes: list[tuple[int, float]] = field(default_factory=list)
    _stamp: int = 1_700_000_000_000_000_000

    def write(self, text: str) -> None:
        self.path.write_text(text)
        # A distinct modification time for every write, however fast they come.
        self._stamp += 1_000_000_000
        os.utime(self.path, ns=(self._stamp, self._stamp))


@pytest.fixture
def shaping(settings, tmp_path, broker, monkeypatch) -> Iterator[Shaping]:
    """A MAILRELAY_SHAPING file (empty counters); wake-ups recorded, not sent."""
    state = Shaping(tmp_path / "shaping.yaml")
    state.write(PROVIDER)
    settings.MAILRELAY_SHAPING = str(state.path)
    gate.reset()
    monkeypatch.setattr(gate, "ring_later", lambda link_id, s: state.wakes.append((link_id, s)))
    gate._domains.clear()
    yield state
    gate.reset()


@dataclass
class PeerLog:
    """Every sink connection: (sink host, peer address), and how many were open at once."""

    peers: list[tuple[str, str]] = field(default_factory=list)
    helos: list[str] = field(default_factory=list)
    open: int = 0
    peak: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)


@pytest.fixture
def peer_log(monkeypatch) -> PeerLog:
    log = PeerLog()
    made, lost = sinks._SinkSMTP.connection_made, sinks._SinkSMTP.connection_lost
    ehlo = sinks._SinkHandler.handle_EHLO

    def connection_made(self, transport):
        first = self.transport is None
        made(self, transport)
        if first and self.counted:
            with log.lock:
                log.peers.append((self.sink.host, transport.get_extra_info("peername")[0]))
                log.open += 1
                log.peak = max(log.peak, log.open)

    def connection_lost(self, error):
        if self.counted and self.conn_id:
            with log.lock:
                log.open -= 1
        lost(self, error)

    async def handle_EHLO(self, server, session, envelope, hostname, responses):
        log.helos.append(hostname)
        return await ehlo(self, server, session, envelope, hostname, responses)

    monkeypatch.setattr(sinks._SinkSMTP, "connection_made", connection_made)
    monkeypatch.setattr(sinks._SinkSMTP, "connection_lost", connection_lost)
    monkeypatch.setattr(sinks._SinkHandler, "handle_EHLO", handle_EHLO)
    return log


@pytest.fixture
def relay(dns_settings, settings, smtp_port):
    """Two domains at one provider (two links: two MX names), one elsewhere."""
    settings.MAILRELAY_REMOTE_SMTP_PORT = smtp_port
    settings.MAILRELAY_SMTP_CONNECT_TIMEOUT = timedelta(seconds=2)
    settings.MAILRELAY_SMTP_CLIENT_TIMEOUT = timedelta(seconds=5)
    dns_settings.mx("a.shaped.test", [(10, "mx-a.provider.test")])
    dns_settings.mx("b.shaped.test", [(10, "mx-b.provider.test")])
    dns_settings.mx("bound.test", [(10, "mx.bound.test")])
    dns_settings.mx("other.test", [(10, "mx.other.test")])
    for host in ("mx-a.provider.test", "mx-b.provider.test", "mx.bound.test", "mx.other.test"):
        dns_settings.a(host, "127.0.0.2")
    return dns_settings


# --- the policy file --------------------------------------------------------------


def test_it_parses_yaml_and_toml_alike_and_the_first_match_wins():
    toml = """
[default]
max_connections = 4

[[entries]]
name = "google"
mx = ["*.google.com", ".googlemail.com"]
max_message_rate = "600/h"
max_connection_rate = "10/min"
connect_timeout = "20s"
source_address = ["192.0.2.10", "2001:db8::10"]
helo_name = "out1.example.com"
[entries.on_throttle]
factor = 0.25
cooldown = "5m"
texts = ["Try Again Later"]

[[entries]]
name = "example"
domain = ["example.com", ".example.com"]

[[entries]]
name = "partner"
next_hop = "[10.0.0.5]:2525"
"""
    p = parse(toml, "toml")
    yaml_p = parse(
        """
default: {max_connections: 4}
entries:
  - name: google
    mx: ["*.google.com", ".googlemail.com"]
    max_message_rate: 600/h
    max_connection_rate: 10/min
    connect_timeout: 20s
    source_address: [192.0.2.10, "2001:db8::10"]
    helo_name: out1.example.com
    on_throttle: {factor: 0.25, cooldown: 5m, texts: [Try Again Later]}
  - {name: example, domain: [example.com, .example.com]}
  - {name: partner, next_hop: "[10.0.0.5]:2525"}
""",
        "yaml",
    )
    assert p == yaml_p
    google = p.entries[0]
    assert google.max_message_rate == Rate(600, 3600.0)
    assert google.max_connection_rate == Rate(10, 60.0)
    assert google.max_connections == 4  # from the default entry
    assert google.connect_timeout == 20.0
    assert google.source_address == ("192.0.2.10", "2001:db8::10")
    assert google.on_throttle.factor == 0.25 and google.on_throttle.cooldown == 300.0
    assert google.on_throttle.texts == ("try again later",)
    assert p.match(mx_hosts=["alt1.aspmx.l.google.com"]).name == "google"
    assert p.match(mx_hosts=["google.com.evil.test"]).name == "default"
    assert p.match(domains=["example.com"]).name == "example"
    assert p.match(domains=["mail.example.com"]).name == "example"
    assert p.match(domains=["notexample.com"]).name == "default"
    assert p.match(hops=["[10.0.0.5]:2525"]).name == "partner"
    # first match wins: a google-hosted example.com domain is "google"
    assert p.match(domains=["example.com"], mx_hosts=["aspmx.l.google.com"]).name == "google"
    assert parse_rate("100/10m") == Rate(100, 600.0)


@pytest.mark.parametrize(
    ("text", "line", "reason"),
    [
        ("entries:\n  - name: a\n    mx: x.test\n    max_message_rate: 10/fortnight\n", 4, "rate"),
        ("default:\n  max_connections: 0\n", 2, "at least 1"),
        ("entries:\n  - name: a\n    mx: x.test\n    colour: red\n", 4, "unknown key"),
        ("entries:\n  - name: a\n    max_connections: 2\n", 2, "matches nothing"),
        ("entries:\n  - name: a\n    mx: x.test\n  - name: a\n    mx: y.test\n", 4, "twice"),
        ("entries:\n  - name: a\n    mx: x.test\n    source_address: 300.1.1.1\n", 4, "IPv4"),
        ("entries:\n  - name: a\n    mx: x.test\n    on_throttle: {factor: 2}\n", 4, "between"),
        ("entries: [\n", 2, "YAML"),
    ],
)
def test_a_bad_file_is_refused_with_its_line_and_reason(text, line, reason):
    with pytest.raises(PolicyError) as caught:
        parse(text)
    assert caught.value.line == line
    assert reason in caught.value.reason


def test_a_bad_toml_file_names_its_line():
    with pytest.raises(PolicyError) as caught:
        parse('[[entries]]\nname = "g"\nmx = "x.test"\n\nmax_connections = -1\n', "toml")
    assert caught.value.line == 5


def test_the_policy_is_reread_on_change_and_a_bad_file_keeps_the_old(shaping, caplog):
    first = gate.current()
    assert [e.name for e in first.entries] == ["provider", "bound"]
    assert gate.current() is first  # unchanged file: not read again
    shaping.write(PROVIDER.replace("10/min", "20/min"))
    second = gate.current()
    assert second.entries[0].max_message_rate == Rate(20, 60.0)
    shaping.write(PROVIDER.replace("10/min", "20 a minute"))
    assert gate.current() is second  # refused: the old one stays
    assert "line 7" in gate.last_error() and "not a rate" in gate.last_error()
    assert any("line 7" in r.getMessage() for r in caplog.records)
    shaping.write(PROVIDER.replace("10/min", "30/min"))
    assert gate.current().entries[0].max_message_rate == Rate(30, 60.0)
    assert gate.last_error() == ""


# --- the shared counters ------------------------------------------------------------


def _acquire(lim, scope, token, now, want=10, conns=2, rate=(10, 60.0), lease=30.0):
    return lim.acquire(
        scope,
        now=now,
        lease=lease,
        token=token,
        max_connections=conns,
        messages_per_connection=5,
        want=want,
        message_rate=rate,
        connection_rate=None,
        waiter=token,
    )


def test_slots_of_a_killed_holder_come_back_when_their_lease_ends(shaping):
    lim = limiter.limiter()
    now = time.time()
    held = _acquire(lim, "entry:t", "dead", now, rate=None)
    assert held.connections == 2
    refused = _acquire(lim, "entry:t", "7", now + 1, rate=None)
    assert refused.connections == 0 and refused.why == "connections"
    assert refused.wait == pytest.approx(29.0)
    # The holder was killed: nobody renews or releases its slots.
    later = _acquire(lim, "entry:t", "8", now + 30.5, rate=None)
    assert later.connections == 2


def test_a_renewed_slot_stays_and_a_release_rings_the_waiters(shaping):
    lim = limiter.limiter()
    now = time.time()
    assert _acquire(lim, "entry:t", "alive", now, rate=None).connections == 2
    lim.renew("entry:t", "alive", 2, now + 60)
    assert _acquire(lim, "entry:t", "41", now + 31, rate=None).connections == 0
    waiters = lim.release(
        "entry:t",
        "alive",
        2,
        now=now + 32,
        throttled="",
        delivered=True,
        step=0.5,
        cooldown=1,
        min_factor=0.1,
    )
    assert waiters == ["41"]
    assert _acquire(lim, "entry:t", "41", now + 32, rate=None).connections == 2


def test_a_message_rate_grants_exactly_the_window_and_says_when(shaping):
    lim = limiter.limiter()
    now = time.time()
    first = _acquire(lim, "entry:r", "r1", now, want=6, conns=10)
    assert (first.connections, first.messages) == (2, 6)  # 5 messages per connection
    second = _acquire(lim, "entry:r", "r2", now + 5, want=10, conns=10)
    assert (second.connections, second.messages) == (1, 4)  # 10/min: 6 + 4
    lim.refund("entry:r", "r2", second, 1, 1)  # the round claimed one message
    third = _acquire(lim, "entry:r", "r3", now + 6, want=10, conns=10)
    assert third.messages == 3
    refused = _acquire(lim, "entry:r", "r4", now + 10, want=10, conns=10)
    assert refused.connections == 0 and refused.why == "message rate"
    assert refused.wait == pytest.approx(50.0)  # when the first six leave the window
    assert refused.ring_later  # the first refusal schedules the wake-up...
    assert not _acquire(lim, "entry:r", "r5", now + 11, conns=10).ring_later  # ...once
    assert _acquire(lim, "entry:r", "r6", now + 60.5, want=10, conns=10).messages == 6


# --- delivery -------------------------------------------------------------------------


def test_connections_and_rate_hold_across_the_links_of_one_entry(
    shaping, relay, sink_factory, peer_log
):
    sink = sink_factory("127.0.0.2", delays={"DATA": 0.05})
    for i in range(8):
        accept(f"u{i}@a.shaped.test")
        accept(f"u{i}@b.shaped.test")
    drain()
    assert len(sink.messages) == 10  # 10/min for the provider, over both domains
    assert peer_log.peak <= 2
    waiting = Recipient.objects.exclude(state=RecipientState.DELIVERED)
    assert waiting.count() == 6
    # Not attempted, not deferred: waiting as they were, nothing counted.
    assert all(r.attempt_count == 0 and r.state == RecipientState.QUEUED for r in waiting)
    assert Attempt.objects.count() == 10
    # One wake-up scheduled for when the window frees (about a minute), not a loop.
    assert len(shaping.wakes) == 1 and 55 < shaping.wakes[0][1] <= 60
    clock.advance(timedelta(seconds=61))
    drain()
    assert len(sink.messages) == 16
    assert peer_log.peak <= 2


def test_a_throttling_reply_halves_the_limits_and_they_recover(shaping, relay, sink_factory):
    shaping.write(PROVIDER.replace("max_connections: 2", "max_connections: 4"))
    sink_factory(
        "127.0.0.2", rcpt_tempfail={"t@a.shaped.test": 1}, tempfail_reply="421 4.7.0 slow down"
    )
    accept("t@a.shaped.test")
    drain()
    entry = gate.current().entries[0]
    lim = limiter.limiter()
    status = lim.status("entry:provider", clock.now().timestamp(), (60.0, 60.0))
    assert status.factor == 0.5
    assert status.reason == "421 4.7.0 slow down"
    text = describe(entry, status)
    assert text.startswith("2 conn, 3 msg/conn, 5/min messages (halved after 421 4.7.0 slow down")
    # Within the cool-down a delivery does not bring the limits back...
    accept("u1@a.shaped.test")
    drain()
    assert Recipient.objects.get(address="u1@a.shaped.test").state == RecipientState.DELIVERED
    assert lim.status("entry:provider", clock.now().timestamp(), (60, 60)).factor == 0.5
    # ...after it, each delivering round takes one step back up.
    clock.advance(timedelta(seconds=31))
    accept("u2@b.shaped.test")
    drain()
    back = lim.status("entry:provider", clock.now().timestamp(), (60, 60))
    assert back.factor == 1.0
    assert describe(entry, back) == "4 conn, 3 msg/conn, 10/min messages"


def test_an_entry_removed_while_its_round_runs_costs_no_delivery_record(
    shaping, relay, sink_factory, monkeypatch
):
    """#22: the operator removes the entry a round was shaped by while it runs
    (the file is read again at once): the round records every delivery and
    gives its slots back; the next round has no entry and sends nothing twice."""
    sink = sink_factory("127.0.0.2")
    observe = gate.ShapedRound.observe
    removed: list[str] = []

    def observe_then_remove(self, batch):  # after the exchange, before the record
        shaping.write("entries: []\n")
        assert gate.current().entries == ()
        removed.append(self.entry.name)
        return observe(self, batch)

    monkeypatch.setattr(gate.ShapedRound, "observe", observe_then_remove)
    accept(*(f"r{i}@a.shaped.test" for i in range(4)))
    accept("s@a.shaped.test")
    drain()
    assert removed == ["provider"]  # one shaped round; the entry went while it ran
    states = set(Recipient.objects.values_list("state", flat=True))
    assert states == {RecipientState.DELIVERED}
    assert len(sink.messages) == 2
    assert Attempt.objects.count() == 5
    lim = limiter.limiter()
    assert lim.status("entry:provider", clock.now().timestamp(), (60.0, 60.0)).connections == 0
    clock.advance(timedelta(minutes=5))
    drain()
    assert len(sink.messages) == 2  # exactly once


def test_the_source_address_and_helo_name_of_an_entry_are_used(
    shaping, relay, sink_factory, peer_log
):
    sink = sink_factory("127.0.0.2")
    accept("u@bound.test")
    accept("u@other.test")
    drain()
    assert len(sink.messages) == 2
    assert sorted(peer for _, peer in peer_log.peers) == ["127.0.0.1", "127.0.0.3"]
    assert "out3.shaped.test" in peer_log.helos


def test_without_a_policy_file_nothing_touches_redis(settings, relay, sink_factory, monkeypatch):
    settings.MAILRELAY_SHAPING = ""
    gate.reset()

    def no_redis():
        raise AssertionError("the default path must not use Redis")

    monkeypatch.setattr(gate, "limiter", no_redis)
    sink = sink_factory("127.0.0.2")
    accept("u@a.shaped.test")
    drain()
    assert len(sink.messages) == 1


def test_redis_away_delivers_with_the_entry_limits_per_link(
    shaping, relay, sink_factory, settings, peer_log
):
    settings.CELERY_BROKER_URL = "redis://127.0.0.1:1/0"  # nothing listens there
    sink = sink_factory("127.0.0.2")
    for i in range(4):
        accept(f"u{i}@a.shaped.test")
    drain()
    assert len(sink.messages) == 4
    assert peer_log.peak <= 2


def test_the_command_shows_the_entry_and_effective_limits(shaping, relay):
    out = io.StringIO()
    call_command("shaping", "test", "a.shaped.test", stdout=out)
    text = out.getvalue()
    assert "entry: provider" in text
    assert "mx-a.provider.test" in text
    assert "effective now: 2 conn, 3 msg/conn, 10/min messages" in text
    out = io.StringIO()
    call_command("shaping", "show", stdout=out)
    assert "provider" in out.getvalue() and "bound" in out.getvalue()


def test_the_queue_api_shows_effective_limits(
    shaping, relay, sink_factory, client, django_user_model
):
    sink_factory("127.0.0.2", rcpt_tempfail={"t@a.shaped.test": 1}, tempfail_reply="421 4.7.0 slow")
    accept("t@a.shaped.test")
    drain()
    link = Link.objects.get(name__startswith="mx-a.provider.test")
    from queues.api.serializers import QueueSerializer

    data = QueueSerializer(link.queues.get()).data
    assert data["effective_limits"].startswith(
        "provider: 1 conn, 3 msg/conn, 5/min messages (halved after 421 4.7.0 slow"
    )


def test_the_queue_list_page_shows_effective_limits(shaping, relay, sink_factory, client):
    from django.contrib.auth import get_user_model
    from django.contrib.auth.models import Group

    sink_factory("127.0.0.2", rcpt_tempfail={"t@a.shaped.test": 1}, tempfail_reply="421 4.7.0 slow")
    accept("t@a.shaped.test")
    drain()
    user = get_user_model().objects.create_user("shaping-viewer")
    user.groups.add(Group.objects.get_or_create(name="viewer")[0])
    client.force_login(user)
    page = client.get("/queues/").content.decode()
    assert "limits: provider: 1 conn, 3 msg/conn, 5/min messages (halved after 421 4.7.0" in page


def test_only_replies_from_a_peer_count_as_throttling():
    assert is_throttle(421, "4.3.2", "busy")
    assert is_throttle(451, "4.7.1", "rate limited")
    assert is_throttle(450, "4.2.1", "Try again later", ["try again later"])
    assert not is_throttle(450, "4.2.1", "mailbox busy")
    assert not is_throttle(None, "4.7.5", "TLS required")  # our own policy, no reply
    assert not is_throttle(550, "5.7.1", "denied")


# --- whose throttling replies count (issue #20, item 6) -----------------------------


def test_an_attackers_mx_does_not_throttle_a_providers_shared_entry(shaping, relay, sink_factory):
    """evil.test lists its own 421-answering MX before the provider's name, so
    its link matches the shared ``provider`` entry; only replies from the
    provider's host itself may cut the provider's limits."""
    relay.mx("evil.test", [(10, "mx.evil.test"), (20, "mx-a.provider.test")])
    relay.a("mx.evil.test", "127.0.0.4")
    attacker = sink_factory("127.0.0.4", greeting="421 4.7.0 slow down")
    provider = sink_factory(
        "127.0.0.2", rcpt_tempfail={"t@evil.test": 1}, tempfail_reply="421 4.7.0 provider busy"
    )
    lim = limiter.limiter()
    for i in range(3):
        accept(f"u{i}@evil.test")
    drain()
    assert attacker.connections >= 1  # the attacker's host was tried and said 421
    assert len(provider.messages) == 3  # then the provider's host took the mail
    status = lim.status("entry:provider", clock.now().timestamp(), (60.0, 60.0))
    assert (status.factor, status.reason) == (1.0, "")
    # The provider's own host throttling, on that same link, does count.
    accept("t@evil.test")
    drain()
    assert provider.verbs().count("RCPT") == 4
    status = lim.status("entry:provider", clock.now().timestamp(), (60.0, 60.0))
    assert (status.factor, status.reason) == (0.5, "421 4.7.0 provider busy")


def test_the_hosts_whose_replies_count_are_those_of_the_entry(shaping):
    from delivery.shaping.adaptive import throttle_reason
    from delivery.smtp.types import BatchResult, HostFailure
    from queues.models import Queue
    from queues.states import DeliveryType

    pol = parse(
        """
entries:
  - {name: provider, mx: .provider.test}
  - {name: partner, domain: partner.test}
  - {name: smarthost, next_hop: "[10.0.0.5]:2525"}
"""
    )
    provider, partner, smarthost = pol.entries

    def link(name: str, *hosts: tuple[str, int, bool], domain: str = "") -> Link:
        made = Link.objects.create(
            name=name,
            delivery_type=DeliveryType.DNS_MX,
            hosts=[{"host": h, "port": p, "literal": lit} for h, p, lit in hosts],
            created_at=clock.now(),
        )
        if domain:
            Queue.objects.create(
                name=domain, delivery_type=DeliveryType.DNS_MX, link=made, created_at=clock.now()
            )
        return made

    mixed = link("mixed", ("mx.evil.test", 25, False), ("MX1.Provider.test.", 25, False))
    assert gate.entry_for(mixed, pol) == provider  # the attacker's link shares the entry...
    assert gate.speaking_hosts(provider, mixed) == {"mx1.provider.test"}  # ...not its voice
    # A domain's own link, a next hop named by the operator, the default entry:
    # every host of the link speaks for it.
    own = link("own", ("mx.elsewhere.test", 25, False), domain="partner.test")
    assert gate.entry_for(own, pol) == partner and gate.speaking_hosts(partner, own) is None
    relay_hop = link("hop", ("10.0.0.5", 2525, True), ("10.0.0.6", 2525, True))
    assert gate.speaking_hosts(smarthost, relay_hop) == {"10.0.0.5"}
    assert gate.speaking_hosts(pol.default, mixed) is None

    def failure(host: str, text: str) -> HostFailure:
        return HostFailure(host, "127.0.0.4", 25, "connect", 421, text)

    batch = BatchResult(
        host_failures=[failure("mx.evil.test", "4.7.0 go away"), failure("mx1.provider.test", "")]
    )
    hosts = gate.speaking_hosts(provider, mixed)
    assert throttle_reason(batch, provider.on_throttle, hosts) == "421"
    batch.host_failures.pop()
    assert throttle_reason(batch, provider.on_throttle, hosts) == ""
    assert throttle_reason(batch, provider.on_throttle) == "421 4.7.0 go away"


def test_an_attackers_mx_does_not_bring_a_throttled_provider_back_up(shaping, relay, sink_factory):
    relay.mx("evil.test", [(10, "mx.evil.test"), (20, "mx-a.provider.test")])
    relay.a("mx.evil.test", "127.0.0.4")
    attacker = sink_factory("127.0.0.4")
    sink_factory("127.0.0.2", rcpt_tempfail={"t@a.shaped.test": 1}, tempfail_reply="421 4.7.0 busy")
    lim = limiter.limiter()
    accept("t@a.shaped.test")
    drain()
    assert lim.status("entry:provider", clock.now().timestamp(), (60, 60)).factor == 0.5
    clock.advance(timedelta(seconds=31))  # past the cool-down
    accept("u@evil.test")
    drain()
    assert len(attacker.messages) == 1  # delivered, but by the attacker's own host
    assert lim.status("entry:provider", clock.now().timestamp(), (60, 60)).factor == 0.5
    accept("u@a.shaped.test")  # a delivery by the provider's host does
    drain()
    assert lim.status("entry:provider", clock.now().timestamp(), (60, 60)).factor == 1.0
