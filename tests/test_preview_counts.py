"""Bulk actions say what they will do: the preview (the UI's confirmation, the
API's ``dry_run`` and the commands' ``--dry-run``) is computed by the action's
own queries, and its numbers are the numbers the action then produces.

For every action and every filter the operator tests use (test_actions,
test_operator_spec, test_api_messages, test_api_queues, test_cli), on a store
with a row in every state an action treats differently: rows changed,
recipients that fail, NDRs and their distinct senders, messages skipped because
they are in flight, recipients moved, messages waiting in the changed queues.
"""

from __future__ import annotations

import io
from datetime import timedelta

import pytest
from django.core.management import call_command

from queues.filters import MessageFilter, QueueFilter
from queues.holdings import HELD_STATES
from queues.lib import clock
from queues.models import (
    FINAL_RECIPIENT_STATES,
    WAITING_RECIPIENT_STATES,
    AuditEntry,
    DeliveryType,
    Link,
    Message,
    MessageSource,
    MessageState,
    Queue,
    Recipient,
    RecipientState,
)
from queues.services.actions import Via
from queues.spec import MESSAGE_ACTIONS, QUEUE_ACTIONS
from tests.support.operator_factories import api_client, make_message, make_queue, make_user

pytestmark = pytest.mark.django_db


def _set(message: Message, **fields) -> None:
    Message.objects.filter(pk=message.pk).update(**fields)


@pytest.fixture
def store():
    """A message in every case the bulk actions distinguish, with several senders,
    the null sender, NOTIFY=NEVER and a report (no NDR is owed for those)."""
    queue = make_queue("example.net")
    dead = make_queue("dead-letter", delivery_type=DeliveryType.DEAD_LETTER)
    poison = make_queue("poison", delivery_type=DeliveryType.POISON)
    unreachable = make_queue("nowhere.example", delivery_type=DeliveryType.UNREACHABLE)
    old = clock.now() - timedelta(days=1)
    m = {
        "ready": make_message("ready@example.net", queue=queue, sender="s1@example.org"),
        "ready2": make_message(
            "r2@example.net", "r3@example.net", queue=queue, sender="S1@example.org"
        ),
        "retry": make_message(
            "retry@example.net",
            queue=queue,
            rstate=RecipientState.DEFERRED,
            last_text="451 greylisted for 300s",
            sender="s2@example.org",
            received_at=old,
        ),
        "never": make_message("never@example.net", queue=queue, notify="NEVER"),
        "success_only": make_message("succ@example.net", queue=queue, notify="SUCCESS"),
        "suspended": make_message("held@example.net", queue=queue, received_at=old),
        "in_flight": make_message("busy@example.net", queue=queue, rstate=RecipientState.ACTIVE),
        "half_in_flight": make_message("a@example.net", "b@example.net", queue=queue),
        "submission": make_message("new@example.net", subject="only"),
        "categorizing": make_message("routing@example.net"),
        "delivered": make_message("done@example.net", queue=queue, rstate="delivered"),
        "dead_letter": make_message(
            "gone@example.net", queue=dead, rstate=RecipientState.FAILED, last_text="550 no user"
        ),
        "expired": make_message("late@example.net", queue=dead, rstate=RecipientState.EXPIRED),
        "poison": make_message("crash@example.net", queue=poison),
        "unreachable": make_message("x@nowhere.example", queue=unreachable, sender=""),
        "report": make_message("bounce@example.net", queue=queue, sender="mailer@example.org"),
    }
    _set(m["suspended"], suspended=True)
    _set(m["poison"], suspended=True, crash_count=2)
    _set(m["categorizing"], state=MessageState.CATEGORIZING)
    _set(m["expired"], state=MessageState.DONE, completed_at=clock.now())
    _set(m["report"], source=MessageSource.DSN)
    first = m["half_in_flight"].recipients.order_by("id").first()
    Recipient.objects.filter(pk=first.pk).update(state=RecipientState.ACTIVE)
    m["queue"] = queue
    return m


