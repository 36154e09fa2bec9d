"""Sessions kept between a delivery task's rounds (delivery.smtp.client.SessionCache),
against real SMTP sinks on loopback addresses: Postfix's connection cache."""

from __future__ import annotations

import time

import pytest

from delivery.smtp.client import deliver
from delivery.smtp.connection import SessionCache
from delivery.smtp.tls import TlsRequirement
from delivery.smtp.types import BatchResult, OutboundMessage
from tests.test_smtp_client import A, B, config, message, target


@pytest.fixture
def cache():
    sessions = SessionCache()
    yield sessions
    sessions.close()


def round_(cache: SessionCache, targets, messages: list[OutboundMessage], **kw) -> BatchResult:
    batch = cache.run(deliver(targets, messages, config(**kw), cache=cache))
    assert sorted(r.message_id for r in batch.results) == sorted(m.id for m in messages)
    assert {r.outcome for r in batch.results} == {"delivered"}
    return batch


def test_a_later_round_goes_on_over_the_session_an_earlier_one_kept(sink, smtp_port, cache):
    t = [target(A, smtp_port)]
    first = [message(f"a{i}@example.com") for i in range(3)]
    second = [message(f"b{i}@example.com") for i in range(3)]

    round_(cache, t, first, max_connections=1)
    assert sink.active_connections == 1  # kept open, no QUIT
    assert "QUIT" not in sink.verbs(1)
    batch = round_(cache, t, second, max_connections=1)

    assert batch.connected
    assert sink.connections == 1
    assert sink.per_connection() == [6]
    # The kept session was checked with an RSET before the round used it.
    verbs = sink.verbs(1)
    assert verbs.count("RSET") == 1
    assert verbs.index("RSET") > verbs.index("DATA")
    cache.close()
    assert sink.wait_idle()
    assert sink.verbs(1)[-1] == "QUIT"


def test_a_round_s_connections_take_the_kept_sessions_side_by_side(sink, smtp_port, cache):
    t = [target(A, smtp_port)]
    for tag in ("first", "second"):
        round_(cache, t, [message(f"{tag}{i}@example.com") for i in range(10)], max_connections=2)
    # Two groups of five a round; the second round's two connections each took
    # one of the two kept sessions at the same moment.
    assert sink.connections == 2
    assert sink.per_connection() == [10, 10]
    assert [sink.verbs(n).count("RSET") for n in (1, 2)] == [1, 1]


def test_a_round_s_connections_let_idle_kept_sessions_go_side_by_side(sink, smtp_port):
    cache = SessionCache(keep_idle=0.2)
    try:
        t = [target(A, smtp_port)]
        round_(cache, t, [message(f"first{i}@example.com") for i in range(15)], max_connections=3)
        time.sleep(0.4)
        # Two connections at once find the three kept sessions idle too long:
        # each is QUIT (a wait for its 221, during which the other connection
        # looks at the same list) and the round opens new ones.
        batch = round_(
            cache, t, [message(f"second{i}@example.com") for i in range(10)], max_connections=2
        )
        assert batch.host_failures == []
        assert len(sink.messages) == 25
        assert sink.connections == 5
        assert sink.wait_until(lambda: all(sink.verbs(n)[-1] == "QUIT" for n in (1, 2, 3)))
    finally:
        cache.close()


def test_a_session_carries_at_most_max_messages_per_connection_over_its_rounds(
    sink, smtp_port, cache
):
    t = [target(A, smtp_port)]
    for n in (3, 3, 1):
        round_(
            cache,
            t,
            [message(f"r{n}-{i}@example.com") for i in range(n)],
            max_connections=1,
            max_messages_per_connection=4,
        )
    # 3 + 3 would be 6 on one connection: the second round let the first go
    # (it would only have idled beside the new one) and opened another, which
    # the third round (one message: 3 + 1) went on over.
    assert sink.per_connection() == [3, 4]
    assert sink.verbs(1)[-1] == "QUIT"
    # Never more open than the link may have (one): the first was QUIT before
    # the second said anything.
    commands = list(sink.commands)
    assert commands.index((1, "QUIT")) < min(i for i, (n, _v) in enumerate(commands) if n == 2)
    assert sink.wait_until(lambda: sink.active_connections == 0)  # full after 4: not kept


def test_a_session_the_peer_closed_meanwhile_costs_a_connection_not_a_try(sink, smtp_port, cache):
    t = [target(A, smtp_port)]
    round_(cache, t, [message("a@example.com")], max_connections=1)
    # The next hop restarts: the kept session is gone, the client does not know yet.
    sink.stop()
    sink.start()
    batch = round_(cache, t, [message("b@example.com")], max_connections=1)

    assert [r.outcome for r in batch.results] == ["delivered"]
    assert batch.host_failures == []
    assert [m.rcpt_tos for m in sink.messages] == [["a@example.com"], ["b@example.com"]]


