"""The outbound SMTP client against real SMTP sinks on loopback addresses."""

from __future__ import annotations

import asyncio
import itertools
from dataclasses import dataclass
from datetime import timedelta

import pytest

from delivery.smtp.client import deliver
from delivery.smtp.clientconfig import ClientConfig
from delivery.smtp.connection import END_MARK, stuffed
from delivery.smtp.types import BatchResult, OutboundMessage, OutboundRecipient, RecipientResult

A, B = "127.0.0.2", "127.0.0.3"
_ids = itertools.count(1)


@dataclass(frozen=True)
class Target:
    host: str
    ip: str
    port: int


def target(ip: str, port: int, name: str | None = None) -> Target:
    return Target(name or f"mx-{ip}.test", ip, port)


def message(
    *rcpts: str | OutboundRecipient,
    mail_from: str = "sender@example.org",
    data: bytes | None = None,
    **kw,
) -> OutboundMessage:
    mid = next(_ids)
    recipients = [
        r if isinstance(r, OutboundRecipient) else OutboundRecipient(next(_ids), r) for r in rcpts
    ]
    if data is None:
        data = b"From: sender@example.org\r\nSubject: m%d\r\n\r\nbody %d\r\n" % (mid, mid)
    return OutboundMessage(mid, mail_from, data, recipients, **kw)


def config(**kw) -> ClientConfig:
    values = {
        "helo_name": "relay.test",
        "connect_timeout": 2.0,
        "command_timeout": 2.0,
        "data_timeout": 2.0,
    }
    values.update(kw)
    return ClientConfig(**values)


def run(targets: list[Target], messages: list[OutboundMessage], **kw) -> BatchResult:
    batch = asyncio.run(deliver(targets, messages, config(**kw)))
    # every recipient of every message exactly once
    got = sorted((r.message_id, r.recipient_id) for r in batch.results)
    want = sorted((m.id, r.id) for m in messages for r in m.recipients)
    assert got == want
    return batch


def by_address(batch: BatchResult, messages: list[OutboundMessage]) -> dict[str, RecipientResult]:
    address = {r.id: r.address for m in messages for r in m.recipients}
    return {address[r.recipient_id]: r for r in batch.results}


def by_message(batch: BatchResult) -> dict[int, list[RecipientResult]]:
    out: dict[int, list[RecipientResult]] = {}
    for r in batch.results:
        out.setdefault(r.message_id, []).append(r)
    return out


def outcomes(batch: BatchResult, messages: list[OutboundMessage]) -> list[str]:
    """One outcome per message (all its recipients must agree)."""
    grouped = by_message(batch)
    result = []
    for m in messages:
        kinds = {r.outcome for r in grouped[m.id]}
        assert len(kinds) == 1, kinds
        result.append(kinds.pop())
    return result


# --- the basics ----------------------------------------------------------------------


def wire(data: bytes) -> bytes:
    """The body as it goes on the wire after DATA, the final dot included."""
    return stuffed(data) + END_MARK


def test_wire():
    assert wire(b"a\r\n.b\r\n..c\r\n.\r\n") == b"a\r\n..b\r\n...c\r\n..\r\n.\r\n"
    assert wire(b".start\r\nend") == b"..start\r\nend\r\n.\r\n"
    assert wire(b"") == b".\r\n"
    # bare line ends never reach the wire (SMTP smuggling)
    assert wire(b"a\n.\nb\r.\rc") == b"a\r\n..\r\nb\r\n..\r\nc\r\n.\r\n"


def test_delivers_the_exact_bytes(sink, smtp_port):
    data = (
        b"From: sender@example.org\r\nSubject: dots\r\n\r\n"
        b".leading dot\r\n..two dots\r\n.\r\n \r\n\xc3\xa9 8bit\r\nno final newline"
    )
    m = message("a@example.com", "b@example.com", data=data, body_type="8BITMIME")
    batch = run([target(A, smtp_port)], [m])

    assert batch.connected and batch.connection_error == ""
    [got] = sink.messages
    assert got.data == data + b"\r\n"
    assert got.mail_from == "sender@example.org"
    assert got.rcpt_tos == ["a@example.com", "b@example.com"]
    assert f"SIZE={len(data)}" in got.mail_options and "BODY=8BITMIME" in got.mail_options
    for r in batch.results:
        assert (r.outcome, r.phase, r.scope, r.code, r.enhanced) == (
            "delivered",
            "data",
            "message",
            250,
            "2.0.0",
        )
        assert r.text == "OK queued"
        assert (r.host, r.ip, r.port) == (f"mx-{A}.test", A, smtp_port)
        assert r.started_at is not None and r.started_at.tzinfo is not None
        assert r.duration_ms >= 0