def _snapshot() -> tuple[dict[int, tuple], dict[int, tuple], set[int]]:
    messages = {
        m.pk: (m.state, m.suspended, m.suspended_until, m.expires_at)
        for m in Message.objects.defer("data")
    }
    recipients = {
        r.pk: (r.message_id, r.state, r.queue_id, r.next_attempt_at)
        for r in Recipient.objects.all()
    }
    return messages, recipients, set(messages)


def _in_flight(message_ids) -> set[int]:
    active = set(
        Recipient.objects.filter(
            message_id__in=message_ids, state=RecipientState.ACTIVE
        ).values_list("message_id", flat=True)
    )
    routing = set(
        Message.objects.filter(id__in=message_ids, state=MessageState.CATEGORIZING).values_list(
            "id", flat=True
        )
    )
    return active | routing


# Every message filter of the operator tests; "QUEUE" stands for the store's queue id.
MESSAGE_FILTER_CASES = [
    {},
    {"status": "failed"},
    {"status": "active"},
    {"status": "retry,ready"},
    {"status": "suspended"},
    {"status": "submission"},
    {"status": "delivered"},
    {"domain": "example.net"},
    {"error": "greylisted"},
    {"sender": "<>"},
    {"sender": "s1@"},
    {"older_than": "2h"},
    {"subject": "o"},
    {"queue": "QUEUE"},
]

MESSAGE_ACTION_CASES = [(name, {}) for name in MESSAGE_ACTIONS] + [("suspend", {"until": "2h"})]


@pytest.mark.parametrize("params", MESSAGE_FILTER_CASES, ids=lambda p: str(p) or "all")
@pytest.mark.parametrize(
    ("name", "options"), MESSAGE_ACTION_CASES, ids=lambda v: v if isinstance(v, str) else ""
)
def test_a_message_dry_run_says_exactly_what_the_action_then_does(store, name, options, params):
    params = {k: (str(store["queue"].pk) if v == "QUEUE" else v) for k, v in params.items()}
    spec = MESSAGE_ACTIONS[name]
    qs = MessageFilter.from_params(params).queryset()
    matched = set(qs.values_list("id", flat=True))
    preview = spec.dry_run(qs, **options)
    assert preview.count == spec.preview(qs)

    messages, recipients, before_ids = _snapshot()
    in_flight_before = _in_flight(matched)
    changed = spec.apply(qs, "tester", Via.API, filter=params, **options)
    after_messages, after_recipients, _ = _snapshot()

    changed_messages = {pk for pk in matched if after_messages.get(pk) != messages[pk]} | {
        rec[0]
        for pk, rec in recipients.items()
        if rec[0] in matched and after_recipients.get(pk) != rec
    }
    failed = [
        pk
        for pk, rec in recipients.items()
        if rec[1] != RecipientState.FAILED and after_recipients[pk][1] == RecipientState.FAILED
    ]
    moved = [
        pk
        for pk, rec in recipients.items()
        if rec[1] != RecipientState.SUBMITTED
        and after_recipients[pk][1] == RecipientState.SUBMITTED
    ]
    reports = Message.objects.exclude(id__in=before_ids).filter(source=MessageSource.DSN)
    report_to = {
        r.lower()
        for r in Recipient.objects.filter(message__in=reports).values_list("address", flat=True)
    }
    skipped_in_flight = (matched - changed_messages) & in_flight_before

    assert (preview.count, preview.matched) == (changed, len(matched))
    assert changed == len(changed_messages)
    assert AuditEntry.objects.get().count == changed
    assert preview.in_flight == len(skipped_in_flight)
    assert preview.failing == len(failed)
    assert (preview.ndrs, preview.ndr_senders) == (reports.count(), len(report_to))
    if spec.bulk_action == "resubmit":
        assert preview.recipients == len(moved)
    elif spec.bulk_action == "remove":
        assert preview.recipients == len(failed)
    else:  # suspend/resume hold or release the recipients not final
        held = Recipient.objects.filter(message__in=changed_messages).exclude(
            state__in=FINAL_RECIPIENT_STATES
        )
        assert preview.recipients == held.count()