def test_a_session_idle_too_long_is_quit_not_used(sink, smtp_port):
    cache = SessionCache(keep_idle=0.2)
    try:
        t = [target(A, smtp_port)]
        round_(cache, t, [message("a@example.com")], max_connections=1)
        time.sleep(0.4)
        round_(cache, t, [message("b@example.com")], max_connections=1)
        assert sink.per_connection() == [1, 1]
        assert sink.verbs(1)[-1] == "QUIT"
        assert "RSET" not in sink.verbs(1)
    finally:
        cache.close()


def test_a_session_is_kept_for_its_own_target_tls_requirement_and_account_only(
    sink_factory, smtp_port, cache
):
    a, b = sink_factory(A), sink_factory(B)
    round_(cache, [target(A, smtp_port)], [message("a@example.com")], max_connections=1)
    # Another target: its own connection.
    round_(cache, [target(B, smtp_port)], [message("b@example.com")], max_connections=1)
    # The same target under another TLS requirement: not the kept session either.
    never = TlsRequirement("none")
    round_(
        cache,
        [target(A, smtp_port)],
        [message("c@example.com")],
        max_connections=1,
        tls_for=lambda peer: never,
    )
    assert (a.connections, b.connections) == (2, 1)
    # The first kind again: the first session.
    round_(cache, [target(A, smtp_port)], [message("d@example.com")], max_connections=1)
    assert a.per_connection() == [2, 1]


def test_a_task_that_lost_its_claim_drops_its_kept_sessions_without_a_word(sink, smtp_port):
    cache = SessionCache()
    round_(cache, [target(A, smtp_port)], [message("a@example.com")], max_connections=1)
    cache.close(polite=False)
    assert sink.wait_idle()
    assert "QUIT" not in sink.verbs(1)


def test_a_lost_claim_drops_even_the_sessions_idle_too_long_without_a_word(sink, smtp_port):
    cache = SessionCache(keep_idle=0.2)
    round_(cache, [target(A, smtp_port)], [message("a@example.com")], max_connections=1)
    time.sleep(0.4)
    cache.close(polite=False)
    assert sink.wait_idle()
    assert "QUIT" not in sink.verbs(1)


def test_a_round_without_a_cache_quits_its_sessions(sink, smtp_port):
    import asyncio

    batch = asyncio.run(
        deliver([target(A, smtp_port)], [message("a@example.com")], config(max_connections=1))
    )
    assert [r.outcome for r in batch.results] == ["delivered"]
    assert sink.wait_idle()
    assert sink.verbs(1)[-1] == "QUIT"


# --- a link's delivery task (real PostgreSQL, the loopback DNS server) -------------


@pytest.mark.django_db
def test_a_link_s_delivery_task_goes_on_over_one_session_and_quits_it_at_the_end(
    dns_settings, settings, smtp_port, sink_factory, monkeypatch
):
    from datetime import timedelta

    from delivery.smtp import deliver as round_module
    from queues.models import Link, Message, MessageState
    from tests.test_round_wait import arrive

    settings.MAILRELAY_REMOTE_SMTP_PORT = smtp_port
    settings.MAILRELAY_SMTP_CONNECT_TIMEOUT = timedelta(seconds=2)
    settings.MAILRELAY_SMTP_CLIENT_TIMEOUT = timedelta(seconds=5)
    dns_settings.a("example.net", "127.0.0.2")
    relay = sink_factory("127.0.0.2")
    arrive(3, "first")
    # More mail arrives while the task waits between its rounds.
    waits: list[float] = []

    def wait(seconds: float) -> None:
        waits.append(seconds)
        if len(waits) == 1:
            arrive(4, "later")

    monkeypatch.setattr(round_module, "_round_wait", wait)
    assert round_module.deliver_link(Link.objects.get().pk) == 7

    assert len(waits) == 2  # two rounds with messages, then one that found none
    assert relay.per_connection() == [7]
    assert relay.verbs(1).count("RSET") == 1  # the second round checked the kept session
    assert relay.wait_idle()
    assert relay.verbs(1)[-1] == "QUIT"  # the task ended: the session was let go
    assert set(Message.objects.values_list("state", flat=True)) == {MessageState.DONE}


def test_a_round_lets_go_of_sessions_idle_too_long_whatever_their_target(sink_factory, smtp_port):
    a, b = sink_factory(A), sink_factory(B)
    cache = SessionCache(keep_idle=0.2)
    try:
        round_(cache, [target(B, smtp_port)], [message("b@example.com")], max_connections=1)
        time.sleep(0.4)
        # A round to another target: B's session, idle too long, is QUIT as it starts.
        round_(cache, [target(A, smtp_port)], [message("a@example.com")], max_connections=1)
        assert b.wait_idle()
        assert b.verbs(1)[-1] == "QUIT"
        assert a.active_connections == 1  # A's own session is kept
    finally:
        cache.close()
