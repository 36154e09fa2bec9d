"""Message tracking: a row per event of a message's life, kept after the message
is purged, searchable from the API, the UI and ``manage.py track``; the JSON
event log. The engine runs in-process against real sinks and the loopback DNS
server (tests/support/pipeline.drain), with the movable clock."""

from __future__ import annotations

import io
import json
from datetime import timedelta

import pytest
from django.core.management import call_command
from django.db import connection
from django.test import Client

from delivery.qmgr.sweep import sweep
from delivery.smtp.outcome import remote_queue_id
from queues.accept import IncomingEnvelope, IncomingRecipient, message_accept
from queues.lib import clock
from queues.models import Message, Recipient
from queues.services import actions
from tests.support.history import history
from tests.support.operator_factories import make_user
from tests.support.pipeline import drain
from tracking import eventlog, partitions
from tracking.models import TrackingEvent

pytestmark = pytest.mark.django_db

BODY = b"From: a@example.org\r\nTo: x\r\nMessage-ID: <m1@example.org>\r\nSubject: t\r\n\r\nhi\r\n"


def accept(*rcpts: str, sender: str = "a@example.org", body: bytes = BODY) -> Message:
    env = IncomingEnvelope(
        mail_from=sender,
        recipients=[IncomingRecipient(r) for r in rcpts],
        client_address="192.0.2.7",
        client_helo="client.test",
    )
    return message_accept(env, body)


def events(qid: str) -> list[str]:
    return [row.event for row in history(qid=qid)]


@pytest.fixture
def relay(dns_settings, settings, smtp_port):
    settings.MAILRELAY_REMOTE_SMTP_PORT = smtp_port
    settings.MAILRELAY_SMTP_CONNECT_TIMEOUT = timedelta(seconds=2)
    settings.MAILRELAY_SMTP_CLIENT_TIMEOUT = timedelta(seconds=5)
    dns_settings.a("example.net", "127.0.0.2")
    return dns_settings


def test_it_records_a_delivered_message_with_the_remote_queue_id(relay, sink_factory):
    sink_factory("127.0.0.2", data_reply="250 2.0.0 Ok: queued as 4Xyz")
    message = accept("bob@example.net")
    drain()
    assert events(message.qid) == ["received", "routed", "delivered"]
    received, routed, delivered = history(qid=message.qid)
    assert (received.client, received.size, received.sender) == (
        "192.0.2.7",
        message.size,
        "a@example.org",
    )
    assert received.message_id == "<m1@example.org>"
    assert (routed.recipient, routed.queue) == ("bob@example.net", "example.net")
    assert routed.next_hop
    assert (delivered.host, delivered.ip, delivered.code) == ("example.net", "127.0.0.2", 250)
    assert delivered.reply == "250 2.0.0 Ok: queued as 4Xyz"
    assert delivered.remote_id == "4Xyz"


def test_a_deferred_then_delivered_message_has_both_attempts(relay, sink_factory):
    sink_factory("127.0.0.2", rcpt_tempfail={"slow@example.net": 1})
    message = accept("slow@example.net")
    drain()
    clock.advance(timedelta(minutes=2))
    drain()
    assert events(message.qid) == ["received", "routed", "deferred", "delivered"]
    deferred = TrackingEvent.objects.get(qid=message.qid, event="deferred")
    assert deferred.code == 450 and deferred.enhanced == "4.2.1"
    assert deferred.recipient == "slow@example.net"


def test_a_bounced_message_has_its_failure_and_the_dsn(relay, sink_factory):
    sink_factory("127.0.0.2", rcpt_replies={"nobody@example.net": "550 5.1.1 no such user"})
    message = accept("nobody@example.net")
    drain()
    assert events(message.qid) == ["received", "routed", "failed", "dsn_sent"]
    failed = TrackingEvent.objects.get(qid=message.qid, event="failed")
    assert (failed.code, failed.enhanced) == (550, "5.1.1")
    dsn = TrackingEvent.objects.get(qid=message.qid, event="dsn_sent")
    assert dsn.detail["kind"] == "failure" and dsn.detail["dsn_qid"]
    # The DSN itself is a message with its own life.
    assert "received" in events(dsn.detail["dsn_qid"])


def test_rows_outlive_the_purged_message_and_stay_searchable(relay, sink_factory, settings):
    sink_factory("127.0.0.2", data_reply="250 2.0.0 Ok: queued as 7Abc")
    message = accept("bob@example.net")
    drain()
    clock.advance(settings.MAILRELAY_COMPLETED_RETENTION + timedelta(minutes=1))
    sweep()
    assert not Message.objects.filter(pk=message.pk).exists()
    out = io.StringIO()
    call_command("track", "--recipient", "BOB@example.net", "--since", "2d", stdout=out)
    lines = out.getvalue().splitlines()
    assert len(lines) == 3 and "delivered" in lines[0] and "remote_id=7Abc" in lines[0]
    assert " routed " in lines[1] and " received " in lines[2]
    out = io.StringIO()
    call_command("track", "--message-id", "m1@example.org", "--json", stdout=out)
    rows = [json.loads(line) for line in out.getvalue().splitlines()]
    assert {r["event"] for r in rows} == {"received", "routed", "delivered"}
    assert {r["qid"] for r in rows} == {message.qid}
    out = io.StringIO()
    call_command("track", "--remote-id", "7Abc", "--event", "delivered", stdout=out)
    assert message.qid in out.getvalue()


