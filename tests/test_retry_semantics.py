"""Exchange's queue behaviour and Exim's rules, end to end with the movable clock.

Sinks answer for real on 127.0.0.x; DNS comes from the loopback DNS server;
the workers' functions are driven in-process (tests/support/pipeline.drain).
"""

from __future__ import annotations

import email
from datetime import timedelta
from email import policy

import pytest
from django.core.exceptions import ImproperlyConfigured
from django.core.management import call_command

from delivery.qmgr.sweep import sweep
from delivery.smtp import retry
from queues.accept import IncomingEnvelope, IncomingRecipient, message_accept
from queues.lib import clock
from queues.models import (
    DeliveryType,
    Event,
    Link,
    LinkState,
    Message,
    MessageSource,
    MessageState,
    Recipient,
    RecipientState,
    RetryHint,
)
from tests.support.pipeline import drain

pytestmark = pytest.mark.django_db

BODY = b"From: a@example.org\r\nTo: u@example.net\r\nSubject: hello\r\n\r\nbody\r\n"
MIN = timedelta(minutes=1)


def accept(
    *rcpts: str,
    sender: str = "a@example.org",
    notify: str = "",
    ret: str = "",
    envid: str = "",
    orcpt: str = "",
) -> Message:
    env = IncomingEnvelope(
        mail_from=sender,
        recipients=[IncomingRecipient(r, orcpt=orcpt, notify=notify) for r in rcpts],
        ret=ret,
        envid=envid,
        client_address="127.0.0.1",
    )
    return message_accept(env, BODY)


@pytest.fixture
def relay(dns_settings, settings, smtp_port):
    settings.MAILRELAY_REMOTE_SMTP_PORT = smtp_port
    settings.MAILRELAY_SMTP_CONNECT_TIMEOUT = timedelta(seconds=2)
    settings.MAILRELAY_SMTP_CLIENT_TIMEOUT = timedelta(seconds=5)
    dns_settings.a("example.net", "127.0.0.2")  # the destination
    dns_settings.a("example.org", "127.0.0.3")  # the senders' domain: reports go here
    return dns_settings


@pytest.fixture
def sender_box(relay, sink_factory):
    return sink_factory("127.0.0.3")


def reports(sink) -> list[email.message.EmailMessage]:
    return [email.message_from_bytes(m.data, policy=policy.default) for m in sink.messages]


def status_fields(report) -> list:
    """The per-message block and per-recipient blocks of a delivery-status part."""
    part = next(p for p in report.walk() if p.get_content_type() == "message/delivery-status")
    return [dict(block.items()) for block in part.get_payload()]


def run_until_retry(step: int = 1) -> None:
    """Move the clock to the link's next retry (plus ``step`` s) and run the engine."""
    link = Link.objects.get(queues__name="example.net")
    clock.advance(link.next_retry_at - clock.now() + timedelta(seconds=step))
    sweep()
    drain()


def test_the_compiled_rules_reproduce_exchange_default_timings():
    start = clock.now()
    at, tried, next_try, schedule = start, start, None, []
    for _ in range(13):
        d = retry.decide(
            address="u@example.net",
            host="mx.example.net",
            error="refused_MX",
            first_failed=start,
            last_tried=tried,
            next_try=next_try,
            now=at,
        )
        schedule.append((d.at - start) / MIN)
        tried, next_try, at = at, d.at, d.at
    # 4 glitch retries 1 min apart, 6 transient retries 5 min apart, then every 10 min
    assert schedule == [1, 2, 3, 4, 9, 14, 19, 24, 29, 34, 44, 54, 64]


def test_a_link_that_keeps_failing_follows_exchange_retry_step_by_step(relay):
    accept("u@example.net")  # nothing listens on 127.0.0.2
    drain()
    link = Link.objects.get()
    first = link.first_failure_at
    seen = [round((link.next_retry_at - first) / MIN)]
    for _ in range(11):
        run_until_retry()
        link = Link.objects.get()
        assert link.state == LinkState.RETRY
        seen.append(round((link.next_retry_at - first) / MIN))
    assert seen == [1, 2, 3, 4, 9, 14, 19, 24, 29, 34, 44, 54]
    assert link.failure_count == 12
    r = Recipient.objects.get(address="u@example.net")
    assert r.state == RecipientState.DEFERRED and r.next_attempt_at == link.next_retry_at
    assert r.attempts.count() == 12
    # Exim-style per-host retry data was kept for the host
    hint = RetryHint.objects.get(key__startswith="T:example.net:127.0.0.2")
    assert hint.error == "refused_A" and hint.first_failed == first


def test_a_link_comes_back_to_ready_when_the_host_answers(relay, sink_factory):
    accept("u@example.net")
    drain()
    sink = sink_factory("127.0.0.2")
    run_until_retry()
    assert len(sink.messages) == 1
    link = Link.objects.get()
    assert (link.state, link.failure_count, link.next_retry_at) == (LinkState.READY, 0, None)
    assert not RetryHint.objects.filter(key__startswith="T:example.net:127.0.0.2").exists()


