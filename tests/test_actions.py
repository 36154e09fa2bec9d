"""Operator actions (queues.services.actions): what each changes, what it refuses,
what it writes to the audit log, and that the work it makes gets delivered.

The end-to-end tests drive the real engine in-process (tests/support/pipeline)
against the loopback DNS server and real SMTP sinks.
"""

import io
import sys
import types
import zipfile
from datetime import timedelta

import pytest

from delivery.qmgr.tasks import categorize_pending
from queues.lib import clock
from queues.models import (
    AuditEntry,
    DeliveryType,
    Link,
    LinkState,
    Message,
    MessageState,
    Queue,
    Recipient,
    RecipientState,
)
from queues.services import actions
from queues.services.actions import ActionConflict, ActionTooLarge, Via
from tests.support.operator_factories import make_message, make_queue, make_user, rstates
from tests.support.pipeline import drain

pytestmark = pytest.mark.django_db


@pytest.fixture
def relay(dns_settings, settings, smtp_port):
    settings.MAILRELAY_REMOTE_SMTP_PORT = smtp_port
    settings.MAILRELAY_SMTP_CONNECT_TIMEOUT = timedelta(seconds=2)
    settings.MAILRELAY_SMTP_CLIENT_TIMEOUT = timedelta(seconds=5)
    dns_settings.a("example.net", "127.0.0.2")
    return dns_settings


@pytest.fixture
def operator():
    return make_user("operator", "olga")


@pytest.fixture
def fake_notify(monkeypatch):
    """Stands in for queues.bounce.notify (the lead's DSN module) and records calls."""
    calls = []
    module = types.ModuleType("queues.bounce.notify")
    module.ndr_for = lambda message_id, recipient_ids: calls.append((message_id, recipient_ids))
    monkeypatch.setitem(sys.modules, "queues.bounce.notify", module)
    return calls


def accepted_and_queued(*rcpts):
    message = make_message(*rcpts)
    while categorize_pending():
        pass
    message.refresh_from_db()
    return message


def snapshot():
    """Everything an action may change, to prove a refused one changed nothing."""
    return (
        list(Message.objects.order_by("id").values_list("state", "suspended", "next_attempt_at")),
        list(Recipient.objects.order_by("id").values_list("state", "queue_id", "next_attempt_at")),
        list(Queue.objects.order_by("id").values_list("suspended")),
        list(Link.objects.order_by("id").values_list("next_retry_at")),
        AuditEntry.objects.count(),
    )


# --- queues: suspend, resume, retry, resubmit ------------------------------------------


def test_a_suspended_queue_delivers_nothing_and_resuming_it_delivers(
    relay, sink_factory, operator, bells, django_capture_on_commit_callbacks
):
    sink = sink_factory("127.0.0.2")
    accepted_and_queued("u@example.net")
    queue = Queue.objects.get(name="example.net")
    actions.queue_suspend(queue, operator, Via.UI)
    drain()
    assert not sink.messages
    assert queue.suspended
    bells.links.clear()
    with django_capture_on_commit_callbacks(execute=True):
        actions.queue_resume(queue, operator, Via.UI)
    assert bells.links == [queue.link_id]
    drain()
    assert len(sink.messages) == 1
    assert not Queue.objects.get(pk=queue.pk).suspended


def test_retry_now_overrides_the_link_retry_time_and_delivers(
    relay, sink_factory, operator, bells, django_capture_on_commit_callbacks
):
    accepted_and_queued("u@example.net")
    drain()  # nothing listens: the link goes into Retry
    link = Link.objects.get()
    assert link.state == LinkState.RETRY and link.next_retry_at > clock.now()
    sink = sink_factory("127.0.0.2")
    drain()
    assert not sink.messages  # waits for its retry time
    bells.links.clear()
    with django_capture_on_commit_callbacks(execute=True):
        count = actions.queue_retry(Queue.objects.get(name="example.net"), operator, Via.API)
    assert count == 1
    assert bells.links == [link.pk]
    assert Link.objects.get().next_retry_at is None
    drain()
    assert len(sink.messages) == 1
    assert Link.objects.get().state == LinkState.READY