def test_twenty_messages_over_one_connection(sink, smtp_port):
    messages = [message(f"r{i}@example.com") for i in range(20)]
    batch = run([target(A, smtp_port)], messages, max_connections=1)
    assert outcomes(batch, messages) == ["delivered"] * 20
    assert sink.connections == 1
    assert sink.per_connection() == [20]
    assert "RSET" not in sink.verbs()


def test_45_messages_open_three_connections(sink, smtp_port):
    messages = [message(f"r{i}@example.com") for i in range(45)]
    batch = run([target(A, smtp_port)], messages, max_connections=3)
    assert outcomes(batch, messages) == ["delivered"] * 45
    assert sink.connections == 3
    assert sorted(sink.per_connection()) == [15, 15, 15]
    assert max(sink.per_connection()) <= 20


@pytest.mark.parametrize(
    ("count", "per_connection"),
    [
        (4, [4]),  # fewer than MIN_MESSAGES_PER_CONNECTION: one connection
        (12, [4, 4, 4]),  # at least 5 a connection would be 3 groups: balanced
        (45, [5] * 9),
        (300, [15] * 20),  # every connection, an equal share
        (400, [20] * 20),  # a full round
    ],
)
def test_a_round_is_spread_over_the_connections_at_least_five_each(
    sink, smtp_port, count, per_connection
):
    messages = [message(f"r{i}@example.com") for i in range(count)]
    batch = run([target(A, smtp_port)], messages)  # 20 connections, 20 messages each
    assert outcomes(batch, messages) == ["delivered"] * count
    assert sorted(sink.per_connection()) == per_connection
    assert sink.peak_connections <= 20


def test_never_more_than_max_connections_at_once(sink, smtp_port):
    messages = [message(f"r{i}@example.com") for i in range(30)]
    batch = run([target(A, smtp_port)], messages, max_messages_per_connection=3, max_connections=2)
    assert outcomes(batch, messages) == ["delivered"] * 30
    assert sink.connections == 10
    assert sink.peak_connections == 2
    assert sink.per_connection() == [3] * 10


def test_lock_step_without_pipelining(sink_factory, smtp_port):
    sink = sink_factory(pipelining=False)
    messages = [message("a@example.com", "b@example.com") for _ in range(3)]
    batch = run([target(A, smtp_port)], messages)
    assert outcomes(batch, messages) == ["delivered"] * 3
    assert [m.rcpt_tos for m in sink.messages] == [["a@example.com", "b@example.com"]] * 3


def test_helo_fallback_when_ehlo_is_refused(sink_factory, smtp_port):
    sink = sink_factory(ehlo_reply="502 5.5.2 EHLO not implemented")
    m = message("a@example.com", body_type="8BITMIME", ret="HDRS")
    batch = run([target(A, smtp_port)], [m])
    assert outcomes(batch, [m]) == ["delivered"]
    assert "HELO" in sink.verbs()
    assert sink.messages[0].mail_options == []  # no ESMTP parameters to an SMTP peer


def test_config_from_settings(settings):
    settings.MAILRELAY_HOSTNAME = "relay.example.net"
    settings.MAILRELAY_SMTP_CONNECT_TIMEOUT = timedelta(seconds=30)
    settings.MAILRELAY_SMTP_CLIENT_TIMEOUT = timedelta(minutes=5)
    settings.MAILRELAY_MAX_MESSAGES_PER_CONNECTION = 20
    settings.MAILRELAY_MAX_CONNECTIONS_PER_DESTINATION = 10
    cfg = ClientConfig.from_settings()
    assert cfg == ClientConfig("relay.example.net", 30.0, 300.0, 600.0, 20, 10)


# --- which target ----------------------------------------------------------------------


def test_falls_over_when_the_first_target_refuses(sink_factory, smtp_port):
    sink_factory(A, refuse=True)  # nothing listens on A
    second = sink_factory(B)
    m = message("a@example.com")
    batch = run([target(A, smtp_port), target(B, smtp_port)], [m])
    [r] = batch.results
    assert (r.outcome, r.ip) == ("delivered", B)
    assert len(second.messages) == 1
    assert batch.connected and batch.connection_error == ""