def test_expiry_and_operator_actions_are_events(relay, sink_factory, settings):
    sink_factory("127.0.0.2", rcpt_tempfail={"slow@example.net": 100})
    message = accept("slow@example.net", sender="")
    drain()
    operator = make_user("operator", "olga")
    actions.message_suspend(Message.objects.get(pk=message.pk), operator, "cli")
    row = TrackingEvent.objects.get(qid=message.qid, event="operator")
    assert (row.actor, row.detail["action"], row.detail["via"]) == (
        "olga",
        "message_suspend",
        "cli",
    )
    clock.advance(settings.MAILRELAY_MESSAGE_EXPIRATION_TIMEOUT + timedelta(minutes=1))
    sweep()
    expired = TrackingEvent.objects.get(qid=message.qid, event="expired")
    assert expired.recipient == "slow@example.net" and "expired" in expired.reply
    # The queue it names is the one the recipient is in now.
    assert expired.queue == Recipient.objects.get(address="slow@example.net").queue.name


def test_the_api_searches_and_hides_message_ids_from_viewers(relay, sink_factory):
    sink_factory("127.0.0.2")
    message = accept("bob@example.net", "carol@example.net")
    other = accept("dave@example.net", sender="z@example.org")
    drain()
    operator, viewer = Client(), Client()
    operator.force_login(make_user("operator", "olga"))
    viewer.force_login(make_user("viewer", "vera"))
    page = operator.get("/api/v1/tracking/", {"sender": "A@Example.org", "limit": 3}).json()
    assert len(page["results"]) == 3 and page["next"]
    rest = operator.get(page["next"]).json()
    seen = page["results"] + rest["results"]
    assert {r["qid"] for r in seen} == {message.qid}
    assert len(seen) == 1 + 2 + 2  # received, routed ×2, delivered ×2
    assert [r["at"] for r in seen] == sorted((r["at"] for r in seen), reverse=True)
    by_msgid = operator.get("/api/v1/tracking/", {"message_id": "<m1@example.org>"}).json()
    assert {r["qid"] for r in by_msgid["results"]} == {message.qid, other.qid}
    assert viewer.get("/api/v1/tracking/", {"message_id": "m1@example.org"}).status_code == 403
    rows = viewer.get("/api/v1/tracking/", {"qid": other.qid, "event": "delivered"}).json()
    assert [r["recipient"] for r in rows["results"]] == ["dave@example.net"]
    assert "message_id" not in rows["results"][0]
    assert operator.get("/api/v1/tracking/", {"event": "nope"}).status_code == 400
    assert operator.get("/api/v1/tracking/", {"since": "yesterday-ish"}).status_code == 400
    html = viewer.get("/tracking/", {"recipient": "dave@example.net"}).content.decode()
    assert other.qid in html and 'data-event="delivered"' in html
    assert Client().get("/api/v1/tracking/").status_code == 401


def test_the_event_log_has_one_json_line_per_event(
    relay, sink_factory, settings, tmp_path, django_capture_on_commit_callbacks
):
    settings.MAILRELAY_EVENT_LOG = str(tmp_path / "events.jsonl")
    sink_factory("127.0.0.2", data_reply="250 2.0.0 Ok: queued as 9Q")
    with django_capture_on_commit_callbacks(execute=True):
        message = accept("bob@example.net")
        drain()
    eventlog.flush()
    lines = [json.loads(x) for x in (tmp_path / "events.jsonl").read_text().splitlines()]
    mine = [x for x in lines if x["qid"] == message.qid]
    assert [x["event"] for x in mine] == ["received", "routed", "delivered"]
    stored = {str(row.event_id) for row in history(qid=message.qid)}
    assert {x["event_id"] for x in mine} == stored
    assert set(mine[0]) == {"v", "event_id", "at", "event", *eventlog.FIELDS}
    assert mine[2]["remote_id"] == "9Q" and mine[2]["at"].endswith("Z")


def test_nothing_is_logged_for_a_transaction_that_rolled_back(
    settings, tmp_path, django_capture_on_commit_callbacks
):
    from django.db import transaction

    from tracking import record

    settings.MAILRELAY_EVENT_LOG = str(tmp_path / "events.jsonl")
    with django_capture_on_commit_callbacks(execute=True) as callbacks:
        with pytest.raises(RuntimeError), transaction.atomic():
            record.write([record.new("received", clock.now(), qid="X1")])
            raise RuntimeError
        record.write([record.new("received", clock.now(), qid="X2")])
    assert len(callbacks) == 1
    eventlog.flush()
    lines = [json.loads(x) for x in (tmp_path / "events.jsonl").read_text().splitlines()]
    assert [x["qid"] for x in lines] == ["X2"]
    assert not TrackingEvent.objects.filter(qid="X1").exists()


