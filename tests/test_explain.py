"""Explain: why a recipient waits, for each reason, through the service, the API
and the CLI; the projected schedule is checked against the rule engine itself."""

from __future__ import annotations

import json
from datetime import timedelta
from io import StringIO

import pytest
from django.core.management import call_command

from delivery.models import ResourcePressure
from delivery.smtp import retry
from delivery.smtp.retryschedule import projected_schedule
from insight.explain import explain_message
from queues.lib import clock
from queues.models import (
    Attempt,
    LinkState,
    Message,
    MessageState,
    Recipient,
    RecipientState,
    RetryHint,
)
from tests.support.operator_factories import api_client, make_message, make_queue, make_user

pytestmark = pytest.mark.django_db


def _first(message: Message):
    return explain_message(message, clock.now()).recipients[0]


def test_a_suspended_message_says_by_whom_and_until_when():
    now = clock.now()
    q = make_queue("example.net")
    m = make_message("u@example.net", queue=q)
    until = now + timedelta(hours=2)
    Message.objects.filter(pk=m.pk).update(
        suspended=True, suspended_by="olga", suspended_until=until
    )
    m.refresh_from_db()
    x = _first(m)
    assert x.reason == "message_suspended"
    assert x.reasons[0].data == {"by": "olga", "until": until}
    assert "by olga" in x.reasons[0].text and until.isoformat() in x.reasons[0].text
    assert [(a.target, a.name) for a in x.actions] == [("message", "resume")]
    # The API and the CLI give the same answer.
    body = api_client(make_user("viewer")).get(f"/api/v1/messages/{m.pk}/explain/").json()
    assert body["recipients"][0]["reason"] == "message_suspended"
    assert body["recipients"][0]["reasons"][0]["data"]["by"] == "olga"
    by_qid = api_client(make_user("viewer", "v2")).get(f"/api/v1/messages/{m.qid}/explain/")
    assert by_qid.status_code == 200
    out = StringIO()
    call_command("message", "explain", m.qid, stdout=out)
    assert "message_suspended" in out.getvalue() and "by olga" in out.getvalue()


def test_a_suspended_queue_and_a_reroute_are_explained():
    q = make_queue("example.net", suspended=True, suspended_by="ops")
    q.reroute_to = "[10.0.0.9]:25"
    q.reroute_by = "ops"
    q.save()
    m = make_message("u@example.net", queue=q)
    x = _first(m)
    assert x.reason == "queue_suspended"
    assert "until resumed by hand" in x.reasons[0].text
    codes = [r.code for r in x.reasons]
    assert "rerouted" in codes
    rerouted = x.reasons[codes.index("rerouted")]
    assert "Re-routed to [10.0.0.9]:25" in rerouted.text and "by ops" in rerouted.text
    assert ("queue", "resume") in [(a.target, a.name) for a in x.actions]


def test_a_link_in_retry_gives_its_counter_rule_and_the_engine_schedule():
    now = clock.now()
    q = make_queue("down.example")
    first = now - timedelta(minutes=3)
    link = q.link
    link.state = LinkState.RETRY
    link.failure_count = 3
    link.first_failure_at = first
    link.next_retry_at = now + timedelta(minutes=1)
    link.last_error = "connection refused by 192.0.2.1:25"
    link.save()
    m = make_message("u@down.example", queue=q, rstate=RecipientState.DEFERRED)
    Recipient.objects.filter(message=m).update(next_attempt_at=link.next_retry_at)
    x = _first(m)
    assert x.reason == "link_retry"
    assert x.reasons[0].data["counter"] == "glitch"
    assert x.next_try_at == link.next_retry_at
    # The compiled Exchange rule, and the schedule the rule engine projects.
    rule = retry.rules().find("postmaster@down.example", host="down.example", error=None)
    assert x.rule["text"] == rule.text
    assert x.rule["source"] == "compiled from the Exchange settings"
    expected = [
        t.at for t in projected_schedule(rule, first, m.expires_at, options=retry.rules().options)
    ]
    tries = [s["at"] for s in x.schedule if s["kind"] == "retry"]
    assert tries and tries == [t for t in expected if t > now][: len(tries)]
    kinds = [s["kind"] for s in x.schedule]
    assert "delay_dsn" in kinds and kinds[-1] == "expires"
    delay = next(s["at"] for s in x.schedule if s["kind"] == "delay_dsn")
    assert delay == m.received_at + timedelta(hours=4)
    assert ("queue", "retry") in [(a.target, a.name) for a in x.actions]
    # Past the glitch retries, the transient counter.
    link.failure_count = 7
    link.save()
    assert _first(m).reasons[0].data["counter"] == "transient"


