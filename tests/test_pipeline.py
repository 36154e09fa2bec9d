"""The engine end to end in-process: accepted → categorized → delivered at real sinks.

DNS answers come from the loopback DNS server, the next hops are real SMTP
sinks on 127.0.0.2, 127.0.0.3, …; the workers' functions are driven directly
(tests/support/pipeline.drain) with the movable clock.
"""

import io
from datetime import timedelta

import pytest
from django.core.management import call_command
from django.test import Client

from delivery.qmgr.sweep import sweep
from delivery.smtp.deliver import claim_round
from queues.accept import IncomingEnvelope, IncomingRecipient, message_accept
from queues.lib import clock
from queues.models import (
    Attempt,
    DeliveryType,
    Link,
    LinkState,
    Message,
    MessageState,
    Recipient,
    RecipientState,
)
from tests.support.operator_factories import make_user
from tests.support.pipeline import drain

pytestmark = pytest.mark.django_db

BODY = b"From: a@example.org\r\nTo: x\r\nSubject: t\r\n\r\nline one\r\n.dot line\r\n"


def accept(*rcpts: str, sender: str = "a@example.org", body: bytes = BODY) -> Message:
    env = IncomingEnvelope(
        mail_from=sender,
        recipients=[IncomingRecipient(r) for r in rcpts],
        client_address="127.0.0.1",
        client_helo="client.test",
    )
    return message_accept(env, body)


def rcpt(address: str) -> Recipient:
    return Recipient.objects.get(address=address)


@pytest.fixture
def relay(dns_settings, settings, smtp_port):
    settings.MAILRELAY_REMOTE_SMTP_PORT = smtp_port
    settings.MAILRELAY_SMTP_CONNECT_TIMEOUT = timedelta(seconds=2)
    settings.MAILRELAY_SMTP_CLIENT_TIMEOUT = timedelta(seconds=5)
    return dns_settings


def test_it_delivers_byte_exact_to_the_preferred_mx(relay, sink_factory):
    relay.mx("example.net", [(20, "mx2.example.net"), (10, "mx1.example.net")])
    relay.a("mx1.example.net", "127.0.0.2")
    relay.a("mx2.example.net", "127.0.0.3")
    mx1, mx2 = sink_factory("127.0.0.2"), sink_factory("127.0.0.3")
    message = accept("u@example.net")
    drain()
    assert len(mx1.messages) == 1 and not mx2.messages
    assert mx1.messages[0].data == bytes(Message.objects.get(pk=message.pk).data)
    assert mx1.messages[0].data.endswith(BODY)
    assert mx1.messages[0].mail_from == "a@example.org"
    assert rcpt("u@example.net").state == RecipientState.DELIVERED
    assert Message.objects.get(pk=message.pk).state == MessageState.DONE


def test_it_falls_over_to_the_next_mx_when_the_first_refuses(relay, sink_factory):
    relay.mx("example.net", [(10, "mx1.example.net"), (20, "mx2.example.net")])
    relay.a("mx1.example.net", "127.0.0.2")
    relay.a("mx2.example.net", "127.0.0.3")
    mx2 = sink_factory("127.0.0.3")  # nothing listens on 127.0.0.2
    accept("u@example.net")
    drain()
    assert len(mx2.messages) == 1
    r = rcpt("u@example.net")
    assert r.state == RecipientState.DELIVERED
    assert r.last_host == "mx2.example.net [127.0.0.3]"


def test_it_uses_the_domain_address_when_there_is_no_mx(relay, sink_factory):
    relay.a("implicit.example", "127.0.0.4")
    sink = sink_factory("127.0.0.4")
    accept("u@implicit.example")
    drain()
    assert len(sink.messages) == 1


@pytest.mark.parametrize(
    ("setup", "enhanced"),
    [(lambda dns: dns.null_mx("nomail.example"), "5.1.10"), (lambda dns: None, "5.1.2")],
    ids=["null-mx", "nxdomain"],
)
def test_it_fails_recipients_of_null_mx_and_nxdomain(relay, setup, enhanced):
    setup(relay)
    message = accept("u@nomail.example")
    drain()
    r = rcpt("u@nomail.example")
    assert r.state == RecipientState.FAILED
    assert r.last_enhanced == enhanced
    assert Message.objects.get(pk=message.pk).state == MessageState.DONE
    assert Attempt.objects.get(recipient=r).phase == "route"


