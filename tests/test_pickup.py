"""Pickup and replay folders: files in, messages in the store, files gone (or .bad).

Most tests drive a ``FolderWatcher`` poll by poll in the test thread (a file
is taken on the second poll that sees it unchanged); the pause/resume test
runs the real asyncio service, and the replay test delivers at a real sink.
"""

from __future__ import annotations

import asyncio
import fcntl
import io
import os
from datetime import timedelta
from pathlib import Path

import pytest
from django.core.management import call_command

from delivery.pickup import (
    BadFile,
    FolderConfig,
    FolderWatcher,
    Outcome,
    PickupLimits,
    parse_pickup,
    parse_replay,
    replay_format,
    start_pickup,
)
from delivery.pickup.parse import normalize_line_endings
from queues.accept import IncomingEnvelope, IncomingRecipient, message_accept
from queues.lib import clock
from queues.models import (
    FINAL_RECIPIENT_STATES,
    Event,
    Message,
    MessageSource,
    MessageState,
    Recipient,
    RecipientState,
)
from queues.services.actions import Via, message_suspend
from tests.support.environment import settings_from_environment
from tests.support.pipeline import drain

pytestmark = pytest.mark.django_db

GOOD = (
    b"From: Alice <alice@example.org>\r\n"
    b"To: Bob <bob@example.net>, carol@example.net\r\n"
    b"Cc: dave@example.com\r\n"
    b"Bcc: Eve Hidden <eve@example.com>,\r\n"
    b"  frank@example.com\r\n"
    b"Subject: picked up\r\n"
    b"Date: Mon, 02 Feb 2026 10:00:00 +0000\r\n"
    b"\r\n"
    b"Hello from the pickup folder.\r\n"
)