def test_retry_now_that_fails_again_restarts_the_retry_timer(relay, operator):
    accepted_and_queued("u@example.net")
    drain()
    clock.advance(timedelta(seconds=20))
    actions.queue_retry(Queue.objects.get(name="example.net"), operator, Via.API)
    drain()  # still nothing listening
    link = Link.objects.get()
    assert link.state == LinkState.RETRY
    assert link.next_retry_at > clock.now()
    assert link.failure_count == 2


def test_resubmit_routes_the_queue_again_and_delivers_to_the_new_route(
    relay, sink_factory, operator, bells, django_capture_on_commit_callbacks
):
    relay.remove("example.net")
    relay.mx("example.net", [(10, "old.example.net")])
    relay.a("old.example.net", "127.0.0.3")  # nothing listens there
    message = accepted_and_queued("u@example.net")
    drain()
    old_queue = Queue.objects.get(name="example.net")
    relay.mx("example.net", [(10, "new.example.net")])
    relay.a("new.example.net", "127.0.0.2")
    sink = sink_factory("127.0.0.2")
    with django_capture_on_commit_callbacks(execute=True):
        assert actions.queue_resubmit(old_queue, operator, Via.CLI) == 1
    assert bells.categorizer == 1
    r = Recipient.objects.get()
    assert (r.state, r.queue_id) == (RecipientState.SUBMITTED, None)
    assert Message.objects.get(pk=message.pk).state == MessageState.SUBMISSION
    drain()
    assert len(sink.messages) == 1
    assert Recipient.objects.get().state == RecipientState.DELIVERED


def test_retrying_unreachable_routes_its_messages_again_now(relay, operator):
    unreachable = make_queue("Unreachable", delivery_type=DeliveryType.UNREACHABLE)
    message = make_message("u@example.net", queue=unreachable, rstate=RecipientState.DEFERRED)
    Recipient.objects.update(next_attempt_at=clock.now() + timedelta(hours=1))
    actions.queue_retry(unreachable, operator, Via.UI)
    assert rstates(message) == [RecipientState.SUBMITTED]
    assert Message.objects.get(pk=message.pk).state == MessageState.SUBMISSION


@pytest.mark.parametrize(
    ("setup", "service", "text"),
    [
        (lambda q: None, actions.queue_resume, "is not suspended"),
        (
            lambda q: Queue.objects.filter(pk=q.pk).update(suspended=True),
            actions.queue_suspend,
            "already suspended",
        ),
        (
            lambda q: Queue.objects.filter(pk=q.pk).update(suspended=True),
            actions.queue_retry,
            "is suspended",
        ),
        (
            lambda q: Recipient.objects.update(state=RecipientState.DELIVERED),
            actions.queue_retry,
            "no messages waiting",
        ),
        (
            lambda q: Recipient.objects.update(state=RecipientState.ACTIVE),
            actions.queue_resubmit,
            "no messages waiting",
        ),
    ],
    ids=[
        "resume-not-suspended",
        "suspend-twice",
        "retry-suspended",
        "retry-empty",
        "resubmit-nothing-waiting",
    ],
)
def test_a_queue_action_that_makes_no_sense_is_refused_and_changes_nothing(
    operator, setup, service, text
):
    queue = make_queue()
    make_message("u@example.net", queue=queue)
    setup(queue)
    before = snapshot()
    with pytest.raises(ActionConflict, match=text):
        service(Queue.objects.get(pk=queue.pk), operator, Via.API)
    assert snapshot() == before


def test_the_submission_queue_is_not_acted_on(operator):
    submission = make_queue("Submission", delivery_type=DeliveryType.SUBMISSION)
    with pytest.raises(ActionConflict, match="Submission"):
        actions.queue_suspend(submission, operator, Via.UI)
    assert not AuditEntry.objects.exists()