def _append_lines(path: str, tag: int, count: int) -> None:
    writer = eventlog._Writer(path)
    writer.put([json.dumps({"tag": tag, "i": i, "pad": "x" * 3000}) + "\n" for i in range(count)])
    writer.flush()


def test_lines_of_several_processes_appending_to_one_file_never_interleave(tmp_path):
    import multiprocessing
    from pathlib import Path

    path = str(tmp_path / "shared.jsonl")
    context = multiprocessing.get_context("fork")
    workers = [context.Process(target=_append_lines, args=(path, t, 400)) for t in range(4)]
    for w in workers:
        w.start()
    for w in workers:
        w.join(30)
        assert w.exitcode == 0
    lines = [json.loads(x) for x in Path(path).read_text(encoding="utf-8").splitlines()]
    assert sorted((x["tag"], x["i"]) for x in lines) == [
        (t, i) for t in range(4) for i in range(400)
    ]


def test_lines_queued_at_a_normal_exit_are_written(tmp_path):
    import subprocess
    import sys
    from pathlib import Path

    path = tmp_path / "exit.jsonl"
    script = (
        "from django.conf import settings\n"
        f"settings.configure(MAILRELAY_EVENT_LOG={str(path)!r})\n"
        "from tracking import eventlog\n"
        "eventlog.emit([f'{{\"i\": {i}}}\\n' for i in range(50000)])\n"
    )
    root = Path(__file__).resolve().parent.parent
    subprocess.run([sys.executable, "-c", script], cwd=root, check=True, timeout=60)
    assert len(path.read_text().splitlines()) == 50000


@pytest.mark.parametrize(
    ("reply", "expected"),
    [
        ("2.0.0 Ok: queued as 4Xyz", "4Xyz"),
        ("OK id=1kAbCd-000123-AB", "1kAbCd-000123-AB"),
        ("2.6.0 <x@y> [InternalId=1234567, Hostname=ex] Queued mail for delivery", "1234567"),
        ("2.0.0 OK  1700000000 a1-20020a17090a0c0100b002 - gsmtp", "a1-20020a17090a0c0100b002"),
        ("2.0.0 xAB12345 Message accepted for delivery", "xAB12345"),
        ("2.0.0 Ok", ""),
    ],
)
def test_it_reads_the_remote_queue_id_of_common_servers(reply, expected):
    assert remote_queue_id(reply) == expected


def test_day_partitions_are_made_ahead_and_dropped_after_retention():
    assert connection.vendor == "postgresql"
    now = clock.now()
    from tracking import record

    # A row far ahead lands in the default partition, and moves into its day's
    # partition when that is made.
    later = now + timedelta(days=partitions.DAYS_AHEAD + 5)
    record.write([record.new("received", later, qid="AHEAD")])
    report = partitions.maintain(later - timedelta(days=2), timedelta(days=30))
    assert partitions.partition_name(later.date()) in report.created
    with connection.cursor() as cur:
        cur.execute(
            f"SELECT count(*) FROM {partitions.partition_name(later.date())} WHERE qid = 'AHEAD'"
        )
        assert cur.fetchone()[0] == 1
    assert TrackingEvent.objects.filter(qid="AHEAD").count() == 1
    # Retention: whole days past it are dropped, rows of the default partition pruned.
    record.write([record.new("received", now - timedelta(days=400), qid="OLD")])
    report = partitions.maintain(later, timedelta(days=5))
    assert partitions.partition_name(now.date()) in report.dropped
    assert report.pruned == 1
    assert not TrackingEvent.objects.filter(qid="OLD").exists()
    assert TrackingEvent.objects.filter(qid="AHEAD").exists()


def test_a_search_by_recipient_finds_the_received_event_of_its_message(relay, sink_factory):
    sink_factory("127.0.0.2")
    message = accept("bob@example.net", "carol@example.net")
    other = accept("dave@example.net")
    drain()
    operator = Client()
    operator.force_login(make_user("operator", "olga"))
    rows = operator.get("/api/v1/tracking/", {"recipient": "Bob@Example.net"}).json()["results"]
    assert [(r["qid"], r["event"], r["recipient"]) for r in reversed(rows)] == [
        (message.qid, "received", ""),
        (message.qid, "routed", "bob@example.net"),
        (message.qid, "delivered", "bob@example.net"),
    ]
    received = operator.get(
        "/api/v1/tracking/", {"recipient": "dave@example.net", "event": "received"}
    ).json()["results"]
    assert [r["qid"] for r in received] == [other.qid]
    out = io.StringIO()
    call_command("track", "--recipient", "carol@example.net", stdout=out)
    assert "received" in out.getvalue()