def test_a_host_skipped_by_its_retry_data_names_host_error_and_rule(settings, tmp_path):
    rules = tmp_path / "retry.conf"
    rules.write_text("# ours\n*.example  refused_MX  F,2h,10m; F,6h,1h\n")
    settings.MAILRELAY_RETRY_RULES = str(rules)
    now = clock.now()
    q = make_queue("hosts.example")
    m = make_message("u@hosts.example", queue=q)
    RetryHint.objects.create(
        key="T:hosts.example:192.0.2.7",
        first_failed=now - timedelta(minutes=20),
        last_tried=now - timedelta(minutes=5),
        next_try=now + timedelta(minutes=5),
        error="refused_MX",
        text="connection refused",
    )
    x = _first(m)
    host = next(r for r in x.reasons if r.code == "host_retry")
    assert host.data["host"] == "hosts.example"
    assert host.data["error"] == "refused_MX"
    assert host.data["rule"]["text"] == "*.example  refused_MX  F,2h,10m; F,6h,1h"
    assert host.data["rule"]["line"] == 2
    assert host.data["rule"]["source"] == str(rules)
    assert x.reason == "due"  # the other hosts may still be tried


def test_a_problem_message_and_its_rule_line_and_final_cutoff(settings, tmp_path):
    rules = tmp_path / "retry.conf"
    rules.write_text("*  rcpt_4xx  F,1h,15m\n")
    settings.MAILRELAY_RETRY_RULES = str(rules)
    now = clock.now()
    q = make_queue("busy.example")
    first = now - timedelta(minutes=20)
    m = make_message(
        "u@busy.example",
        queue=q,
        rstate=RecipientState.DEFERRED,
        first_failure_at=first,
        last_attempt_at=now - timedelta(minutes=5),
        last_code=452,
        last_text="mailbox busy",
    )
    Message.objects.filter(pk=m.pk).update(problem=True, per_message_failures=2)
    r = Recipient.objects.get(message=m)
    Recipient.objects.filter(pk=r.pk).update(next_attempt_at=now + timedelta(minutes=10))
    Attempt.objects.create(
        recipient=r,
        message=m,
        queue=q,
        started_at=now - timedelta(minutes=5),
        phase="rcpt",
        code=452,
        text="mailbox busy",
        outcome="deferred",
    )
    m.refresh_from_db()
    x = _first(m)
    assert x.reason == "problem_message"
    assert x.reasons[0].data["per_message_failures"] == 2
    assert x.rule["text"] == "*  rcpt_4xx  F,1h,15m" and x.rule["line"] == 1
    assert x.final_cutoff_at == first + timedelta(hours=1)
    rule = retry.rules().find("u@busy.example", error="rcpt_452", sender="a@example.org")
    expected = [t.at for t in projected_schedule(rule, first, m.expires_at) if t.at > now]
    assert [s["at"] for s in x.schedule if s["kind"] == "retry"] == expected
    assert {"final_cutoff", "expires"} <= {s["kind"] for s in x.schedule}
    assert x.last_reply["code"] == 452


def test_back_pressure_explains_a_message_waiting_in_submission():
    now = clock.now()
    m = make_message("u@example.net")
    assert m.state == MessageState.SUBMISSION
    ResourcePressure.objects.create(
        node="ingress-1",
        resource="submission_queue",
        reading=12000,
        level="high",
        normal=2000,
        medium=4000,
        high=10000,
        updated_at=now,
    )
    Message.objects.filter(pk=m.pk).update(next_attempt_at=now - timedelta(seconds=1))
    m.refresh_from_db()
    x = _first(m)
    assert x.reason == "backpressure"
    assert x.reasons[0].data["resources"][0]["node"] == "ingress-1"
    assert "submission_queue is high on ingress-1" in x.reasons[0].text
    assert x.reasons[1].code == "submission"


def test_in_flight_and_due_and_the_json_cli():
    now = clock.now()
    q = make_queue("example.net")
    m = make_message("u@example.net", "v@example.net", queue=q)
    first, second = Recipient.objects.filter(message=m).order_by("id")
    Recipient.objects.filter(pk=first.pk).update(
        state=RecipientState.ACTIVE, lease_owner="worker-7", lease_until=now + timedelta(seconds=20)
    )
    result = explain_message(m, now)
    assert [x.reason for x in result.recipients] == ["in_flight", "due"]
    assert result.recipients[0].reasons[0].data["worker"] == "worker-7"
    out = StringIO()
    call_command("message", "explain", str(m.pk), "--json", stdout=out)
    data = json.loads(out.getvalue())
    assert [r["reason"] for r in data["recipients"]] == ["in_flight", "due"]


