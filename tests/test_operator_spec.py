"""One operator spec: filters and actions declared once (queues.filters, queues.spec).

- A bulk preview counts exactly the rows its action changes, for every action
  and a representative set of filters: the count the preview shows, the count
  the action returns and the rows whose state really changed are one number.
- Each edge (UI form, API parameters and OpenAPI schema, command options)
  shows every filter the declaration gives it, and each edge dispatches every
  action of the tables.
"""

from __future__ import annotations

import io
from datetime import timedelta

import pytest
from django.core.management import call_command, get_commands, load_command_class

from queues.filters import MESSAGE_FILTERS, QUEUE_FILTERS, MessageFilter, QueueFilter
from queues.lib import clock
from queues.models import (
    AuditEntry,
    DeliveryType,
    Link,
    Message,
    MessageState,
    Queue,
    Recipient,
    RecipientState,
)
from queues.services import actions
from queues.services.actions import MessageAction, QueueAction, Via
from queues.spec import MESSAGE_ACTIONS, QUEUE_ACTIONS, actions_for
from queues.ui.forms import MessageFilterForm, QueueFilterForm
from tests.support.operator_factories import api_client, make_message, make_queue, make_user

pytestmark = pytest.mark.django_db


# --- a store with a message in every state an action treats differently -------------


def _set(message: Message, **fields) -> None:
    Message.objects.filter(pk=message.pk).update(**fields)


@pytest.fixture
def store():
    """One message per case the bulk actions distinguish; returns them by name."""
    queue = make_queue("example.net")
    dead = make_queue("dead-letter", delivery_type=DeliveryType.DEAD_LETTER)
    poison = make_queue("poison", delivery_type=DeliveryType.POISON)
    unreachable = make_queue("nowhere.example", delivery_type=DeliveryType.UNREACHABLE)
    m = {
        "ready": make_message("ready@example.net", queue=queue),
        "retry": make_message(
            "retry@example.net",
            queue=queue,
            rstate=RecipientState.DEFERRED,
            last_text="451 greylisted for 300s",
        ),
        "suspended": make_message("held@example.net", queue=queue),
        "in_flight": make_message("busy@example.net", queue=queue, rstate=RecipientState.ACTIVE),
        "half_in_flight": make_message("a@example.net", "b@example.net", queue=queue),
        "submission": make_message("new@example.net"),
        "categorizing": make_message("routing@example.net"),
        "delivered": make_message("done@example.net", queue=queue, rstate="delivered"),
        "dead_letter": make_message(
            "gone@example.net", queue=dead, rstate=RecipientState.FAILED, last_text="550 no user"
        ),
        "expired": make_message("late@example.net", queue=dead, rstate=RecipientState.EXPIRED),
        "poison": make_message("crash@example.net", queue=poison),
        "unreachable": make_message("x@nowhere.example", queue=unreachable, sender=""),
    }
    _set(m["suspended"], suspended=True)
    _set(m["poison"], suspended=True, crash_count=2)
    _set(m["categorizing"], state=MessageState.CATEGORIZING)
    _set(m["expired"], state=MessageState.DONE, completed_at=clock.now())
    first = m["half_in_flight"].recipients.order_by("id").first()
    Recipient.objects.filter(pk=first.pk).update(state=RecipientState.ACTIVE)
    return m


def _fingerprints() -> dict[int, tuple]:
    """Everything a message action may change, per message."""
    rows = {
        m.pk: (m.state, m.suspended, m.expires_at)
        for m in Message.objects.defer("data").order_by("id")
    }
    recipients: dict[int, list] = {}
    for r in Recipient.objects.order_by("id"):
        recipients.setdefault(r.message_id, []).append((r.state, r.queue_id, r.next_attempt_at))
    return {pk: (*row, tuple(recipients.get(pk, ()))) for pk, row in rows.items()}


def _changed(before: dict[int, tuple]) -> int:
    after = _fingerprints()
    return sum(1 for pk, fp in before.items() if after.get(pk) != fp)


MESSAGE_FILTER_CASES = [
    {},
    {"status": "failed"},  # dead letters: a resubmit revives them
    {"status": "active"},  # in flight: a remove skips them
    {"status": "retry,ready"},
    {"status": "suspended"},
    {"status": "submission"},
    {"status": "delivered"},
    {"domain": "example.net"},
    {"error": "greylisted"},
    {"sender": "<>"},
]