@pytest.mark.parametrize("greeting", ["421 4.3.2 Service not available", "554 5.3.2 No service"])
def test_falls_over_when_the_first_target_greets_with_an_error(sink_factory, smtp_port, greeting):
    first = sink_factory(A, greeting=greeting)
    second = sink_factory(B)
    messages = [message("a@example.com") for _ in range(3)]
    batch = run([target(A, smtp_port), target(B, smtp_port)], messages)
    assert outcomes(batch, messages) == ["delivered"] * 3
    assert first.connections == 1 and first.messages == []
    assert len(second.messages) == 3


def test_every_target_refusing_defers_with_the_last_error(smtp_port):
    messages = [message("a@example.com", "b@example.com"), message("c@example.com")]
    batch = run([target(A, smtp_port), target(B, smtp_port)], messages)
    assert not batch.connected
    assert B in batch.connection_error and "refused" in batch.connection_error.lower()
    for r in batch.results:
        assert (r.outcome, r.phase, r.scope, r.code, r.enhanced) == (
            "deferred",
            "connect",
            "connection",
            None,
            "4.4.1",
        )
        assert r.ip == B


def test_every_target_greeting_554_defers(sink_factory, smtp_port):
    sink_factory(A, greeting="554 5.3.2 Not now")
    sink_factory(B, greeting="554 5.3.2 Not now")
    m = message("a@example.com")
    batch = run([target(A, smtp_port), target(B, smtp_port)], [m])
    [r] = batch.results
    assert (r.outcome, r.phase, r.scope, r.code, r.enhanced) == (
        "deferred",
        "greeting",
        "connection",
        554,
        "5.3.2",
    )
    assert r.text == "Not now"
    assert not batch.connected
    assert batch.connection_error.endswith("said: 554 5.3.2 Not now (in reply to the greeting)")


def test_no_targets_defers_everything():
    m = message("a@example.com")
    batch = run([], [m])
    [r] = batch.results
    assert (r.outcome, r.scope) == ("deferred", "connection")
    assert batch.connection_error


# --- replies per recipient and per message ------------------------------------------------


@pytest.mark.parametrize("pipelining", [True, False])
def test_rcpt_4xx_deferred_and_5xx_failed_in_one_message(sink_factory, smtp_port, pipelining):
    sink = sink_factory(
        pipelining=pipelining,
        rcpt_replies={
            "temp@example.com": "450 4.2.1 Mailbox busy",
            "bad@example.com": "550 5.1.1 <bad@example.com>: user unknown",
        },
    )
    m = message("good@example.com", "temp@example.com", "bad@example.com")
    batch = run([target(A, smtp_port)], [m])
    got = by_address(batch, [m])
    assert (got["good@example.com"].outcome, got["good@example.com"].phase) == ("delivered", "data")
    temp, bad = got["temp@example.com"], got["bad@example.com"]
    assert (temp.outcome, temp.phase, temp.scope, temp.code, temp.enhanced, temp.text) == (
        "deferred",
        "rcpt",
        "recipient",
        450,
        "4.2.1",
        "Mailbox busy",
    )
    assert (bad.outcome, bad.phase, bad.scope, bad.code, bad.enhanced) == (
        "failed",
        "rcpt",
        "recipient",
        550,
        "5.1.1",
    )
    assert [m.rcpt_tos for m in sink.messages] == [["good@example.com"]]


def test_rcpt_4xx_then_delivered_on_the_next_try(sink_factory, smtp_port):
    sink_factory(rcpt_tempfail={"later@example.com": 1})
    m = message("later@example.com")
    first = run([target(A, smtp_port)], [m])
    assert [r.outcome for r in first.results] == ["deferred"]
    second = run([target(A, smtp_port)], [m])
    assert [r.outcome for r in second.results] == ["delivered"]