def test_a_problem_message_waits_the_message_retry_interval(relay, sink_factory):
    sink = sink_factory("127.0.0.2", data_reply="451 4.3.0 try again later")
    message = accept("u@example.net")
    drain()
    r = Recipient.objects.get()
    assert r.state == RecipientState.DEFERRED
    assert r.next_attempt_at - r.first_failure_at == MIN  # glitch retry first
    clock.advance(MIN + timedelta(seconds=1))
    drain()
    message.refresh_from_db()
    r.refresh_from_db()
    assert message.per_message_failures == 2 and message.problem
    waited = r.next_attempt_at - r.last_attempt_at
    assert timedelta(minutes=15) <= waited < timedelta(minutes=15, seconds=1)
    assert len(sink.rejected) == 2


def test_a_message_expires_after_two_days_with_an_ndr(relay, sender_box):
    message = accept("u@example.net", envid="ENV+2D1", orcpt="rfc822;U@example.net")
    drain()
    clock.advance(timedelta(days=2, seconds=1))
    report = sweep()
    assert report.expired == 1
    r = Recipient.objects.get(address="u@example.net")
    assert r.state == RecipientState.EXPIRED
    assert r.queue.delivery_type == DeliveryType.DEAD_LETTER
    assert Message.objects.get(pk=message.pk).state == MessageState.DONE
    drain()
    (ndr,) = reports(sender_box)
    assert sender_box.messages[0].mail_from == "<>"
    assert sender_box.messages[0].rcpt_tos == ["a@example.org"]
    assert ndr.get_content_type() == "multipart/report"
    per_message, per_rcpt = status_fields(ndr)
    assert per_message["Original-Envelope-Id"] == "ENV-1"
    assert per_rcpt["Final-Recipient"] == "rfc822; u@example.net"
    assert per_rcpt["Original-Recipient"] == "rfc822;U@example.net"
    assert (per_rcpt["Action"], per_rcpt["Status"]) == ("failed", "4.4.7")


def test_one_delay_dsn_after_four_hours(relay, sender_box):
    accept("u@example.net")
    drain()
    clock.advance(timedelta(hours=4, seconds=1))
    assert sweep().delay_dsns == 1
    drain()
    (delay,) = reports(sender_box)
    _, per_rcpt = status_fields(delay)
    assert per_rcpt["Action"] == "delayed"
    assert "Will-Retry-Until" in per_rcpt
    clock.advance(timedelta(hours=1))
    assert sweep().delay_dsns == 0
    drain()
    assert len(sender_box.messages) == 1
    assert Recipient.objects.get(address="u@example.net").delay_dsn_sent


@pytest.mark.parametrize(
    ("sender", "notify"), [("a@example.org", "NEVER"), ("", ""), ("a@example.org", "SUCCESS")]
)
def test_no_ndr_for_notify_never_the_null_sender_or_success_only(relay, sender, notify):
    relay.null_mx("nomail.example")
    accept("u@nomail.example", sender=sender, notify=notify)
    drain()
    assert Recipient.objects.get(address="u@nomail.example").state == RecipientState.FAILED
    assert not Message.objects.filter(source=MessageSource.DSN).exists()


def test_a_bounce_is_never_bounced(relay):
    relay.null_mx("nomail.example")
    relay.remove("example.org")  # the sender's domain does not exist either
    accept("u@nomail.example")
    drain()
    (ndr,) = Message.objects.filter(source=MessageSource.DSN)
    assert ndr.mail_from == ""
    ndr_rcpt = ndr.recipients.get()
    assert ndr_rcpt.state == RecipientState.FAILED
    assert ndr_rcpt.queue.delivery_type == DeliveryType.DEAD_LETTER  # badmail, kept
    assert Message.objects.filter(source=MessageSource.DSN).count() == 1


def test_the_ndr_lists_only_failed_recipients(relay, sink_factory, sender_box):
    sink_factory("127.0.0.2", rcpt_replies={"bad@example.net": "550 5.1.1 no such user"})
    accept("good@example.net", "bad@example.net")
    drain()
    (ndr,) = reports(sender_box)
    blocks = status_fields(ndr)[1:]
    assert [b["Final-Recipient"] for b in blocks] == ["rfc822; bad@example.net"]
    assert blocks[0]["Diagnostic-Code"] == "smtp; 550 5.1.1 no such user"
    assert blocks[0]["Status"] == "5.1.1"
    assert blocks[0]["Remote-MTA"] == "dns; example.net"


def test_success_dsn_is_relayed_only_when_the_next_hop_lacks_dsn(relay, sink_factory, sender_box):
    plain = sink_factory("127.0.0.2", dsn=False)
    accept("u@example.net", notify="SUCCESS")
    drain()
    assert len(plain.messages) == 1
    (relayed,) = reports(sender_box)
    assert status_fields(relayed)[1]["Action"] == "relayed"