def test_it_parks_servfail_in_unreachable_and_routes_again_later(relay, sink_factory):
    relay.servfail("flaky.example")
    accept("u@flaky.example")
    drain()
    r = rcpt("u@flaky.example")
    assert r.state == RecipientState.DEFERRED
    assert r.queue.delivery_type == DeliveryType.UNREACHABLE
    assert r.last_enhanced == "4.4.3"
    relay.remove("flaky.example")
    relay.a("flaky.example", "127.0.0.2")
    sink = sink_factory("127.0.0.2")
    sweep()
    drain()
    assert not sink.messages  # not due yet
    clock.advance(timedelta(minutes=6))
    sweep()
    drain()
    assert len(sink.messages) == 1
    assert rcpt("u@flaky.example").state == RecipientState.DELIVERED


def test_it_defers_a_4xx_recipient_and_delivers_it_later(relay, sink_factory):
    relay.a("example.net", "127.0.0.2")
    sink = sink_factory("127.0.0.2", rcpt_tempfail={"slow@example.net": 1})
    accept("slow@example.net")
    drain()
    r = rcpt("slow@example.net")
    assert r.state == RecipientState.DEFERRED
    assert (r.last_code, r.last_enhanced) == (450, "4.2.1")
    assert not sink.messages
    drain()  # not due yet: nothing happens
    assert rcpt("slow@example.net").attempt_count == 1
    clock.advance(timedelta(minutes=2))
    drain()
    assert len(sink.messages) == 1
    r = rcpt("slow@example.net")
    assert r.state == RecipientState.DELIVERED and r.attempt_count == 2
    assert [a.outcome for a in Attempt.objects.filter(recipient=r).order_by("id")] == [
        "deferred",
        "delivered",
    ]


def test_it_tracks_mixed_results_per_recipient(relay, sink_factory):
    relay.a("example.net", "127.0.0.2")
    sink = sink_factory(
        "127.0.0.2",
        rcpt_replies={"bad@example.net": "550 5.1.1 no such user"},
        rcpt_tempfail={"later@example.net": 1},
    )
    message = accept("good@example.net", "bad@example.net", "later@example.net")
    drain()
    assert sink.messages[0].rcpt_tos == ["good@example.net"]
    assert rcpt("good@example.net").state == RecipientState.DELIVERED
    bad = rcpt("bad@example.net")
    assert (bad.state, bad.last_code, bad.last_enhanced) == (RecipientState.FAILED, 550, "5.1.1")
    assert rcpt("later@example.net").state == RecipientState.DEFERRED
    assert Message.objects.get(pk=message.pk).state == MessageState.QUEUED
    clock.advance(timedelta(minutes=2))
    drain()
    assert sink.messages[1].rcpt_tos == ["later@example.net"]
    assert Message.objects.get(pk=message.pk).state == MessageState.DONE


def test_it_sends_up_to_twenty_messages_over_one_connection(relay, sink_factory, settings):
    settings.MAILRELAY_MAX_CONNECTIONS_PER_DESTINATION = 1
    relay.a("example.net", "127.0.0.2")
    sink = sink_factory("127.0.0.2")
    for i in range(45):
        accept(f"u{i}@example.net")
    drain()
    assert len(sink.messages) == 45
    assert sorted(sink.per_connection(), reverse=True) == [20, 20, 5]


def test_it_opens_more_connections_while_more_are_waiting(relay, sink_factory):
    relay.a("example.net", "127.0.0.2")
    sink = sink_factory("127.0.0.2")
    for i in range(60):
        accept(f"u{i}@example.net")
    drain()
    assert len(sink.messages) == 60
    # spread over the connections, at least five each (client.group_size)
    assert sink.per_connection() == [5] * 12


def test_bodies_too_large_to_preload_are_read_when_sent_byte_exact(relay, sink_factory):
    """Bodies past PRELOAD_MESSAGE_BYTES are read by the owner while the
    connections go (each next one while the previous record commits)."""
    relay.a("example.net", "127.0.0.2")
    sink = sink_factory("127.0.0.2")
    bodies = {}
    for i in range(30):
        body = BODY + f"message {i}\r\n".encode() * 8000  # ~110 KB each
        bodies[f"u{i}@example.net"] = body
        accept(f"u{i}@example.net", body=body)
    drain()
    assert len(sink.messages) == 30
    assert sink.per_connection() == [5] * 6
    for got in sink.messages:
        assert got.data.endswith(bodies[got.rcpt_tos[0]])
    assert set(Recipient.objects.values_list("state", flat=True)) == {RecipientState.DELIVERED}


def test_it_puts_the_link_in_retry_when_every_host_fails(relay, sink_factory):
    relay.a("example.net", "127.0.0.2")  # nothing listens yet
    accept("u1@example.net")
    accept("u2@example.net")
    drain()
    link = Link.objects.get()
    assert link.state == LinkState.RETRY and link.next_retry_at is not None
    assert "127.0.0.2" in link.last_error
    for r in Recipient.objects.all():
        assert r.state == RecipientState.DEFERRED
        assert r.next_attempt_at == link.next_retry_at
    sink = sink_factory("127.0.0.2")
    drain()
    assert not sink.messages  # the link waits for its retry time
    clock.advance(timedelta(minutes=1, seconds=1))
    sweep()
    drain()
    assert len(sink.messages) == 2
    assert Link.objects.get().state == LinkState.READY