class FakeClock:
    """The watchers' monotonic clock, moved by hand (the rate limit's minute)."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def folders(tmp_path, settings):
    settings.MAILRELAY_PICKUP_DIR = str(tmp_path / "pickup")
    settings.MAILRELAY_REPLAY_DIR = str(tmp_path / "replay")
    settings.MAILRELAY_PICKUP_POLL_INTERVAL = timedelta(milliseconds=10)
    settings.MAILRELAY_PICKUP_MAX_MESSAGES_PER_MINUTE = 100
    settings.MAILRELAY_PICKUP_MAX_HEADER_SIZE = 64 * 1024
    settings.MAILRELAY_PICKUP_MAX_RECIPIENTS_PER_MESSAGE = 100
    settings.MAILRELAY_HOSTNAME = "relay.test"
    for sub in ("pickup", "replay"):
        (tmp_path / sub).mkdir()
    return tmp_path


@pytest.fixture
def fake_clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def watcher(folders, fake_clock):
    def make(kind: str = "pickup") -> FolderWatcher:
        config = FolderConfig.from_settings(kind)
        assert config is not None
        return FolderWatcher(config, now=fake_clock)

    return make


def drop(directory: Path, name: str, data: bytes) -> Path:
    """Write as a well-behaved writer does: another name, then rename to *.eml."""
    temporary = directory / f".{name}.part"
    temporary.write_bytes(data)
    target = directory / name
    os.rename(temporary, target)
    return target


def take(w: FolderWatcher) -> list:
    """Two polls: the first sees the files, the second takes the unchanged ones."""
    w.poll()
    return w.poll()


def only_message() -> Message:
    return Message.objects.get()


def envelope_of(message: Message) -> tuple[str, list[str]]:
    rcpts = list(message.recipients.order_by("id").values_list("address", flat=True))
    return message.mail_from, rcpts


# ------------------------------------------------------------------- pickup: good files


def test_it_submits_a_good_file_and_deletes_it(watcher, folders, bells):
    path = drop(folders / "pickup", "one.eml", GOOD)
    w = watcher()
    assert w.poll() == []  # seen once: maybe still being written
    assert path.exists()
    [outcome] = w.poll()
    assert outcome.status == Outcome.SUBMITTED
    assert not path.exists()
    message = only_message()
    assert outcome.qid == message.qid
    assert message.source == MessageSource.PICKUP
    assert message.state == MessageState.SUBMISSION
    assert envelope_of(message) == (
        "alice@example.org",
        [
            "bob@example.net",
            "carol@example.net",
            "dave@example.com",
            "eve@example.com",
            "frank@example.com",
        ],
    )
    assert bells.categorizer == 1


def test_it_removes_bcc_from_the_stored_copy_and_keeps_the_rest(watcher, folders):
    drop(folders / "pickup", "one.eml", GOOD)
    take(watcher())
    stored = bytes(only_message().data)
    assert b"bcc" not in stored.lower()
    assert b"eve" not in stored.lower() and b"frank" not in stored
    assert stored.startswith(b"Received: from relay.test (localhost [unknown])")
    original_without_bcc = GOOD.replace(
        b"Bcc: Eve Hidden <eve@example.com>,\r\n  frank@example.com\r\n", b""
    )
    assert stored.endswith(original_without_bcc)


def test_it_takes_the_envelope_sender_from_sender_before_from(watcher, folders):
    data = (
        b"From: a@example.org, b@example.org\r\nSender: secretary@example.org\r\n"
        b"To: x@example.net\r\n\r\nbody\r\n"
    )
    drop(folders / "pickup", "s.eml", data)
    take(watcher())
    assert only_message().mail_from == "secretary@example.org"


def test_it_lists_each_recipient_once(watcher, folders):
    data = (
        b"From: a@example.org\r\nTo: x@example.net, x@EXAMPLE.NET\r\n"
        b"Cc: <x@example.net>, y@example.net\r\nBcc: y@example.net\r\n\r\nbody\r\n"
    )
    drop(folders / "pickup", "d.eml", data)
    take(watcher())
    assert envelope_of(only_message())[1] == ["x@example.net", "y@example.net"]


def test_it_stores_crlf_and_adds_a_missing_date(watcher, folders):
    drop(folders / "pickup", "lf.eml", b"From: a@example.org\nTo: x@example.net\n\nline\n")
    take(watcher())
    stored = bytes(only_message().data)
    assert b"\n" not in stored.replace(b"\r\n", b"")
    assert b"\r\nFrom: a@example.org\r\nTo: x@example.net\r\nDate: " in stored
    assert stored.endswith(b"\r\n\r\nline\r\n")


def test_it_marks_8bit_content_and_utf8_addresses(watcher, folders):
    data = "From: jörg@exämple.org\r\nTo: zoë@example.net\r\n\r\nGrüße\r\n".encode()
    drop(folders / "pickup", "u.eml", data)
    take(watcher())
    message = only_message()
    assert message.smtputf8 is True
    assert message.body_type == "8BITMIME"
    assert message.mail_from == "jörg@exämple.org"


# ------------------------------------------------------------------- pickup: bad files


@pytest.mark.parametrize(
    ("data", "reason"),
    [
        (b"To: x@example.net\r\n\r\nbody\r\n", "no Sender and no From"),
        (b"From: a@example.org\r\nSubject: s\r\n\r\nbody\r\n", "no recipient"),
        (b"From: a@example.org, b@example.org\r\nTo: x@example.net\r\n\r\nb\r\n", "several"),
        (b"From a@example.org Mon Jan  1 00:00:00 2026\r\nTo: x@example.net\r\n\r\n", "line 1"),
        (b"From: a@example.org\r\nTo: nobody\r\n\r\nbody\r\n", "no domain"),
        (b"From: a@example.org\r\nTo: <x%y@example.net>\r\n\r\nb\r\n", "routing"),
        (b"\r\nno header at all\r\n", "no header"),
        (b"X-Sender: <a@example.org>\r\nX-Receiver: <x@example.net>\r\n\r\n", "replay folder"),
    ],
    ids=[
        "no-sender",
        "no-recipient",
        "two-from",
        "mbox-line",
        "no-domain",
        "percent-hack",
        "no-header",
        "replay-file",
    ],
)
def test_it_renames_a_bad_file_with_its_reason(watcher, folders, data, reason):
    pickup = folders / "pickup"
    path = drop(pickup, "bad.eml", data)
    w = watcher()
    [outcome] = take(w)
    assert outcome.status == Outcome.BAD
    assert not path.exists()
    assert (pickup / "bad.bad").read_bytes() == data  # never lost
    note = (pickup / "bad.bad.txt").read_text()
    assert "bad.eml" in note and reason in note
    assert not Message.objects.exists()
    event = Event.objects.get(kind="pickup_bad_file")
    assert reason in event.text
    # never retried in a loop: nothing is taken again
    assert w.poll() == [] and w.poll() == []
    assert sorted(p.name for p in pickup.iterdir()) == ["bad.bad", "bad.bad.txt"]


def test_a_second_bad_file_of_the_same_name_does_not_overwrite_the_first(watcher, folders):
    pickup = folders / "pickup"
    w = watcher()
    drop(pickup, "x.eml", b"first\r\n")
    take(w)
    drop(pickup, "x.eml", b"second\r\n")
    take(w)
    assert (pickup / "x.bad").read_bytes() == b"first\r\n"
    assert (pickup / "x.1.bad").read_bytes() == b"second\r\n"
    assert (pickup / "x.1.bad.txt").exists()


# ------------------------------------------------------------------- partial files


def test_it_never_takes_a_file_not_named_eml(watcher, folders):
    pickup = folders / "pickup"
    (pickup / "writing.eml.tmp").write_bytes(GOOD)
    (pickup / ".hidden.eml").write_bytes(GOOD)
    w = watcher()
    assert take(w) == [] and w.poll() == []
    assert not Message.objects.exists()


def test_it_waits_while_a_file_is_still_growing(watcher, folders):
    path = folders / "pickup" / "growing.eml"
    head, tail = GOOD[:40], GOOD[40:]
    path.write_bytes(head)  # a writer that writes in place
    w = watcher()
    assert w.poll() == []
    with path.open("ab") as fh:
        fh.write(tail[:10])
    assert w.poll() == []  # changed since the last poll: not taken
    with path.open("ab") as fh:
        fh.write(tail[10:])
    assert w.poll() == []
    [outcome] = w.poll()  # unchanged across two polls: taken, whole
    assert outcome.status == Outcome.SUBMITTED
    assert bytes(only_message().data).endswith(b"Hello from the pickup folder.\r\n")


def test_it_does_not_follow_symbolic_links(watcher, folders, tmp_path):
    secret = tmp_path / "secret.txt"
    secret.write_bytes(GOOD)
    (folders / "pickup" / "link.eml").symlink_to(secret)
    assert take(watcher()) == []
    assert not Message.objects.exists()


def test_a_file_locked_by_another_process_is_left_to_it(watcher, folders):
    path = drop(folders / "pickup", "one.eml", GOOD)
    w = watcher()
    w.poll()
    with path.open("rb") as held:
        fcntl.flock(held, fcntl.LOCK_EX)  # another watcher is taking it
        [outcome] = w.poll()
        assert outcome.status == Outcome.SKIPPED
    assert path.exists() and not Message.objects.exists()
    w.poll()  # unchanged, unlocked: taken now
    assert not path.exists() and Message.objects.count() == 1


# ------------------------------------------------------------------- limits


def test_it_refuses_more_recipients_than_the_limit(watcher, folders, settings):
    settings.MAILRELAY_PICKUP_MAX_RECIPIENTS_PER_MESSAGE = 3
    pickup = folders / "pickup"
    drop(pickup, "three.eml", b"From: a@example.org\r\nTo: a@x.net, b@x.net, c@x.net\r\n\r\n")
    four = b"From: a@example.org\r\nTo: a@x.net, b@x.net\r\nCc: c@x.net\r\nBcc: d@x.net\r\n\r\n"
    drop(pickup, "four.eml", four)
    outcomes = {o.name: o for o in take(watcher())}
    assert outcomes["three.eml"].status == Outcome.SUBMITTED
    assert outcomes["four.eml"].status == Outcome.BAD
    assert "4 recipients, over the limit of 3" in (pickup / "four.bad.txt").read_text()


def test_it_refuses_a_header_over_the_limit(watcher, folders, settings):
    settings.MAILRELAY_PICKUP_MAX_HEADER_SIZE = 200
    pickup = folders / "pickup"
    header = b"From: a@example.org\r\nTo: x@example.net\r\n"
    drop(pickup, "small.eml", header + b"X-Pad: " + b"p" * 100 + b"\r\n\r\n" + b"b" * 5000)
    drop(pickup, "big.eml", header + b"X-Pad: " + b"p" * 200 + b"\r\n\r\nbody\r\n")
    outcomes = {o.name: o.status for o in take(watcher())}
    assert outcomes == {"small.eml": Outcome.SUBMITTED, "big.eml": Outcome.BAD}
    assert "MAILRELAY_PICKUP_MAX_HEADER_SIZE" in (pickup / "big.bad.txt").read_text()


def test_it_refuses_a_file_over_the_message_size_limit(watcher, folders, settings):
    settings.MAILRELAY_MAX_MESSAGE_SIZE = 1000
    drop(folders / "pickup", "huge.eml", GOOD + b"x" * 1000)
    [outcome] = take(watcher())
    assert outcome.status == Outcome.BAD and "limit is 1000" in outcome.reason


def test_it_takes_at_most_the_messages_per_minute(watcher, folders, settings, fake_clock):
    settings.MAILRELAY_PICKUP_MAX_MESSAGES_PER_MINUTE = 2
    pickup = folders / "pickup"
    for i in range(3):
        drop(pickup, f"m{i}.eml", GOOD)
    w = watcher()
    assert len(take(w)) == 2
    assert Message.objects.count() == 2
    fake_clock.now += 30
    assert w.poll() == []  # the minute is not over
    fake_clock.now += 31
    [outcome] = w.poll()
    assert outcome.status == Outcome.SUBMITTED and Message.objects.count() == 3
    assert list(pickup.iterdir()) == []


# ------------------------------------------------------------------- back pressure


@pytest.mark.django_db(transaction=True)
def test_it_pauses_while_not_allowed_and_resumes_by_itself(folders, bells):
    """The real service on a loop: files wait while allowed("pickup") is False."""
    path = drop(folders / "pickup", "one.eml", GOOD)
    allowed = {"pickup": False, "replay": True}
    asked: list[str] = []

    def allow(kind: str) -> bool:
        asked.append(kind)
        return allowed[kind]

    async def scenario() -> None:
        service = start_pickup(allowed=allow)
        runner = service.runners["pickup"]
        try:
            await asyncio.wait_for(runner.wait_until(lambda r: r.polls >= 4), 10)
            assert runner.paused and path.exists() and runner.submitted == 0
            allowed["pickup"] = True
            await asyncio.wait_for(runner.wait_until(lambda r: r.submitted == 1), 10)
            assert not runner.paused and not path.exists()
        finally:
            await service.stop()

    asyncio.run(scenario())
    message = Message.objects.get()
    assert message.source == MessageSource.PICKUP
    assert {"pickup", "replay"} <= set(asked)
    assert bells.categorizer == 1


@pytest.mark.django_db(transaction=True)
def test_a_service_without_folders_does_nothing(settings):
    settings.MAILRELAY_PICKUP_DIR = ""
    settings.MAILRELAY_REPLAY_DIR = ""

    async def scenario() -> None:
        service = start_pickup()
        assert service.runners == {}
        await service.stop()

    asyncio.run(scenario())


def test_the_folders_settings_come_from_the_environment_through_settings_py(
    settings, monkeypatch, tmp_path
):
    settings_from_environment(
        settings,
        monkeypatch,
        MAILRELAY_PICKUP_DIR=str(tmp_path / "p"),
        MAILRELAY_MAX_MESSAGE_SIZE="1MB",
        MAILRELAY_HOSTNAME="relay.example",
    )
    pickup = FolderConfig.from_settings("pickup")
    assert pickup is not None and pickup.directory == tmp_path / "p"
    assert FolderConfig.from_settings("replay") is None  # MAILRELAY_REPLAY_DIR unset: off
    # The defaults of docs/pickup-replay.md, held by settings.py alone.
    assert (pickup.interval, pickup.max_per_minute) == (5.0, 100)
    assert pickup.limits == PickupLimits(max_header_size=64 * 1024, max_recipients=100)
    assert (pickup.max_file_size, pickup.hostname) == (1024 * 1024, "relay.example")


def test_runpickup_once_takes_what_is_there_and_exits(folders):
    drop(folders / "pickup", "good.eml", GOOD)
    drop(folders / "pickup", "bad.eml", b"nothing useful\r\n")
    out = io.StringIO()
    call_command("runpickup", "--once", stdout=out)
    assert "1 submitted, 1 bad" in out.getvalue()
    assert Message.objects.count() == 1
    assert sorted(p.name for p in (folders / "pickup").iterdir()) == ["bad.bad", "bad.bad.txt"]


# ------------------------------------------------------------------- replay format


def test_it_parses_the_replay_envelope_and_strips_it():
    data = (
        b"X-Sender: <s@example.org> BODY=8bitmime RET=HDRS ENVID=QQ314159 AUTH=<>\r\n"
        b"X-Receiver: <a@example.net> NOTIFY=success,failure ORCPT=rfc822;a@example.net\r\n"
        b"X-Receiver: <b@example.net> NOTIFY=NEVER ORCPT=b@example.net\r\n"
        b"X-Receiver: c@example.net\r\n"
        b"Received: from elsewhere\r\nSubject: again\r\n\r\nbody\r\n"
    )
    sub = parse_replay(data)
    env = sub.envelope
    assert (env.mail_from, env.body_type, env.ret, env.envid) == (
        "s@example.org",
        "8BITMIME",
        "HDRS",
        "QQ314159",
    )
    assert [(r.address, r.notify, r.orcpt) for r in env.recipients] == [
        ("a@example.net", "SUCCESS,FAILURE", "rfc822;a@example.net"),
        ("b@example.net", "NEVER", "rfc822;b@example.net"),
        ("c@example.net", "", ""),
    ]
    assert env.source == MessageSource.REPLAY
    assert sub.data == b"Received: from elsewhere\r\nSubject: again\r\n\r\nbody\r\n"


def test_it_strips_the_injected_headers_of_an_exchange_export():
    data = (
        b'X-Sender: "Sam" <s@example.org>\r\n'
        b"X-Receiver: <a@example.net>\r\n"
        b"X-CreatedBy: MSExchange15\r\n"
        b"X-HeloDomain: ex01.example.org\r\n"
        b"X-EndOfInjectedXHeaders: 1234\r\n"
        b"From: s@example.org\r\n\r\nbody\r\n"
    )
    sub = parse_replay(data)
    assert sub.envelope.mail_from == "s@example.org"
    assert sub.data == b"From: s@example.org\r\n\r\nbody\r\n"


@pytest.mark.parametrize(
    ("data", "reason"),
    [
        (b"From: a@example.org\r\nTo: b@example.net\r\n\r\n", "exactly one X-Sender"),
        (b"X-Sender: <a@example.org>\r\nSubject: s\r\n\r\n", "no X-Receiver"),
        (b"X-Sender: <a@example.org>\r\nX-Receiver: <b@example.net>\r\n\r\nbody\r\n", "no message"),
        (b"X-Sender: <a@example.org> FOO=1\r\nX-Receiver: <b@x.net>\r\nS: s\r\n\r\n", "FOO"),
        (b"X-Sender: <a@example.org>\r\nX-Receiver: <b>\r\nS: s\r\n\r\n", "fully qualified"),
        (b"X-Sender: <a@example.org>\r\nX-Receiver: <b@x.net> NOTIFY=NO\r\nS: s\r\n\r\n", "NOTIFY"),
        (
            "X-Sender: <jö@example.org>\r\nX-Receiver: <b@x.net>\r\nS: s\r\n\r\n".encode(),
            "SMTPUTF8",
        ),
    ],
    ids=["plain", "no-receiver", "no-message", "unknown-param", "no-domain", "bad-notify", "utf8"],
)
def test_it_refuses_a_malformed_replay_file(data, reason):
    with pytest.raises(BadFile) as caught:
        parse_replay(data)
    assert reason in caught.value.reason


def test_replay_format_round_trips_the_envelope_and_the_bytes():
    message = Message(
        mail_from="s@example.org",
        body_type="8BITMIME",
        smtputf8=True,
        ret="FULL",
        envid="ID+2B1",
        data=b"Received: by us\r\nSubject: x\r\n\r\nbody\r\n",
    )
    orcpt = "utf-8;a@ex\\x{E4}mple.net"
    recipients = [
        Recipient(address="a@exämple.net", notify="SUCCESS,DELAY", orcpt=orcpt),
        Recipient(address="b@example.net"),
    ]
    data = replay_format(message, recipients)
    assert data.startswith(
        b"X-Sender: <s@example.org> BODY=8BITMIME SMTPUTF8 RET=FULL ENVID=ID+2B1\r\n"
        + f"X-Receiver: <a@exämple.net> NOTIFY=SUCCESS,DELAY ORCPT={orcpt}\r\n".encode()
        + b"X-Receiver: <b@example.net>\r\n"
        + b"Received: by us\r\n"
    )
    env = parse_replay(data).envelope
    assert (env.mail_from, env.body_type, env.smtputf8, env.ret, env.envid) == (
        "s@example.org",
        "8BITMIME",
        True,
        "FULL",
        "ID+2B1",
    )
    assert [(r.address, r.notify, r.orcpt) for r in env.recipients] == [
        ("a@exämple.net", "SUCCESS,DELAY", orcpt),
        ("b@example.net", "", ""),
    ]
    assert parse_replay(data).data == bytes(message.data)


def test_replay_format_of_the_null_sender_and_of_no_recipient():
    bounce = Message(mail_from="", data=b"Subject: x\r\n\r\n")
    data = replay_format(bounce, [Recipient(address="a@example.net")])
    assert data.startswith(b"X-Sender: <>\r\n")
    assert parse_replay(data).envelope.mail_from == ""
    with pytest.raises(ValueError):
        replay_format(bounce, [])


def test_parse_pickup_is_pure_and_reports_reasons():
    sub = parse_pickup(GOOD, PickupLimits(), clock.now())
    assert sub.envelope.mail_from == "alice@example.org"
    assert normalize_line_endings(b"a\rb\nc\r\nd") == b"a\r\nb\r\nc\r\nd"
    with pytest.raises(BadFile, match="folded"):
        parse_pickup(b" folded first\r\nFrom: a@b.c\r\n\r\n", PickupLimits(), clock.now())


# ------------------------------------------------------------------- replay end to end


@pytest.fixture
def relay(dns_settings, settings, smtp_port):
    settings.MAILRELAY_REMOTE_SMTP_PORT = smtp_port
    settings.MAILRELAY_SMTP_CONNECT_TIMEOUT = timedelta(seconds=2)
    settings.MAILRELAY_SMTP_CLIENT_TIMEOUT = timedelta(seconds=5)
    return dns_settings


def test_a_suspended_message_exported_for_replay_is_delivered_with_its_envelope(
    relay, sink_factory, watcher, folders
):
    """The seed's path: suspend, export, copy into Replay — delivered end to end."""
    relay.a("example.net", "127.0.0.2")
    sink = sink_factory("127.0.0.2", dsn=True, rcpt_tempfail={"later@example.net": 1})
    original = message_accept(
        IncomingEnvelope(
            mail_from="s@example.org",
            recipients=[
                IncomingRecipient("done@example.net"),
                IncomingRecipient(
                    "later@example.net", notify="SUCCESS,FAILURE", orcpt="rfc822;later@example.net"
                ),
            ],
            body_type="8BITMIME",
            ret="HDRS",
            envid="ENV42",
            client_address="127.0.0.1",
            client_helo="client.test",
        ),
        b"From: s@example.org\r\nTo: later@example.net\r\nSubject: replay me\r\n\r\nbody\r\n",
    )
    drain()
    assert [m.rcpt_tos for m in sink.messages] == [["done@example.net"]]
    later = Recipient.objects.get(address="later@example.net")
    assert later.state == RecipientState.DEFERRED
    message_suspend(original, "admin", Via.CLI)

    exported = replay_format(
        original, original.recipients.exclude(state__in=FINAL_RECIPIENT_STATES).order_by("id")
    )
    drop(folders / "replay", f"{original.qid}.eml", exported)
    [outcome] = take(watcher("replay"))
    assert outcome.status == Outcome.SUBMITTED
    replayed = Message.objects.get(qid=outcome.qid)
    assert replayed.source == MessageSource.REPLAY
    assert (replayed.mail_from, replayed.body_type, replayed.ret, replayed.envid) == (
        "s@example.org",
        "8BITMIME",
        "HDRS",
        "ENV42",
    )
    assert list(replayed.recipients.values_list("address", "notify", "orcpt")) == [
        ("later@example.net", "SUCCESS,FAILURE", "rfc822;later@example.net")
    ]
    assert not list((folders / "replay").iterdir())

    drain()  # the destination takes it now
    delivered = sink.messages[-1]
    assert delivered.rcpt_tos == ["later@example.net"]
    assert delivered.mail_from == "s@example.org"
    assert {"RET=HDRS", "ENVID=ENV42", "BODY=8BITMIME"} <= set(delivered.mail_options)
    assert {"NOTIFY=SUCCESS,FAILURE", "ORCPT=rfc822;later@example.net"} <= set(
        delivered.rcpt_options[0]
    )
    assert delivered.data.endswith(bytes(original.data))  # the stored bytes, one more Received
    assert Recipient.objects.get(message=replayed).state == RecipientState.DELIVERED
    original.refresh_from_db()
    assert original.suspended  # the operator removes it (Exchange's note)