def test_every_queue_action_is_audited_with_who_how_what_and_how_many(operator):
    queue = make_queue()
    make_message("u@example.net", queue=queue)
    make_message("v@example.net", queue=queue)
    actions.queue_suspend(queue, operator, Via.UI)
    actions.queue_resume(queue, operator, Via.API)
    actions.queue_retry(queue, "root", Via.CLI)
    rows = list(
        AuditEntry.objects.order_by("id").values_list(
            "actor_id", "actor_name", "via", "action", "target_type", "target_ids", "count"
        )
    )
    assert rows == [
        (operator.pk, "olga", "ui", "queue_suspend", "queue", [queue.pk], 2),
        (operator.pk, "olga", "api", "queue_resume", "queue", [queue.pk], 2),
        (None, "root", "cli", "queue_retry", "queue", [queue.pk], 2),
    ]
    assert all(e.created_at for e in AuditEntry.objects.all())


def test_a_bulk_queue_action_skips_the_queues_where_it_makes_no_sense(operator):
    a, b = make_queue("a.example"), make_queue("b.example")
    Queue.objects.filter(pk=b.pk).update(suspended=True)
    changed = actions.queues_apply(
        "suspend", Queue.objects.all(), operator, Via.API, filter={"name": "example"}
    )
    assert changed == 1
    assert Queue.objects.get(pk=a.pk).suspended
    entry = AuditEntry.objects.get()
    assert (entry.action, entry.count, entry.filter) == ("queue_suspend", 1, {"name": "example"})


# --- messages -------------------------------------------------------------------------


def test_a_suspended_message_is_not_delivered_until_it_is_resumed(
    relay, sink_factory, operator, bells, django_capture_on_commit_callbacks
):
    sink = sink_factory("127.0.0.2")
    message = accepted_and_queued("u@example.net")
    actions.message_suspend(message, operator, Via.UI)
    assert message.suspended
    drain()
    assert not sink.messages
    bells.links.clear()
    with django_capture_on_commit_callbacks(execute=True):
        actions.message_resume(message, operator, Via.UI)
    assert bells.links == [Link.objects.get().pk]
    drain()
    assert len(sink.messages) == 1


def test_a_message_suspended_before_routing_is_routed_when_resumed(
    relay, sink_factory, operator, bells, django_capture_on_commit_callbacks
):
    sink = sink_factory("127.0.0.2")
    message = make_message("u@example.net")
    actions.message_suspend(message, operator, Via.UI)
    drain()
    assert Message.objects.get(pk=message.pk).state == MessageState.SUBMISSION
    with django_capture_on_commit_callbacks(execute=True):
        actions.message_resume(message, operator, Via.UI)
    assert bells.categorizer == 1
    drain()
    assert len(sink.messages) == 1


def test_resubmitting_a_deferred_message_makes_it_due_now_and_delivers_it(
    relay, sink_factory, operator
):
    sink = sink_factory("127.0.0.2", rcpt_tempfail={"u@example.net": 1})
    message = accepted_and_queued("u@example.net")
    drain()
    assert rstates(message) == [RecipientState.DEFERRED]
    drain()
    assert not sink.messages  # not due yet
    actions.message_resubmit(message, operator, Via.API)
    assert message.state == MessageState.SUBMISSION
    drain()
    assert len(sink.messages) == 1
    assert rstates(message) == [RecipientState.DELIVERED]


def test_resuming_a_poison_message_sends_it_back_to_the_categorizer(operator):
    poison = make_queue("Poison", delivery_type=DeliveryType.POISON)
    message = make_message("u@example.net", queue=poison, rstate=RecipientState.DEFERRED)
    Message.objects.filter(pk=message.pk).update(suspended=True, crash_count=3)
    actions.message_resume(Message.objects.get(pk=message.pk), operator, Via.UI)
    m = Message.objects.get(pk=message.pk)
    assert (m.state, m.suspended, m.crash_count) == (MessageState.SUBMISSION, False, 0)
    assert rstates(m) == [RecipientState.SUBMITTED]


