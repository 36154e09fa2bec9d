"""The management commands ``queue`` and ``message``: same filters, same actions,
audited with via="cli"."""

import io
import json
import zipfile
from datetime import timedelta

import pytest
from django.core.management import CommandError, call_command

from queues.lib import clock
from queues.models import AuditEntry, DeliveryType, Message, Queue, RecipientState
from tests.support.operator_factories import make_message, make_queue, make_user, rstates
from tests.support.pipeline import drain

pytestmark = pytest.mark.django_db


def run(*args) -> str:
    out = io.StringIO()
    call_command(*args, stdout=out, stderr=io.StringIO())
    return out.getvalue()


def test_queue_list_shows_each_queue_with_status_and_count():
    queue = make_queue("example.net")
    Queue.objects.filter(pk=queue.pk).update(suspended=True)
    for i in range(7):
        make_message(f"u{i}@example.net", queue=queue)
    make_queue("other.example")
    out = run("queue", "list")
    lines = out.splitlines()
    assert lines[0].split()[:5] == ["ID", "NAME", "TYPE", "STATUS", "MSGS"]
    assert lines[1].split()[1:5] == ["example.net", "dns_mx", "suspended", "7"]
    assert run("queue", "list", "--status", "ready").count("other.example") == 1
    rows = [json.loads(line) for line in run("queue", "list", "--json").splitlines()]
    assert {r["name"] for r in rows} == {"example.net", "other.example"}


def test_queue_actions_by_name_or_id_are_audited_as_cli():
    queue = make_queue("example.net")
    make_message("u@example.net", queue=queue)
    assert "suspend: example.net (1 messages)" in run("queue", "suspend", "example.net")
    run("queue", "resume", str(queue.pk), "--user", make_user("operator", "olga").username)
    run("queue", "retry", "example.net")
    run("queue", "resubmit", "example.net")
    entries = list(AuditEntry.objects.order_by("id").values_list("action", "via", "actor_name"))
    assert [e[0] for e in entries] == [
        "queue_suspend",
        "queue_resume",
        "queue_retry",
        "queue_resubmit",
    ]
    assert {e[1] for e in entries} == {"cli"}
    assert entries[1][2] == "olga"


def test_a_queue_action_that_makes_no_sense_fails_with_the_reason():
    make_queue("example.net")
    err = io.StringIO()
    with pytest.raises(CommandError, match="some queues were not changed"):
        call_command("queue", "resume", "example.net", stdout=io.StringIO(), stderr=err)
    assert "example.net: queue example.net is not suspended" in err.getvalue()
    with pytest.raises(CommandError, match="no queue named 'nowhere'"):
        run("queue", "suspend", "nowhere")


def test_an_ambiguous_queue_name_asks_for_an_id():
    first = make_queue("dup.example")
    make_queue("dup.example", delivery_type=DeliveryType.SMART_HOST, link=first.link)
    with pytest.raises(CommandError, match="several queues are named"):
        run("queue", "suspend", "dup.example")


def test_message_list_filters_like_the_api_and_pages_by_cursor():
    queue = make_queue()
    for i in range(3):
        make_message(f"u{i}@example.net", queue=queue, sender=f"s{i}@example.org")
    make_message("x@other.example")
    out = run("message", "list", "--domain", "example.net", "--limit", "2")
    lines = out.splitlines()
    assert len(lines) == 4 and lines[-1].startswith("more: --cursor ")
    cursor = lines[-1].split()[-1]
    rest = run("message", "list", "--domain", "example.net", "--cursor", cursor)
    assert "u0@example.net" in rest and "more:" not in rest
    rows = [json.loads(x) for x in run("message", "list", "--sender", "s1@", "--json").splitlines()]
    assert [r["recipients"] for r in rows] == [["u1@example.net"]]
    with pytest.raises(CommandError, match="status: 'lost'"):
        run("message", "list", "--status", "lost")