def test_it_routes_by_transport_map_then_smart_host(relay, sink_factory, settings, smtp_port):
    settings.MAILRELAY_TRANSPORTS = f"mapped.example=[127.0.0.3]:{smtp_port}"
    settings.MAILRELAY_SMART_HOST = f"[127.0.0.2]:{smtp_port}"
    smart, mapped = sink_factory("127.0.0.2"), sink_factory("127.0.0.3")
    accept("a@mapped.example", "b@other.example", "c@third.example")
    drain()
    assert [m.rcpt_tos for m in mapped.messages] == [["a@mapped.example"]]
    assert sorted(t for m in smart.messages for t in m.rcpt_tos) == [
        "b@other.example",
        "c@third.example",
    ]
    # two destination queues behind the smart host share one link
    queues = {
        r.queue
        for r in Recipient.objects.filter(address__in=["b@other.example", "c@third.example"])
    }
    assert len(queues) == 2 and len({q.link_id for q in queues}) == 1


def test_the_sweep_takes_back_recipients_of_a_dead_delivery(relay, sink_factory, settings):
    relay.a("example.net", "127.0.0.2")
    sink = sink_factory("127.0.0.2")
    accept("u@example.net")
    while drain_categorize_only():
        pass
    link = Link.objects.get()
    claimed = claim_round(link.pk, "dead-round", 10)  # a worker claims it and dies before sending
    assert claimed
    assert rcpt("u@example.net").state == RecipientState.ACTIVE
    drain()
    assert not sink.messages  # the claim still holds
    clock.advance(settings.MAILRELAY_DELIVERY_LEASE + timedelta(seconds=1))
    report = sweep()
    assert report.recipients_reclaimed == 1
    drain()
    assert len(sink.messages) == 1


def drain_categorize_only() -> int:
    from delivery.qmgr.tasks import categorize_pending

    return categorize_pending()


def test_it_parks_a_message_that_keeps_crashing_the_categorizer(relay, settings):
    settings.MAILRELAY_POISON_THRESHOLD = 2
    relay.a("example.net", "127.0.0.2")
    message = accept("u@example.net")
    from delivery.qmgr.tasks import claim_batch as claim_for_categorizer

    for _ in range(2):  # the worker dies twice while categorizing it
        assert claim_for_categorizer("dying-worker", 10) == [message.pk]
        clock.advance(timedelta(minutes=6))
        sweep()
    drain_categorize_only()
    m = Message.objects.get(pk=message.pk)
    assert m.suspended
    assert rcpt("u@example.net").queue.delivery_type == DeliveryType.POISON
    assert m.events.filter(kind="poison").exists()


def test_a_message_that_makes_the_categorizer_raise_ends_in_poison_alone(
    relay, sink_factory, settings, monkeypatch
):
    """A crash is isolated to its message; the batch-mates are routed and delivered."""
    from delivery.route.routing import Router

    settings.MAILRELAY_POISON_THRESHOLD = 2
    relay.a("example.net", "127.0.0.2")
    sink = sink_factory("127.0.0.2")
    real_route = Router.route

    def route(self, domain):
        if domain == "crash.example":
            raise RuntimeError("a bug meets a strange domain")
        return real_route(self, domain)

    monkeypatch.setattr(Router, "route", route)
    bad = accept("u@crash.example")
    good = accept("u@example.net")
    for _ in range(3):
        drain()
        clock.advance(settings.MAILRELAY_CATEGORIZER_RETRY_INTERVAL + timedelta(seconds=1))
    assert len(sink.messages) == 1
    assert Message.objects.get(pk=good.pk).state == MessageState.DONE
    bad = Message.objects.get(pk=bad.pk)
    assert bad.suspended
    assert rcpt("u@crash.example").queue.delivery_type == DeliveryType.POISON
    assert bad.events.filter(kind="poison").count() == 1