def test_removing_a_message_fails_its_waiting_recipients_and_finishes_it(operator, fake_notify):
    queue = make_queue()
    message = make_message("u@example.net", "v@example.net", queue=queue)
    Recipient.objects.filter(address="v@example.net").update(
        state=RecipientState.DELIVERED, final_at=clock.now()
    )
    actions.message_remove(message, operator, Via.UI, ndr=False)
    u = Recipient.objects.get(address="u@example.net")
    assert u.state == RecipientState.FAILED
    assert (u.last_code, u.last_enhanced, u.last_text) == (None, "5.7.0", "removed by olga")
    assert Recipient.objects.get(address="v@example.net").state == RecipientState.DELIVERED
    assert message.state == MessageState.DONE and message.completed_at
    assert fake_notify == []
    assert AuditEntry.objects.get().detail.startswith("without NDR; before: ")


def test_removing_with_ndr_asks_for_a_report_on_the_removed_recipients_only(operator, fake_notify):
    queue = make_queue()
    message = make_message("u@example.net", "v@example.net", "w@example.net", queue=queue)
    Recipient.objects.filter(address="w@example.net").update(
        state=RecipientState.DELIVERED, final_at=clock.now()
    )
    actions.message_remove(message, operator, Via.API, ndr=True)
    removed = list(
        Recipient.objects.filter(address__in=["u@example.net", "v@example.net"])
        .order_by("id")
        .values_list("id", flat=True)
    )
    assert fake_notify == [(message.pk, removed)]
    assert AuditEntry.objects.get().detail.startswith("with NDR; before: ")


def test_removing_with_ndr_sends_the_report_to_the_sender(relay, sink_factory, operator):
    relay.a("example.org", "127.0.0.2")
    sink = sink_factory("127.0.0.2")
    queue = make_queue()
    message = make_message("u@example.net", queue=queue)
    Queue.objects.filter(pk=queue.pk).update(suspended=True)
    actions.message_remove(message, operator, Via.UI, ndr=True)
    drain()
    ndrs = [m for m in sink.messages if m.rcpt_tos == ["a@example.org"]]
    assert len(ndrs) == 1 and ndrs[0].mail_from in ("", "<>")
    assert b"5.7.0" in ndrs[0].data


def test_a_message_in_flight_is_not_removed(operator):
    queue = make_queue()
    message = make_message("u@example.net", queue=queue, rstate=RecipientState.ACTIVE)
    before = snapshot()
    with pytest.raises(ActionConflict, match="being delivered right now"):
        actions.message_remove(message, operator, Via.UI)
    assert snapshot() == before


@pytest.mark.parametrize(
    "service",
    [
        actions.message_suspend,
        actions.message_resume,
        actions.message_resubmit,
        actions.message_remove,
    ],
    ids=["suspend", "resume", "resubmit", "remove"],
)
def test_acting_on_a_delivered_message_is_refused_and_changes_nothing(operator, service):
    message = make_message("u@example.net", queue=make_queue(), rstate=RecipientState.DELIVERED)
    before = snapshot()
    with pytest.raises(ActionConflict, match="is done"):
        service(message, operator, Via.API)
    assert snapshot() == before


@pytest.mark.parametrize(
    ("suspended", "service", "text"),
    [
        (True, actions.message_suspend, "already suspended"),
        (False, actions.message_resume, "is not suspended"),
    ],
)
def test_suspend_and_resume_refuse_the_state_the_message_is_already_in(
    operator, suspended, service, text
):
    message = make_message("u@example.net", queue=make_queue())
    Message.objects.filter(pk=message.pk).update(suspended=suspended)
    with pytest.raises(ActionConflict, match=text):
        service(Message.objects.get(pk=message.pk), operator, Via.API)
    assert not AuditEntry.objects.exists()


def test_a_message_being_routed_is_not_resubmitted(operator):
    message = make_message("u@example.net")
    Message.objects.filter(pk=message.pk).update(state=MessageState.CATEGORIZING)
    with pytest.raises(ActionConflict, match="being routed"):
        actions.message_resubmit(Message.objects.get(pk=message.pk), operator, Via.API)