def test_the_next_hop_with_dsn_gets_notify_and_we_send_none(relay, sink_factory, sender_box):
    capable = sink_factory("127.0.0.2", dsn=True)
    accept("u@example.net", notify="SUCCESS,FAILURE", orcpt="rfc822;u@example.net")
    drain()
    assert "NOTIFY=SUCCESS,FAILURE" in capable.messages[0].rcpt_options[0]
    assert not sender_box.messages


def test_a_link_idle_in_retry_for_twelve_hours_is_resubmitted(relay, sink_factory, settings):
    settings.MAILRELAY_MESSAGE_EXPIRATION_TIMEOUT = timedelta(days=5)
    accept("u@example.net")
    drain()
    relay.remove("example.net")
    relay.mx("example.net", [(10, "new-mx.example.net")])
    relay.a("new-mx.example.net", "127.0.0.4")
    moved = sink_factory("127.0.0.4")
    clock.advance(timedelta(hours=12, minutes=1))
    report = sweep()
    assert report.resubmitted == 1
    assert Event.objects.filter(kind="auto_resubmit").exists()
    drain()
    assert len(moved.messages) == 1  # the new route was found
    assert sweep().resubmitted == 0


def test_a_rule_file_overrides_exchange_and_times_out_at_its_cutoff(
    relay, settings, tmp_path, sender_box
):
    rules = tmp_path / "retry.conf"
    rules.write_text("example.net  *  F,1h,15m\n")
    settings.MAILRELAY_RETRY_RULES = str(rules)
    accept("u@example.net")
    drain()
    link = Link.objects.get(queues__name="example.net")
    assert link.next_retry_at - link.first_failure_at == timedelta(minutes=15)
    for _ in range(5):
        run_until_retry()
    r = Recipient.objects.get(address="u@example.net")
    assert r.state == RecipientState.FAILED  # past the rule's 1 h cutoff, well before 2 days
    assert "retry timeout exceeded" in r.last_text
    drain()
    (ndr,) = reports(sender_box)
    assert status_fields(ndr)[1]["Action"] == "failed"


def test_a_bad_rule_file_stops_start_up_naming_the_line(settings, tmp_path):
    rules = tmp_path / "retry.conf"
    rules.write_text("* * F,2h,15m\nexample.com rcpt_4x5 F,1h,10m\n")
    settings.MAILRELAY_RETRY_RULES = str(rules)
    with pytest.raises(ImproperlyConfigured, match=r"MAILRELAY_RETRY_RULES: .*line 2"):
        retry.validate_retry_settings()


def test_dead_letters_are_kept_for_their_retention_then_purged(relay, settings):
    relay.null_mx("nomail.example")
    message = accept("u@nomail.example", notify="NEVER")
    drain()
    clock.advance(settings.MAILRELAY_COMPLETED_RETENTION + MIN)
    sweep()
    assert Message.objects.filter(pk=message.pk).exists()  # in the dead-letter queue
    clock.advance(settings.MAILRELAY_DEAD_LETTER_RETENTION)
    sweep()
    assert not Message.objects.filter(pk=message.pk).exists()


def test_delivered_messages_are_purged_after_the_completed_retention(relay, sink_factory, settings):
    sink_factory("127.0.0.2")
    message = accept("u@example.net")
    drain()
    clock.advance(settings.MAILRELAY_COMPLETED_RETENTION + MIN)
    assert sweep().purged == 1
    assert not Message.objects.filter(pk=message.pk).exists()


def test_nextretry_shows_the_hosts_retry_data(relay, capsys):
    accept("u@example.net")
    drain()
    call_command("nextretry", "example.net")
    out = capsys.readouterr().out
    assert "Link [example.net]:" in out
    assert "T:example.net:127.0.0.2" in out
    assert "error=refused_A" in out


def test_a_dead_letter_can_be_resubmitted_and_delivered(relay, sink_factory, settings):
    from queues.services.actions import message_resubmit

    relay.null_mx("nomail.example")
    message = accept("u@nomail.example", notify="NEVER")
    drain()
    assert Message.objects.get(pk=message.pk).state == MessageState.DONE
    # the domain gets a mail server after all; the operator resubmits the dead letter
    relay.remove("nomail.example")
    relay.a("nomail.example", "127.0.0.4")
    sink = sink_factory("127.0.0.4")
    clock.advance(timedelta(days=3))
    assert message_resubmit(Message.objects.get(pk=message.pk), "ops", "cli") == 1
    m = Message.objects.get(pk=message.pk)
    assert m.state == MessageState.SUBMISSION
    assert m.expires_at > clock.now() + timedelta(days=1)  # a fresh life
    drain()
    assert len(sink.messages) == 1
    assert Recipient.objects.get(address="u@nomail.example").state == RecipientState.DELIVERED