def test_a_round_that_outlived_its_lease_does_not_overwrite_newer_results(
    relay, sink_factory, settings
):
    from delivery.smtp.deliver import _record
    from delivery.smtp.types import BatchResult, RecipientResult

    relay.a("example.net", "127.0.0.2")
    sink = sink_factory("127.0.0.2")
    accept("u@example.net")
    drain_categorize_only()
    link = Link.objects.get()
    ids = claim_round(link.pk, "slow-round", 10)  # a slow round starts...
    clock.advance(settings.MAILRELAY_DELIVERY_LEASE + timedelta(seconds=1))
    sweep()  # ...its lease runs out, the sweep takes the recipient back...
    drain()  # ...and another delivery delivers it
    assert len(sink.messages) == 1
    assert rcpt("u@example.net").state == RecipientState.DELIVERED
    late = RecipientResult(
        recipient_id=ids[0],
        message_id=rcpt("u@example.net").message_id,
        outcome="deferred",
        phase="data",
        code=451,
        enhanced="4.3.0",
        text="late\x00reply",
    )
    _record(Link.objects.get(), BatchResult([late], connected=True), "slow-round")
    r = rcpt("u@example.net")
    assert r.state == RecipientState.DELIVERED  # the newer result stands
    assert Message.objects.get(pk=r.message_id).state == MessageState.DONE


def test_a_reply_with_nul_is_recorded_not_crashed_on(relay, sink_factory):
    from delivery.smtp.deliver import _record
    from delivery.smtp.types import BatchResult, RecipientResult

    relay.a("example.net", "127.0.0.2")
    accept("u@example.net")
    drain_categorize_only()
    ids = claim_round(Link.objects.get().pk, "a-round", 10)
    odd = RecipientResult(
        recipient_id=ids[0],
        message_id=rcpt("u@example.net").message_id,
        outcome="deferred",
        phase="rcpt",
        code=450,
        enhanced="4.2.1",
        text="busy\x00now",
        host="mx\x00.example.net",
    )
    _record(Link.objects.get(), BatchResult([odd], connected=True), "a-round")
    r = rcpt("u@example.net")
    assert r.state == RecipientState.DEFERRED
    assert r.last_text == "busy\ufffdnow"


def test_a_round_whose_recording_crashes_is_parked_not_looped(
    relay, sink_factory, settings, monkeypatch
):
    from delivery.smtp import deliver as deliver_module

    settings.MAILRELAY_POISON_THRESHOLD = 1
    relay.a("example.net", "127.0.0.2")
    sink_factory("127.0.0.2")
    message = accept("u@example.net")

    def broken(*args, **kwargs):
        raise RuntimeError("a bug in recording")

    monkeypatch.setattr(deliver_module, "_record", broken)
    monkeypatch.setattr(deliver_module, "_record_delivered", broken)  # the early record's
    drain()
    r = rcpt("u@example.net")
    assert r.state == RecipientState.DEFERRED
    assert r.next_attempt_at >= clock.now() + settings.MAILRELAY_MESSAGE_RETRY_INTERVAL - timedelta(
        seconds=5
    )
    drain()  # not due again: no tight loop
    assert Message.objects.get(pk=message.pk).crash_count == 1
    clock.advance(settings.MAILRELAY_MESSAGE_RETRY_INTERVAL + timedelta(seconds=1))
    drain()  # crashes a second time: over the threshold, parked in Poison
    m = Message.objects.get(pk=message.pk)
    assert m.suspended
    assert rcpt("u@example.net").queue.delivery_type == DeliveryType.POISON


def test_nul_in_subject_and_odd_helo_are_stored_not_refused_forever():
    env = IncomingEnvelope(
        mail_from="a@example.org",
        recipients=[IncomingRecipient("u@example.net")],
        client_helo="bad\x00helo\udcff",
    )
    message = message_accept(env, b"Subject: =?utf-8?q?a=00b?= x\x00y\r\n\r\nbody\r\n")
    stored = Message.objects.get(pk=message.pk)
    assert "\x00" not in stored.subject
    assert stored.client_helo == "bad?helo?"


def test_a_routing_failure_shows_its_enhanced_code_once_everywhere(relay):
    """The attempt of a routing failure has no reply code (no peer answered) and
    its enhanced code in its own field, never again in its text."""
    message = accept("u@nomail.example")
    drain()
    attempt = Attempt.objects.get(message=message)
    assert (attempt.code, attempt.enhanced) == (None, "5.1.2")
    assert attempt.text == "domain nomail.example does not exist (DNS answered NXDOMAIN)"
    viewer = Client()
    viewer.force_login(make_user("viewer", "vera"))
    html = viewer.get(f"/messages/{message.pk}/").content.decode()
    api = viewer.get(f"/api/v1/messages/{message.pk}/").json()
    out = io.StringIO()
    call_command("message", "show", str(message.pk), stdout=out)
    assert [a["text"] for a in api["attempts"]] == [attempt.text]
    for shown in (html, out.getvalue()):
        assert "5.1.2 domain nomail.example does not exist" in shown
        assert shown.count("5.1.2") == shown.count("5.1.2 domain nomail.example does not exist")