def test_export_gives_exactly_the_stored_bytes_with_our_received_header(operator):
    message = make_message("u@example.net", text="caf\xe9 \r\n.dot\r\n")
    data = actions.message_export(Message.objects.defer("data").get(pk=message.pk))
    assert data == bytes(Message.objects.get(pk=message.pk).data)
    assert data.startswith(b"Received: from client.test")
    assert not AuditEntry.objects.exists()
    actions.message_export(message, actor=operator, via=Via.API)
    assert AuditEntry.objects.get().action == "message_export"


def test_bulk_export_writes_one_eml_per_message_into_a_zip(operator):
    first, second = make_message("u@example.net"), make_message("v@example.net")
    out = io.BytesIO()
    written = actions.messages_export_zip(
        Message.objects.all(), out, operator, Via.API, ids=[first.pk, second.pk]
    )
    assert written == 2
    archive = zipfile.ZipFile(io.BytesIO(out.getvalue()))
    assert archive.read(f"{first.qid}.eml") == bytes(first.data)
    assert archive.read(f"{second.qid}.eml") == bytes(second.data)
    entry = AuditEntry.objects.get()
    assert (entry.action, entry.target_ids, entry.count) == (
        "messages_export",
        [first.pk, second.pk],
        2,
    )


def test_bulk_export_refuses_more_than_its_limit(operator):
    make_message("u@example.net")
    make_message("v@example.net")
    with pytest.raises(ActionTooLarge, match="2 messages match"):
        actions.messages_export_zip(Message.objects.all(), io.BytesIO(), operator, Via.API, limit=1)


def test_a_bulk_action_changes_only_the_messages_where_it_makes_sense(operator):
    queue = make_queue()
    waiting = [make_message(f"u{i}@example.net", queue=queue) for i in range(3)]
    Message.objects.filter(pk=waiting[0].pk).update(suspended=True)
    done = make_message("d@example.net", queue=queue, rstate=RecipientState.DELIVERED)
    selection = Message.objects.filter(id__in=[m.pk for m in [*waiting, done]])
    assert actions.messages_select("suspend", selection).count() == 2
    changed = actions.messages_apply(
        "suspend", selection, operator, Via.UI, filter={"queue": str(queue.pk)}
    )
    assert changed == 2
    assert Message.objects.filter(suspended=True).count() == 3
    assert not Message.objects.get(pk=done.pk).suspended
    entry = AuditEntry.objects.get()
    assert (entry.action, entry.filter, entry.count, entry.target_ids) == (
        "message_suspend",
        {"queue": str(queue.pk)},
        2,
        [],
    )


def test_bulk_remove_with_ndr_reports_per_message_and_skips_messages_in_flight(
    operator, fake_notify
):
    queue = make_queue()
    a = make_message("a@example.net", queue=queue)
    b = make_message("b@example.net", queue=queue)
    busy = make_message("c@example.net", queue=queue, rstate=RecipientState.ACTIVE)
    ids = [a.pk, b.pk, busy.pk]
    changed = actions.messages_apply(
        "remove", Message.objects.filter(id__in=ids), operator, Via.API, ndr=True, ids=ids
    )
    assert changed == 2
    assert sorted(mid for mid, _ in fake_notify) == [a.pk, b.pk]
    assert rstates(busy) == [RecipientState.ACTIVE]
    assert Message.objects.filter(state=MessageState.DONE).count() == 2


def test_bulk_resubmit_and_resume(operator):
    queue = make_queue()
    a = make_message("a@example.net", queue=queue, rstate=RecipientState.DEFERRED)
    b = make_message("b@example.net", queue=queue)
    Message.objects.filter(pk=b.pk).update(suspended=True)
    assert actions.messages_apply("resubmit", Message.objects.all(), operator, Via.UI) == 2
    assert set(Recipient.objects.values_list("state", flat=True)) == {RecipientState.SUBMITTED}
    assert actions.messages_apply("resume", Message.objects.all(), operator, Via.UI) == 1
    assert not Message.objects.filter(suspended=True).exists()
    assert Message.objects.get(pk=a.pk).state == MessageState.SUBMISSION