def test_a_remove_with_ndr_names_its_consequences(store):
    qs = MessageFilter.from_params({"domain": "example.net"}).queryset()
    preview = MESSAGE_ACTIONS["remove_ndr"].dry_run(qs)
    # ready, ready2, retry, never, success_only, suspended, poison, report (+ submission)
    assert preview.in_flight == 3  # in_flight, half_in_flight, categorizing
    assert preview.failing == 10
    # s1 and S1 are one sender; NOTIFY=NEVER / SUCCESS, and the report, owe none
    assert (preview.ndrs, preview.ndr_senders) == (6, 3)
    lines = preview.lines("messages")
    assert "10 recipients will fail" in lines
    assert "6 non-delivery reports will go to 3 distinct senders" in lines


@pytest.fixture
def queues():
    """Queues in every state a queue action treats differently, one re-routed."""
    later = clock.now() + timedelta(hours=1)
    waiting_link = Link.objects.create(name="retry.example", created_at=clock.now())
    q = {
        "retry": make_queue("retry.example", link=waiting_link),
        "suspended": make_queue("held.example"),
        "empty": make_queue("empty.example"),
        "rerouted": make_queue("moved.example"),
        "unreachable": make_queue("nowhere.example", delivery_type=DeliveryType.UNREACHABLE),
        "poison": make_queue("poison", delivery_type=DeliveryType.POISON),
        "submission": make_queue("submission", delivery_type=DeliveryType.SUBMISSION),
    }
    Link.objects.filter(pk=waiting_link.pk).update(state="retry", next_retry_at=later)
    Queue.objects.filter(pk=q["suspended"].pk).update(suspended=True)
    QUEUE_ACTIONS["reroute"].run(q["rerouted"], "tester", Via.CLI, to="[127.0.0.9]:2525")
    for name in ("retry", "suspended", "unreachable", "poison", "rerouted"):
        message = make_message(f"u@{name}.example", queue=q[name])
        Recipient.objects.filter(message=message).update(next_attempt_at=later)
    AuditEntry.objects.all().delete()
    return q


def _queue_fingerprints() -> dict[int, tuple]:
    rows = {}
    for queue in Queue.objects.select_related("link").order_by("id"):
        waiting = tuple(
            Recipient.objects.filter(queue_id=queue.pk)
            .order_by("id")
            .values_list("state", "next_attempt_at")
        )
        link = queue.link.next_retry_at if queue.link_id else None
        rows[queue.pk] = (
            queue.suspended,
            queue.suspended_until,
            queue.link_id,
            queue.reroute_to,
            queue.reroute_until,
            link,
            waiting,
        )
    return rows


QUEUE_FILTER_CASES = [
    {},
    {"status": "suspended"},
    {"status": "retry"},
    {"status": "ready"},
    {"type": "dns_mx"},
    {"type": "unreachable,poison,submission"},
    {"name": "example"},
]

QUEUE_ACTION_CASES = [
    ("retry", {}),
    ("resubmit", {}),
    ("suspend", {}),
    ("suspend", {"until": "30m"}),
    ("resume", {}),
    ("reroute", {"to": "[127.0.0.9]:2525"}),
    ("reroute", {"to": "[127.0.0.8]:2525", "until": "2h"}),
    ("unroute", {}),
]


@pytest.mark.parametrize("params", QUEUE_FILTER_CASES, ids=lambda p: str(p) or "all")
@pytest.mark.parametrize(
    ("name", "options"), QUEUE_ACTION_CASES, ids=lambda v: v if isinstance(v, str) else ""
)
def test_a_queue_dry_run_says_exactly_what_the_action_then_does(queues, name, options, params):
    assert set(QUEUE_ACTIONS) == {n for n, _ in QUEUE_ACTION_CASES}
    spec = QUEUE_ACTIONS[name]
    qs = QueueFilter.from_params(params).queryset()
    preview = spec.dry_run(qs, **options)
    matched = qs.count()
    before = _queue_fingerprints()
    waiting = {
        pk: set(
            Recipient.objects.filter(queue_id=pk, state__in=WAITING_RECIPIENT_STATES).values_list(
                "message_id", flat=True
            )
        )
        for pk in before
    }
    changed = spec.apply(qs, "tester", Via.API, filter=params, **options)
    after = _queue_fingerprints()
    really = [pk for pk, fp in before.items() if after[pk] != fp]
    assert (preview.count, changed) == (len(really), len(really))
    assert preview.matched == matched
    assert preview.messages == len(set().union(*(waiting[pk] for pk in really)))
    assert AuditEntry.objects.get().count == changed