@pytest.mark.parametrize("pipelining", [True, False])
def test_mail_5xx_fails_only_that_message(sink_factory, smtp_port, pipelining):
    sink = sink_factory(
        pipelining=pipelining, mail_replies={"spammer@example.org": "550 5.7.1 Sender rejected"}
    )
    bad = message("a@example.com", "b@example.com", mail_from="spammer@example.org")
    good = message("a@example.com")
    batch = run([target(A, smtp_port)], [bad, good])
    for r in by_message(batch)[bad.id]:
        assert (r.outcome, r.phase, r.scope, r.code, r.enhanced) == (
            "failed",
            "mail",
            "message",
            550,
            "5.7.1",
        )
    assert outcomes(batch, [good]) == ["delivered"]
    assert sink.connections == 1
    assert sink.verbs(1).count("RSET") == 1  # between the failed and the next transaction


@pytest.mark.parametrize("pipelining", [True, False])
def test_no_recipient_accepted_then_next_message(sink_factory, smtp_port, pipelining):
    sink = sink_factory(pipelining=pipelining, rcpt_replies={"x@example.com": "550 5.1.1 unknown"})
    first = message("x@example.com")
    second = message("y@example.com")
    batch = run([target(A, smtp_port)], [first, second])
    assert outcomes(batch, [first, second]) == ["failed", "delivered"]
    assert [m.rcpt_tos for m in sink.messages] == [["y@example.com"]]


def test_data_4xx_defers_that_message(sink_factory, smtp_port):
    sink_factory(data_replies={"later@example.org": "451 4.3.0 Queue full"})
    bad = message("a@example.com", "b@example.com", mail_from="later@example.org")
    good = message("a@example.com")
    batch = run([target(A, smtp_port)], [bad, good])
    for r in by_message(batch)[bad.id]:
        assert (r.outcome, r.phase, r.scope, r.code, r.enhanced, r.text) == (
            "deferred",
            "data",
            "message",
            451,
            "4.3.0",
            "Queue full",
        )
    assert outcomes(batch, [good]) == ["delivered"]


def test_data_5xx_fails_that_message(sink_factory, smtp_port):
    sink_factory(data_reply="554 5.6.0 Content rejected")
    m = message("a@example.com")
    batch = run([target(A, smtp_port)], [m])
    [r] = batch.results
    assert (r.outcome, r.phase, r.scope, r.enhanced) == ("failed", "data", "message", "5.6.0")


# --- broken sessions ---------------------------------------------------------------------


def test_lost_connection_mid_batch_continues_on_the_next_target(sink_factory, smtp_port):
    first = sink_factory(A, drop_after_data={3})
    second = sink_factory(B)
    messages = [message(f"r{i}@example.com") for i in range(6)]
    batch = run([target(A, smtp_port), target(B, smtp_port)], messages, max_connections=1)

    assert outcomes(batch, messages) == ["delivered"] * 2 + ["deferred"] + ["delivered"] * 3
    [lost] = by_message(batch)[messages[2].id]
    assert (lost.phase, lost.scope, lost.code, lost.enhanced, lost.ip) == (
        "session",
        "connection",
        None,
        "4.4.2",
        A,
    )
    assert "end of data" in lost.text
    assert [m.rcpt_tos for m in first.messages] == [["r0@example.com"], ["r1@example.com"]]
    assert [m.rcpt_tos[0] for m in first.dropped] == ["r2@example.com"]
    assert [m.rcpt_tos[0] for m in second.messages] == [f"r{i}@example.com" for i in (3, 4, 5)]
    assert batch.connection_error == ""


def test_rcpt_results_before_a_421_stand(sink_factory, smtp_port):
    sink_factory(
        A,
        rcpt_replies={
            "bad@example.com": "550 5.1.1 unknown",
            "stop@example.com": "421 4.3.2 Closing",
        },
    )
    m = message("bad@example.com", "ok@example.com", "stop@example.com", "later@example.com")
    batch = run([target(A, smtp_port)], [m])
    got = {a: (r.outcome, r.phase, r.scope, r.code) for a, r in by_address(batch, [m]).items()}
    assert got == {
        "bad@example.com": ("failed", "rcpt", "recipient", 550),
        "ok@example.com": ("deferred", "rcpt", "connection", 421),
        "stop@example.com": ("deferred", "rcpt", "connection", 421),
        "later@example.com": ("deferred", "rcpt", "connection", 421),
    }