def test_message_show_prints_envelope_recipients_and_attempts():
    message = make_message(
        "u@example.net",
        queue=make_queue(),
        rstate=RecipientState.DEFERRED,
        last_text="mailbox busy",
        last_code=450,
        last_enhanced="4.2.1",
    )
    out = run("message", "show", message.qid)
    assert f"message {message.qid} (id {message.pk}): retry" in out
    assert "from      <a@example.org>" in out
    assert "u@example.net  deferred  queue example.net" in out
    assert "last: 450 4.2.1 mailbox busy" in out
    data = json.loads(run("message", "show", str(message.pk), "--json"))
    assert data["qid"] == message.qid


def test_message_actions_on_one_message_and_their_conflicts():
    message = make_message("u@example.net", queue=make_queue())
    run("message", "suspend", message.qid)
    assert Message.objects.get(pk=message.pk).suspended
    with pytest.raises(CommandError, match="already suspended"):
        run("message", "suspend", message.qid)
    run("message", "resume", message.qid)
    run("message", "resubmit", str(message.pk))
    assert Message.objects.get(pk=message.pk).state == "submission"
    run("message", "remove", message.qid)
    assert rstates(message) == [RecipientState.FAILED]
    actions = list(AuditEntry.objects.order_by("id").values_list("action", "via"))
    assert actions == [
        ("message_suspend", "cli"),
        ("message_resume", "cli"),
        ("message_resubmit", "cli"),
        ("message_remove", "cli"),
    ]


def test_a_filter_action_counts_first_and_acts_with_yes():
    queue = make_queue()
    for i in range(3):
        make_message(f"u{i}@example.net", queue=queue, received_at=clock.now() - timedelta(days=1))
    make_message("new@example.net", queue=queue)
    out = run("message", "suspend", "--older-than", "2h")
    lines = out.strip().splitlines()
    assert lines[0] == "suspend would touch 3 messages; run again with --yes to do it"
    # The first messages it would touch (-WhatIf), oldest first: id, qid, age, queue, envelope.
    assert lines[1] == "  the first 3 messages it would touch:"
    assert [line.split()[1] for line in lines[2:]] == list(
        Message.objects.exclude(recipients__address="new@example.net")
        .order_by("id")
        .values_list("qid", flat=True)
    )
    assert all("1d example.net" in line and "<a@example.org> → u" in line for line in lines[2:])
    assert not Message.objects.filter(suspended=True).exists()
    assert "suspend: 3 messages changed" in run("message", "suspend", "--older-than", "2h", "--yes")
    assert AuditEntry.objects.get().filter == {"older_than": "2h"}
    with pytest.raises(CommandError, match="give message ids or at least one filter"):
        run("message", "suspend", "--yes")


def test_remove_with_ndr_from_the_command_line_queues_the_report():
    message = make_message("u@example.net", queue=make_queue())
    run("message", "remove", message.qid, "--ndr")
    assert Message.objects.exclude(pk=message.pk).get().source == "dsn"


def test_export_writes_exactly_the_stored_bytes(tmp_path):
    message = make_message("u@example.net", text="caf\xe9\r\n")
    target = tmp_path / "m.eml"
    run("message", "export", message.qid, "-o", str(target))
    assert target.read_bytes() == bytes(message.data)
    out = run("message", "export", message.qid)
    assert out.encode("latin-1") == bytes(message.data)


def test_export_of_a_filter_writes_a_zip(tmp_path):
    a = make_message("u@example.net")
    make_message("v@other.example")
    target = tmp_path / "out.zip"
    run("message", "export", "--domain", "example.net", "--zip", str(target))
    archive = zipfile.ZipFile(target)
    assert archive.namelist() == [f"{a.qid}.eml"]
    assert archive.read(f"{a.qid}.eml") == bytes(a.data)


def test_a_message_resumed_from_the_command_line_is_delivered(
    dns_settings, settings, smtp_port, sink_factory
):
    settings.MAILRELAY_REMOTE_SMTP_PORT = smtp_port
    dns_settings.a("example.net", "127.0.0.2")
    sink = sink_factory("127.0.0.2")
    message = make_message("u@example.net")
    run("message", "suspend", message.qid)
    drain()
    assert not sink.messages
    run("message", "resume", message.qid)
    drain()
    assert len(sink.messages) == 1
    assert sink.messages[0].data == bytes(message.data)