# --- the edges show the same numbers --------------------------------------------------


def test_the_api_dry_run_answers_the_preview_for_ids_and_filters(store):
    client = api_client(make_user("operator", "olga"))
    ids = [store[k].pk for k in ("ready", "ready2", "in_flight", "unreachable")]
    body = {"action": "remove", "ids": ids, "ndr": True, "dry_run": True}
    dry = client.post("/api/v1/messages/bulk/", body, format="json").json()
    assert (dry["count"], dry["confirmed"]) == (3, False)
    # The first messages it would touch (-WhatIf), oldest first, beside the counts.
    sample = dry["preview"].pop("sample")
    touched = sorted(store[k].pk for k in ("ready", "ready2", "unreachable"))
    assert [row["id"] for row in sample] == touched
    assert sample[1] == {
        "id": store["ready2"].pk,
        "qid": store["ready2"].qid,
        "sender": "S1@example.org",
        "recipients": ["r2@example.net", "r3@example.net"],
        "more_recipients": 0,
        "queues": ["example.net"],
        "age_seconds": sample[1]["age_seconds"],
    }
    assert 0 <= sample[1]["age_seconds"] < 60
    assert sample[2]["sender"] == "<>" and sample[2]["queues"] == ["nowhere.example"]
    assert dry["preview"] == {
        "action": "remove",
        "count": 3,
        "matched": 4,
        "skipped": 1,
        "in_flight": 1,
        "recipients": 4,
        "failing": 4,
        "ndrs": 2,  # the null sender is owed none
        "ndr_senders": 1,
        "messages": 0,
    }
    assert not AuditEntry.objects.exists()
    done = client.post("/api/v1/messages/bulk/", {**body, "dry_run": False}, format="json")
    assert done.json()["count"] == 3
    assert Message.objects.filter(source=MessageSource.DSN).count() == 2 + 1  # + the report


def test_the_commands_dry_run_prints_the_consequences(store):
    out = io.StringIO()
    call_command("message", "remove", "--domain", "example.net", "--ndr", stdout=out)
    lines = out.getvalue().splitlines()
    assert lines[0] == "remove would touch 9 messages; run again with --yes to do it"
    assert "  10 recipients will fail" in lines
    assert "  6 non-delivery reports will go to 3 distinct senders" in lines
    out = io.StringIO()
    call_command(
        "message", "remove", store["ready"].qid, store["in_flight"].qid, "--dry-run", stdout=out
    )
    assert out.getvalue().splitlines()[:2] == [
        "remove would touch 1 messages; run again without it",
        "  1 messages skipped (the action makes no sense in their state, 1 of them in flight "
        "right now)",
    ]
    out = io.StringIO()
    call_command(
        "queue", "reroute", "example.net", "--to", "[127.0.0.7]:2525", "--dry-run", stdout=out
    )
    waiting = Recipient.objects.filter(queue=store["queue"], state__in=WAITING_RECIPIENT_STATES)
    lines = out.getvalue().splitlines()
    held = list(
        Message.objects.filter(recipients__queue=store["queue"], recipients__state__in=HELD_STATES)
        .distinct()
        .order_by("id")
        .values_list("id", flat=True)
    )
    assert lines[:3] == [
        "reroute would touch 1 queues; run again without --dry-run to do it",
        f"  {waiting.values('message_id').distinct().count()} messages wait in those queues",
        f"  the first {len(held)} messages it would touch:",
    ]
    assert [line.split()[0] for line in lines[3:]] == [str(pk) for pk in held]
    assert not AuditEntry.objects.exists()


def test_the_ui_confirmation_lists_the_consequences(store, client):
    client.force_login(make_user("operator", "olga"))
    params = {"action": "remove_ndr", "domain": "example.net"}
    page = client.get("/messages/by-filter/", params)
    assert page.context["count"] == 9
    text = page.content.decode()
    assert "6 non-delivery reports will go to 3 distinct senders" in text
    assert (
        "6 messages skipped (the action makes no sense in their state, 3 of them in flight" in text
    )