def test_lost_connection_with_no_target_left_defers_the_rest(sink_factory, smtp_port):
    sink_factory(A, drop_after_data={2})
    messages = [message(f"r{i}@example.com") for i in range(4)]
    batch = run([target(A, smtp_port)], messages)
    assert outcomes(batch, messages) == ["delivered", "deferred", "deferred", "deferred"]
    for m in messages[1:]:
        [r] = by_message(batch)[m.id]
        assert (r.phase, r.scope, r.enhanced) == ("session", "connection", "4.4.2")
    # only the message whose reply was lost may have arrived
    texts = [by_message(batch)[m.id][0].text for m in messages[1:]]
    assert ["delivered twice" in t for t in texts] == [True, False, False]
    assert batch.connected
    assert A in batch.connection_error and "lost connection" in batch.connection_error


def test_421_mid_session_defers_that_message_and_moves_on(sink_factory, smtp_port):
    first = sink_factory(A, mail_replies={"stop@example.org": "421 4.3.2 Shutting down"})
    second = sink_factory(B)
    messages = [
        message("a@example.com"),
        message("b@example.com", mail_from="stop@example.org"),
        message("c@example.com"),
        message("d@example.com"),
    ]
    batch = run([target(A, smtp_port), target(B, smtp_port)], messages)
    assert outcomes(batch, messages) == ["delivered", "deferred", "delivered", "delivered"]
    [r] = by_message(batch)[messages[1].id]
    assert (r.phase, r.scope, r.code, r.enhanced, r.text) == (
        "mail",
        "connection",
        421,
        "4.3.2",
        "Shutting down",
    )
    assert len(first.messages) == 1 and len(second.messages) == 2


def test_reply_timeout_defers(sink_factory, smtp_port):
    sink_factory(A, delays={"RCPT": 10.0})
    m = message("a@example.com")
    batch = run([target(A, smtp_port)], [m], command_timeout=1.0)
    [r] = batch.results
    assert (r.outcome, r.phase, r.scope, r.code, r.enhanced) == (
        "deferred",
        "session",
        "connection",
        None,
        "4.4.2",
    )
    assert "timeout" in r.text
    assert 900 <= r.duration_ms < 5000


def test_greeting_timeout_falls_over(sink_factory, smtp_port):
    slow = sink_factory(A, delays={"greeting": 10.0})
    fast = sink_factory(B)
    m = message("a@example.com")
    batch = run([target(A, smtp_port), target(B, smtp_port)], [m], command_timeout=1.0)
    assert [(r.outcome, r.ip) for r in batch.results] == [("delivered", B)]
    assert slow.messages == [] and len(fast.messages) == 1


def test_a_dead_target_is_tried_once_per_batch(sink_factory, smtp_port):
    slow = sink_factory(A, delays={"greeting": 10.0})
    fast = sink_factory(B)
    messages = [message(f"r{i}@example.com") for i in range(9)]
    batch = run(
        [target(A, smtp_port), target(B, smtp_port)],
        messages,
        command_timeout=1.0,
        max_messages_per_connection=3,
        max_connections=1,
    )
    assert outcomes(batch, messages) == ["delivered"] * 9
    assert slow.connections == 1  # later connections skip it instead of waiting again
    assert fast.per_connection() == [3, 3, 3]


def test_cancellation_propagates(sink_factory, smtp_port):
    sink_factory(A, delays={"DATA": 10.0})
    m = message("a@example.com")

    async def main():
        await asyncio.wait_for(deliver([target(A, smtp_port)], [m], config()), 0.3)

    with pytest.raises(TimeoutError):
        asyncio.run(main())


# --- extensions ------------------------------------------------------------------------------


def test_starttls_is_used_when_offered(sink_factory, smtp_port):
    sink = sink_factory(tls=True)
    messages = [message("a@example.com"), message("b@example.com")]
    batch = run([target(A, smtp_port)], messages)
    assert outcomes(batch, messages) == ["delivered", "delivered"]
    assert [m.tls for m in sink.messages] == [True, True]
    assert sink.verbs().count("STARTTLS") == 1
    assert sink.verbs()[:2] == ["EHLO", "STARTTLS"] and sink.verbs()[2] == "EHLO"


def test_tls_failure_counts_against_the_target(sink_factory, smtp_port):
    broken = sink_factory(A, tls_broken=True)
    good = sink_factory(B, tls=True)
    m = message("a@example.com")
    batch = run([target(A, smtp_port), target(B, smtp_port)], [m])
    assert [(r.outcome, r.ip) for r in batch.results] == [("delivered", B)]
    assert broken.messages == [] and [x.tls for x in good.messages] == [True]