@pytest.mark.parametrize("params", MESSAGE_FILTER_CASES, ids=lambda p: str(p) or "all")
@pytest.mark.parametrize("name", list(MESSAGE_ACTIONS))
def test_a_message_preview_counts_exactly_what_the_action_changes(store, name, params):
    spec = MESSAGE_ACTIONS[name]
    qs = MessageFilter.from_params(params).queryset()
    preview = spec.preview(qs)
    before = _fingerprints()
    changed = spec.apply(qs, "tester", Via.API, filter=params)
    assert (preview, changed) == (_changed(before), _changed(before))
    assert AuditEntry.objects.get().count == changed


def test_resubmit_of_failed_messages_previews_the_dead_letters_it_revives(store):
    qs = MessageFilter.from_params({"status": "failed"}).queryset()
    assert MESSAGE_ACTIONS["resubmit"].preview(qs) == 2  # was 0
    assert actions.messages_apply(MessageAction.RESUBMIT, qs, "tester", Via.CLI) == 2
    revived = Message.objects.filter(pk__in=[store["dead_letter"].pk, store["expired"].pk])
    assert set(revived.values_list("state", flat=True)) == {MessageState.SUBMISSION}


def test_remove_previews_without_the_messages_in_flight(store):
    qs = MessageFilter.from_params({"domain": "example.net"}).queryset()
    selected = set(actions.messages_select(MessageAction.REMOVE, qs).values_list("id", flat=True))
    assert store["in_flight"].pk not in selected
    assert store["half_in_flight"].pk not in selected
    assert store["categorizing"].pk not in selected
    assert {store["ready"].pk, store["retry"].pk, store["suspended"].pk} <= selected
    assert MESSAGE_ACTIONS["remove"].preview(qs) == len(selected)


@pytest.fixture
def queues():
    """Queues in every state a queue action treats differently."""
    later = clock.now() + timedelta(hours=1)
    waiting_link = Link.objects.create(name="retry.example", created_at=clock.now())
    q = {
        "retry": make_queue("retry.example", link=waiting_link),
        "suspended": make_queue("held.example"),
        "empty": make_queue("empty.example"),
        "unreachable": make_queue("nowhere.example", delivery_type=DeliveryType.UNREACHABLE),
        "poison": make_queue("poison", delivery_type=DeliveryType.POISON),
        "submission": make_queue("submission", delivery_type=DeliveryType.SUBMISSION),
    }
    Link.objects.filter(pk=waiting_link.pk).update(state="retry", next_retry_at=later)
    Queue.objects.filter(pk=q["suspended"].pk).update(suspended=True)
    for name in ("retry", "suspended", "unreachable", "poison"):
        message = make_message(f"u@{name}.example", queue=q[name])
        Recipient.objects.filter(message=message).update(next_attempt_at=later)
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
        rows[queue.pk] = (queue.suspended, queue.reroute_to, link, waiting)
    return rows


# The options an action cannot do without (OperatorAction.required): reroute's next hop.
REQUIRED_OPTIONS = {"to": "[10.0.0.9]:25"}

QUEUE_FILTER_CASES = [
    {},
    {"status": "suspended"},
    {"status": "retry"},
    {"status": "ready"},
    {"type": "dns_mx"},
    {"type": "unreachable,poison,submission"},
]


@pytest.mark.parametrize("params", QUEUE_FILTER_CASES, ids=lambda p: str(p) or "all")
@pytest.mark.parametrize("name", list(QUEUE_ACTIONS))
def test_a_queue_preview_counts_exactly_what_the_action_changes(queues, name, params):
    spec = QUEUE_ACTIONS[name]
    qs = QueueFilter.from_params(params).queryset()
    if spec.required:  # reroute: refused without its next hop, never a silent 0
        with pytest.raises(actions.ActionInvalid):
            spec.apply(qs, "tester", Via.API, filter=params)
    opts = REQUIRED_OPTIONS if spec.required else {}
    preview = spec.preview(qs, **opts)
    before = _queue_fingerprints()
    changed = spec.apply(qs, "tester", Via.API, filter=params, **opts)
    after = _queue_fingerprints()
    really = sum(1 for pk, fp in before.items() if after[pk] != fp)
    assert (preview, changed) == (really, really)


STORE_CASES = [
    "ready",
    "retry",
    "suspended",
    "in_flight",
    "half_in_flight",
    "submission",
    "categorizing",
    "delivered",
    "dead_letter",
    "expired",
    "poison",
    "unreachable",
]


@pytest.mark.parametrize("case", STORE_CASES)
@pytest.mark.parametrize("name", list(MESSAGE_ACTIONS))
def test_the_single_action_succeeds_exactly_on_what_the_bulk_selection_holds(store, name, case):
    spec = MESSAGE_ACTIONS[name]
    message = store[case]
    selected = spec.select(Message.objects.filter(pk=message.pk)).exists()
    try:
        spec.run(message, "tester", Via.UI)
    except actions.ActionConflict:
        done = False
    else:
        done = True
    assert done == selected