def test_the_message_page_shows_the_explain_block(client):
    client.force_login(make_user("operator"))
    q = make_queue("example.net", suspended=True)
    m = make_message("u@example.net", queue=q)
    page = client.get(f"/messages/{m.pk}/").content.decode()
    assert 'id="explain"' in page
    assert 'data-reason="queue_suspended"' in page
    assert 'data-explain-action="queue-resume"' in page


def test_the_message_page_links_to_its_tracking_search(client):
    import html
    import re

    from queues.accept import IncomingEnvelope, IncomingRecipient, message_accept

    client.force_login(make_user("viewer"))
    env = IncomingEnvelope(
        mail_from="a@example.org",
        recipients=[IncomingRecipient("u@example.net")],
        client_address="127.0.0.1",
        client_helo="client.test",
    )
    message_accept(env, b"From: a@example.org\r\nSubject: t\r\n\r\nx\r\n")
    m = Message.objects.get()
    page = client.get(f"/messages/{m.pk}/").content.decode()
    href = html.unescape(re.search(r'<a href="([^"]+)" id="tracking-link"', page).group(1))
    assert href == f"/tracking/?qid={m.qid}"
    found = client.get(href)
    assert found.status_code == 200
    body = found.content.decode()
    assert m.qid in body and "received" in body


SHAPED = """
entries:
  - name: slow
    domain: shaped.test
    max_connections: 1
    max_message_rate: 2/min
"""


def test_a_link_held_by_a_shaping_rate_or_slot_is_explained(
    settings, tmp_path, broker, monkeypatch, smtp_port, sink_factory
):
    """A policy file, real Redis counters filled by real delivery rounds to a sink."""
    from delivery.shaping import gate, limiter

    path = tmp_path / "shaping.yaml"
    path.write_text(SHAPED)
    settings.MAILRELAY_SHAPING = str(path)
    settings.MAILRELAY_TRANSPORTS = f"shaped.test=[127.0.0.2]:{smtp_port}"
    gate.reset()
    gate._domains.clear()
    monkeypatch.setattr(gate, "ring_later", lambda link_id, s: None)
    sink = sink_factory("127.0.0.2")
    from tests.support.pipeline import drain

    started = clock.now()
    messages = [make_message(f"u{i}@shaped.test") for i in range(3)]  # in Submission
    drain()
    assert len(sink.messages) == 2  # 2/min: the third waits for the window
    waiting = Message.objects.get(pk=messages[2].pk)
    x = _first(waiting)
    assert x.reason == "shaping"
    shaped = x.reasons[0]
    next_at = shaped.data["next_at"]
    assert abs((next_at - (started + timedelta(minutes=1))).total_seconds()) < 5
    assert shaped.text == (
        f"Waiting for the shaping limit of entry slow (2/min), next at {next_at.isoformat()}."
    )
    assert (shaped.data["limit"], shaped.data["in_use"], shaped.data["allowed"]) == (
        "message rate",
        2,
        2,
    )
    body = api_client(make_user("viewer")).get(f"/api/v1/messages/{waiting.pk}/explain/").json()
    assert body["recipients"][0]["reason"] == "shaping"
    assert "entry slow (2/min)" in body["recipients"][0]["reasons"][0]["text"]
    # The window frees: no longer shaping, just due.
    clock.advance(timedelta(seconds=61))
    assert _first(waiting).reason == "due"
    # A connection slot held by another round (here: its lease for 5 minutes).
    lim = limiter.limiter()
    link = Recipient.objects.get(message=waiting).queue.link
    scope = gate.scope_of(gate.entry_for(link, gate.current()), link.pk)
    held = lim.acquire(
        scope,
        now=clock.now().timestamp(),
        lease=300,
        token="other-round",
        max_connections=1,
        messages_per_connection=1,
        want=1,
        message_rate=None,
        connection_rate=None,
        waiter="0",
    )
    assert held.connections == 1
    x = _first(waiting)
    assert x.reason == "shaping" and x.reasons[0].data["limit"] == "connections"
    assert "entry slow (1 connection at once), next at" in x.reasons[0].text
    lease_end = x.reasons[0].data["next_at"]
    assert abs((lease_end - clock.now() - timedelta(minutes=5)).total_seconds()) < 2
    # Without the policy file nothing is shaped (and Redis is not asked).
    settings.MAILRELAY_SHAPING = ""
    gate.reset()
    assert _first(waiting).reason == "due"
    gate.reset()