def test_broken_tls_everywhere_falls_back_to_cleartext(sink_factory, smtp_port):
    sink = sink_factory(A, tls_broken=True)
    m = message("a@example.com")
    batch = run([target(A, smtp_port)], [m])
    assert outcomes(batch, [m]) == ["delivered"]
    assert [x.tls for x in sink.messages] == [False]
    assert sink.connections == 2


@pytest.mark.parametrize("dsn", [True, False])
def test_dsn_parameters_only_when_offered(sink_factory, smtp_port, dsn):
    sink = sink_factory(dsn=dsn)
    rcpt = OutboundRecipient(
        next(_ids), "a@example.com", orcpt="rfc822;Orig@example.com", notify="SUCCESS,FAILURE"
    )
    m = message(rcpt, ret="HDRS", envid="QQ314159")
    batch = run([target(A, smtp_port)], [m])
    assert outcomes(batch, [m]) == ["delivered"]
    [got] = sink.messages
    if dsn:
        assert {"RET=HDRS", "ENVID=QQ314159"} <= set(got.mail_options)
        assert got.rcpt_options == [["NOTIFY=SUCCESS,FAILURE", "ORCPT=rfc822;Orig@example.com"]]
    else:
        assert not [o for o in got.mail_options if o.startswith(("RET=", "ENVID="))]
        assert got.rcpt_options == [[]]


def test_size_limit_fails_without_sending(sink_factory, smtp_port):
    sink = sink_factory(size_limit=1000)
    big = message("a@example.com", data=b"Subject: big\r\n\r\n" + b"x" * 2000 + b"\r\n")
    small = message("b@example.com")
    batch = run([target(A, smtp_port)], [big, small])
    [r] = by_message(batch)[big.id]
    assert (r.outcome, r.phase, r.scope, r.code, r.enhanced) == (
        "failed",
        "mail",
        "message",
        None,
        "5.3.4",
    )
    assert "1000" in r.text
    assert outcomes(batch, [small]) == ["delivered"]
    assert sink.verbs().count("MAIL") == 1
    assert f"SIZE={len(small.data)}" in sink.messages[0].mail_options


@pytest.mark.parametrize(("offered", "expected"), [(True, "delivered"), (False, "failed")])
def test_smtputf8(sink_factory, smtp_port, offered, expected):
    sink = sink_factory(smtputf8=offered)
    m = message("josé@example.com", smtputf8=True, data="Subject: café\r\n\r\nbody\r\n".encode())
    batch = run([target(A, smtp_port)], [m])
    [r] = batch.results
    assert r.outcome == expected
    if offered:
        assert "SMTPUTF8" in sink.messages[0].mail_options
        assert sink.messages[0].rcpt_tos == ["josé@example.com"]
    else:
        assert (r.phase, r.enhanced, r.code) == ("mail", "5.6.7", None)
        assert "MAIL" not in sink.verbs()


def test_smtputf8_declared_but_ascii_goes_to_a_peer_without_it(sink_factory, smtp_port):
    sink = sink_factory(smtputf8=False)
    m = message("a@example.com", smtputf8=True)
    batch = run([target(A, smtp_port)], [m])
    assert outcomes(batch, [m]) == ["delivered"]
    assert "SMTPUTF8" not in sink.messages[0].mail_options


def test_body_8bitmime_only_when_offered(sink_factory, smtp_port):
    sink = sink_factory(eightbitmime=False)
    m = message("a@example.com", body_type="8BITMIME")
    batch = run([target(A, smtp_port)], [m])
    assert outcomes(batch, [m]) == ["delivered"]
    assert not [o for o in sink.messages[0].mail_options if o.startswith("BODY=")]


def test_crlf_in_an_address_is_never_sent(sink, smtp_port):
    m = message("a@example.com\r\nRCPT TO:<evil@example.com>", "ok@example.com")
    batch = run([target(A, smtp_port)], [m])
    got = by_address(batch, [m])
    assert got["ok@example.com"].outcome == "delivered"
    bad = got["a@example.com\r\nRCPT TO:<evil@example.com>"]
    assert (bad.outcome, bad.enhanced) == ("failed", "5.1.3")
    assert sink.messages[0].rcpt_tos == ["ok@example.com"]