QUEUE_CASES = ["retry", "suspended", "empty", "unreachable", "poison", "submission"]


@pytest.mark.parametrize("case", QUEUE_CASES)
@pytest.mark.parametrize("name", list(QUEUE_ACTIONS))
def test_a_single_queue_action_succeeds_exactly_on_what_the_bulk_selection_holds(
    queues, name, case
):
    spec = QUEUE_ACTIONS[name]
    queue = queues[case]
    opts = REQUIRED_OPTIONS if spec.required else {}
    selected = spec.select(Queue.objects.filter(pk=queue.pk), **opts).exists()
    try:
        spec.run(queue, "tester", Via.UI, **opts)
    except actions.ActionConflict:
        done = False
    else:
        done = True
    assert done == selected


# --- the edges show the same preview ------------------------------------------------


@pytest.fixture
def operator():
    return make_user("operator", "olga")


def test_the_api_dry_run_counts_what_confirm_changes(store, operator):
    client = api_client(operator)
    body = {"action": "resubmit", "filter": {"status": "failed"}}
    dry = client.post("/api/v1/messages/bulk/", body, format="json").json()
    done = client.post("/api/v1/messages/bulk/", {**body, "confirm": True}, format="json").json()
    assert (dry["count"], dry["confirmed"], done["count"]) == (2, False, 2)
    dry = client.post("/api/v1/queues/bulk/", {"action": "resume", "filter": {}}, format="json")
    assert dry.json()["count"] == 0  # no queue is suspended: nothing to resume


def test_the_ui_confirmation_counts_what_confirm_changes(store, operator, client):
    client.force_login(operator)
    params = {"action": "remove", "domain": "example.net"}
    page = client.get("/messages/by-filter/", params)
    before = _fingerprints()
    client.post("/messages/by-filter/", params)
    assert (
        page.context["count"] == _changed(before) == 5
    )  # ready, retry, suspended, submission, poison


def test_the_command_preview_counts_what_yes_changes(store):
    out = io.StringIO()
    call_command("message", "remove", "--domain", "example.net", stdout=out)
    assert out.getvalue().startswith("remove would touch 5 messages")
    out = io.StringIO()
    call_command("message", "remove", "--domain", "example.net", "--yes", stdout=out)
    assert out.getvalue() == "remove: 5 messages changed\n"


# --- one declaration feeds every edge -------------------------------------------------


def test_every_filter_parameter_is_on_every_edge_it_declares():
    schema = api_client(make_user("viewer")).get(
        "/api/schema/", HTTP_ACCEPT="application/vnd.oai.openapi+json"
    )
    paths = schema.json()["paths"]
    for path, table, form, command in (
        ("/api/v1/messages/", MESSAGE_FILTERS, MessageFilterForm(), ["message", "list"]),
        ("/api/v1/queues/", QUEUE_FILTERS, QueueFilterForm(), ["queue", "list"]),
    ):
        api = {p["name"] for p in paths[path]["get"]["parameters"]}
        cmd = load_command_class(get_commands()[command[0]], command[0])
        parser = cmd.create_parser("manage.py", command[0])
        sub = parser._subparsers._group_actions[0].choices[command[1]]
        flags = {o for a in sub._actions for o in a.option_strings}
        for spec in table:
            assert (spec.name in api) == ("api" in spec.edges), spec.name
            assert (spec.name in form.fields) == ("form" in spec.edges), spec.name
            assert (spec.flag in flags) == ("cli" in spec.edges), spec.name
        model_fields = set(MessageFilter.__dataclass_fields__) | set(
            QueueFilter.__dataclass_fields__
        )
        assert {spec.field_name for spec in table} <= model_fields


def test_every_service_action_is_dispatched_once_on_the_api_and_the_command_line():
    assert list(actions_for(MESSAGE_ACTIONS, "api")) == MessageAction.values
    assert list(actions_for(MESSAGE_ACTIONS, "cli")) == MessageAction.values
    assert list(actions_for(QUEUE_ACTIONS, "api")) == QueueAction.values
    assert list(actions_for(QUEUE_ACTIONS, "cli")) == QueueAction.values
    assert set(actions_for(MESSAGE_ACTIONS, "form")) == {*MessageAction.values, "remove_ndr"}


@pytest.mark.parametrize("name", list(actions_for(MESSAGE_ACTIONS, "api")))
def test_each_message_action_endpoint_needs_its_role(store, name):
    viewer = api_client(make_user("viewer"))
    response = viewer.post(f"/api/v1/messages/{store['ready'].pk}/{name}/", {}, format="json")
    assert response.status_code == 403
    assert response.json()["detail"] == f"this needs the {MESSAGE_ACTIONS[name].role} role"
