"""A delivery is its attempt, an arrival its message, a routing its recipient
(tracking.history, issue #24): no second row in ``tracking_event`` while the
message is in the store; the search reads them from the attempt, the message
and the recipient by every criterion,
pages them among the stored rows, and the purge moves them into
``tracking_event`` with the same id and the same fields. Real
sinks and the loopback DNS server (tests/support/pipeline.drain), the movable
clock."""

from __future__ import annotations

import uuid
from datetime import timedelta

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext

from delivery.qmgr.sweep import sweep
from queues.lib import clock
from queues.models import Attempt, AttemptOutcome, Message, Queue, Recipient
from queues.services import reroute
from tests.support.history import history
from tests.support.pipeline import drain
from tests.test_tracking import accept, relay  # noqa: F401 - relay: the fixture used below
from tracking import history as live
from tracking import record
from tracking.models import TrackingEvent, WebhookDelivery
from tracking.search import (
    TrackingQuery,
    arrival_queryset,
    delivery_queryset,
    parse_query,
    routing_queryset,
    search,
)

pytestmark = [pytest.mark.django_db, pytest.mark.usefixtures("relay")]

BODY = b"From: a@example.org\r\nTo: x\r\nMessage-ID: <h1@example.org>\r\nSubject: t\r\n\r\nhi\r\n"
FIELDS = [f.attname for f in TrackingEvent._meta.concrete_fields if not f.primary_key]


def fields(row: TrackingEvent) -> dict:
    return {name: getattr(row, name) for name in FIELDS}


def delivered_message(sink_factory, *rcpts: str) -> Message:
    sink_factory("127.0.0.2", data_reply="250 2.0.0 Ok: queued as Q7Remote")
    message = accept(*rcpts, sender="Ann@Example.org", body=BODY)
    drain()
    return message


def test_a_delivery_is_one_attempt_row_and_no_tracking_row(sink_factory):
    message = delivered_message(sink_factory, "bob@example.net")
    attempt = Attempt.objects.get(message=message)
    assert attempt.outcome == AttemptOutcome.DELIVERED
    assert attempt.event_id is not None and attempt.remote_id == "Q7Remote"
    assert attempt.link_id is not None
    assert not TrackingEvent.objects.filter(qid=message.qid).exists()
    (row,) = search(TrackingQuery(qid=message.qid, event=["delivered"])).rows
    assert row.id == -attempt.id and row.event_id == attempt.event_id
    assert (row.recipient, row.remote_id, row.code) == ("bob@example.net", "Q7Remote", 250)
    assert row.reply == "250 2.0.0 Ok: queued as Q7Remote"
    assert row.next_hop == attempt.link.name and row.host == "example.net"
    assert (row.sender, row.message_id) == ("Ann@Example.org", "<h1@example.org>")
    assert row.detail["phase"] == "data" and "duration_ms" in row.detail


@pytest.mark.parametrize(
    ("event", "criteria", "matches"),
    [
        ("delivered", {"remote_id": "Q7Remote"}, 2),  # both recipients' deliveries
        ("routed", {"recipient": "carol@example.net"}, 1),  # a recipient's own routing
    ],
)
def test_the_purge_moves_the_event_into_the_tracking_table_unchanged(
    sink_factory, settings, event, criteria, matches
):
    message = delivered_message(sink_factory, "bob@example.net", "carol@example.net")
    before = {r.event_id: fields(r) for r in history(qid=message.qid, event=event)}
    assert len(before) == 2
    clock.advance(settings.MAILRELAY_COMPLETED_RETENTION + timedelta(minutes=1))
    sweep()
    assert not Message.objects.filter(pk=message.pk).exists()
    assert not Attempt.objects.filter(message_id=message.pk).exists()
    assert not Recipient.objects.filter(message_id=message.pk).exists()
    after = TrackingEvent.objects.filter(qid=message.qid, event=event)
    assert {r.event_id: fields(r) for r in after} == before
    assert all(r.id > 0 for r in after)
    # Found as often as before, now from the table.
    found = search(parse_query(criteria | {"event": event})).rows
    assert len(found) == matches and all(r.id > 0 for r in found)


def test_the_purge_keeps_no_delivery_older_than_the_tracking_retention(sink_factory, settings):
    message = delivered_message(sink_factory, "bob@example.net")
    Message.objects.filter(pk=message.pk).update(event_id=None)  # the delivery alone
    Recipient.objects.filter(message=message).update(routed_at=None)
    settings.MAILRELAY_TRACKING_RETENTION = timedelta(hours=1)
    clock.advance(settings.MAILRELAY_COMPLETED_RETENTION + timedelta(minutes=1))
    assert live.archive([message.pk]) == 0
    settings.MAILRELAY_TRACKING_RETENTION = timedelta(days=30)
    assert live.archive([message.pk]) == 1


@pytest.mark.parametrize(
    ("event", "criteria"),
    [
        ("delivered", {"sender": "ann@EXAMPLE.org"}),
        ("delivered", {"recipient": "BOB@example.net"}),
        ("delivered", {"message_id": "h1@example.org"}),
        ("delivered", {"message_id": "<h1@example.org>"}),
        ("delivered", {"remote_id": "Q7Remote"}),
        ("delivered", {"event": "delivered,deferred"}),
        ("delivered", {"since": "1h"}),
        ("received", {"sender": "ann@EXAMPLE.org"}),
        ("received", {"recipient": "BOB@example.net"}),
        ("received", {"message_id": "h1@example.org"}),
        ("received", {"message_id": "<h1@example.org>"}),
        ("received", {"event": "received,routed"}),
        ("received", {"since": "1h"}),
        ("routed", {"sender": "ann@EXAMPLE.org"}),
        ("routed", {"recipient": "BOB@example.net"}),
        ("routed", {"message_id": "h1@example.org"}),
        ("routed", {"message_id": "<h1@example.org>"}),
        ("routed", {"event": "routed,received"}),
        ("routed", {"since": "1h"}),
    ],
)
def test_every_criterion_finds_an_event_of_a_message_in_the_store(sink_factory, event, criteria):
    message = delivered_message(sink_factory, "bob@example.net")
    rows = search(parse_query(criteria | {"qid": message.qid})).rows
    assert [r.event for r in rows if r.event == event] == [event]


@pytest.mark.parametrize(
    ("event", "criteria"),
    [
        ("delivered", {"sender": "ann@example.or"}),  # exact, not a substring
        ("delivered", {"recipient": "bob@example.ne"}),
        ("delivered", {"message_id": "h1@example.or"}),
        ("delivered", {"remote_id": "Q7Remot"}),
        ("delivered", {"event": "routed"}),
        ("delivered", {"until": "1h"}),
        ("received", {"sender": "ann@example.or"}),
        ("received", {"recipient": "bob@example.ne"}),
        ("received", {"message_id": "h1@example.or"}),
        ("received", {"remote_id": "Q7Remote"}),  # an arrival has no remote queue id
        ("received", {"event": "delivered"}),
        ("received", {"until": "1h"}),
        ("routed", {"sender": "ann@example.or"}),
        ("routed", {"recipient": "bob@example.ne"}),
        ("routed", {"message_id": "h1@example.or"}),
        ("routed", {"remote_id": "Q7Remote"}),  # a routing has no remote queue id
        ("routed", {"event": "received"}),
        ("routed", {"until": "1h"}),
    ],
)
def test_a_criterion_it_does_not_meet_leaves_the_event_out(sink_factory, event, criteria):
    message = delivered_message(sink_factory, "bob@example.net")
    rows = search(parse_query(criteria | {"qid": message.qid})).rows
    assert event not in [r.event for r in rows]


def test_pages_of_one_walk_every_row_of_every_source_once_newest_first(sink_factory):
    message = delivered_message(sink_factory, "bob@example.net", "carol@example.net")
    whole = search(TrackingQuery(qid=message.qid)).rows
    assert [r.event for r in whole].count("delivered") == 2 and len(whole) == 5
    seen, cursor = [], None
    while True:
        page = search(TrackingQuery(qid=message.qid), limit=1, cursor=cursor)
        seen += page.rows
        cursor = page.next_cursor
        if not cursor:
            break
    assert [(r.at, r.id) for r in seen] == [(r.at, r.id) for r in whole]
    assert [(r.at, r.id) for r in whole] == sorted(((r.at, r.id) for r in whole), reverse=True)


def test_an_attempt_recorded_beside_its_tracking_row_is_not_shown_twice(sink_factory):
    """Attempts from before migration queues/0015 have no event id: their
    tracking rows were written, the attempt is not read as an event."""
    message = delivered_message(sink_factory, "bob@example.net")
    Attempt.objects.filter(message=message).update(event_id=None)
    Message.objects.filter(pk=message.pk).update(event_id=None)  # the delivery alone
    Recipient.objects.filter(message=message).update(routed_at=None)
    assert not search(TrackingQuery(qid=message.qid, event=["delivered"])).rows
    assert live.archive([message.pk]) == 0


def _copy(model, source: str, replaced: dict[str, str], where: str) -> str:
    """``INSERT INTO model SELECT … FROM source WHERE …``: every column of
    ``model`` from alias ``s``, but those ``replaced`` (column -> SQL)."""
    columns = [f.column for f in model._meta.concrete_fields if not f.primary_key]
    values = ", ".join(replaced.get(c, f"s.{c}") for c in columns)
    table = model._meta.db_table
    return f"INSERT INTO {table} ({', '.join(columns)}) SELECT {values} FROM {source} WHERE {where}"


def grow_store(message: Message, n: int) -> None:
    """``n`` more delivered messages like ``message`` (a recipient and a delivery
    each, their own sender, Message-ID, address and remote id), then ANALYZE:
    the planner's view of a store a day of mail fills."""
    g = "substr(m.qid, 2)"
    with connection.cursor() as cur:
        cur.execute(
            _copy(
                Message,
                "queues_message s, generate_series(1, %s) AS n",
                {
                    "qid": "'G' || n",
                    "event_id": "gen_random_uuid()",
                    "mail_from": "'s' || n || '@example.org'",
                    "message_id": "'<g' || n || '@example.org>'",
                    "received_at": "s.received_at - n * interval '1 second'",
                },
                "s.id = %s",
            ),
            [n, message.pk],
        )
        cur.execute(
            _copy(
                Recipient,
                "queues_recipient s, queues_message m",
                {
                    "message_id": "m.id",
                    "address": f"'r' || {g} || '@example.net'",
                    "routed_at": "m.received_at",
                },
                "s.message_id = %s AND m.qid LIKE 'G%%'",
            ),
            [message.pk],
        )
        cur.execute(
            _copy(
                Attempt,
                "queues_attempt s, queues_message m, queues_recipient r",
                {
                    "message_id": "m.id",
                    "recipient_id": "r.id",
                    "event_id": "gen_random_uuid()",
                    "remote_id": f"'R' || {g}",
                    "started_at": "m.received_at",
                },
                "s.message_id = %s AND m.qid LIKE 'G%%' AND r.message_id = m.id",
            ),
            [message.pk],
        )
        # As autovacuum leaves them: the trigram indexes' pending entries merged.
        for index in (
            "messagetext_mail_from_trgm",
            "messagetext_msgid_trgm",
            "recipient_address_trgm",
        ):
            cur.execute("SELECT gin_clean_pending_list(%s::regclass)", [index])
        for table in ("queues_message", "queues_messagetext", "queues_recipient", "queues_attempt"):
            cur.execute(f"ANALYZE {table}")


# --- an arrival is its message (migration queues/0016) ----------------------


def test_an_arrival_is_its_message_and_no_tracking_row(sink_factory):
    message = delivered_message(sink_factory, "bob@example.net", "carol@example.net")
    message.refresh_from_db()
    assert message.event_id is not None
    assert not TrackingEvent.objects.filter(qid=message.qid, event="received").exists()
    (row,) = search(TrackingQuery(qid=message.qid, event=["received"])).rows
    assert row.id == message.pk - live.ARRIVAL_OFFSET and row.event_id == message.event_id
    assert (row.at, row.message_pk, row.sender) == (
        message.received_at,
        message.pk,
        "Ann@Example.org",
    )
    assert (row.client, row.size, row.account) == ("192.0.2.7", message.size, "")
    assert row.message_id == "<h1@example.org>" and row.detail == {"source": "smtp"}
    assert (row.recipient, row.remote_id, row.queue) == ("", "", "")
    # Message-wide: found by any recipient of its message, as its stored row is.
    for rcpt in ("BOB@example.net", "carol@example.net"):
        found = search(TrackingQuery(recipient=rcpt, event=["received"])).rows
        assert [r.event_id for r in found] == [message.event_id]


def test_an_arrival_is_shown_from_its_acceptance(sink_factory):
    """Before the categorizer has taken it, as after."""
    message = accept("bob@example.net", sender="Ann@Example.org", body=BODY)
    assert [r.event for r in search(TrackingQuery(qid=message.qid)).rows] == ["received"]


def test_pages_of_one_walk_arrivals_of_one_instant_once_each():
    """Messages accepted at one instant: the cursor's id tells them apart."""
    ids = [accept(f"u{i}@example.net", body=BODY).pk for i in range(3)]
    Message.objects.filter(pk__in=ids).update(received_at=clock.now())
    seen, cursor = [], None
    while True:
        page = search(TrackingQuery(event=["received"]), limit=1, cursor=cursor)
        seen += [r.message_pk for r in page.rows]
        cursor = page.next_cursor
        if not cursor:
            break
    assert seen == sorted(ids, reverse=True)


def test_the_received_webhook_carries_the_messages_event_id(sink_factory, webhook_endpoint):
    """As a delivery's carries its attempt's (the event log: test_tracking)."""
    from tracking.models import WebhookDelivery

    webhook_endpoint("received")
    message = delivered_message(sink_factory, "bob@example.net")
    message.refresh_from_db()
    (hook,) = WebhookDelivery.objects.filter(event="received")
    assert hook.event_id == message.event_id
    assert str(message.event_id) in hook.body


def test_the_purge_moves_the_arrival_into_the_tracking_table_unchanged(sink_factory, settings):
    message = delivered_message(sink_factory, "bob@example.net", "carol@example.net")
    (before,) = history(qid=message.qid, event="received")
    assert before.id < 0
    clock.advance(settings.MAILRELAY_COMPLETED_RETENTION + timedelta(minutes=1))
    sweep()
    assert not Message.objects.filter(pk=message.pk).exists()
    (after,) = TrackingEvent.objects.filter(qid=message.qid, event="received")
    assert after.id > 0 and fields(after) == fields(before)
    # Still found by a recipient of the message, now through its stored rows.
    found = search(parse_query({"recipient": "carol@example.net", "event": "received"})).rows
    assert [r.event_id for r in found] == [before.event_id]


def test_the_purge_keeps_no_arrival_older_than_the_tracking_retention(sink_factory, settings):
    message = delivered_message(sink_factory, "bob@example.net")
    Attempt.objects.filter(message=message).update(event_id=None)  # the arrival alone
    Recipient.objects.filter(message=message).update(routed_at=None)
    settings.MAILRELAY_TRACKING_RETENTION = timedelta(hours=1)
    clock.advance(timedelta(hours=2))
    assert not search(TrackingQuery(qid=message.qid, event=["received"])).rows
    assert live.archive([message.pk]) == 0
    settings.MAILRELAY_TRACKING_RETENTION = timedelta(days=30)
    assert live.archive([message.pk]) == 1


def test_a_message_stored_before_its_event_id_has_its_received_row_written_once(sink_factory):
    """Messages from before migration queues/0016 have no event id: the
    categorizer writes their ``received`` row, the message is not read as one."""
    sink_factory("127.0.0.2", data_reply="250 2.0.0 Ok: queued as Q7Remote")
    message = accept("bob@example.net", sender="Ann@Example.org", body=BODY)
    Message.objects.filter(pk=message.pk).update(event_id=None)
    drain()
    (stored,) = TrackingEvent.objects.filter(qid=message.qid, event="received")
    assert [r.id for r in search(TrackingQuery(qid=message.qid, event=["received"])).rows] == [
        stored.id
    ]
    assert live.archive([message.pk]) == 2  # its routing and its delivery


# --- a routing is its recipient (migration queues/0017) ---------------------


def test_a_routing_is_its_recipient_and_no_tracking_row(sink_factory):
    message = delivered_message(sink_factory, "bob@example.net", "carol@example.net")
    assert not TrackingEvent.objects.filter(qid=message.qid, event="routed").exists()
    rows = {r.recipient: r for r in search(TrackingQuery(qid=message.qid, event=["routed"])).rows}
    assert sorted(rows) == ["bob@example.net", "carol@example.net"]
    for recipient in Recipient.objects.filter(message=message):
        row = rows[recipient.address]
        assert row.id == recipient.pk - live.ROUTING_OFFSET
        assert row.at == recipient.routed_at and row.message_pk == message.pk
        assert row.event_id == record.routing_event_id(recipient.pk, recipient.routed_at)
        assert (row.queue, row.next_hop) == ("example.net", recipient.routed_link.name)
        assert recipient.routed_queue_id == recipient.queue_id
        assert (row.qid, row.sender, row.message_id) == (
            message.qid,
            "Ann@Example.org",
            "<h1@example.org>",
        )
    # Each recipient's own: found by its address, not by the other's.
    found = search(TrackingQuery(recipient="CAROL@example.net", event=["routed"])).rows
    assert [r.recipient for r in found] == ["carol@example.net"]


def test_a_routing_event_id_is_a_version_8_uuid_of_the_recipient_and_the_time():
    at = clock.now()
    one = record.routing_event_id(7, at)
    assert (one.version, one.variant) == (8, uuid.RFC_4122)
    assert one == record.routing_event_id(7, at)
    assert one != record.routing_event_id(8, at)
    assert one != record.routing_event_id(7, at + timedelta(microseconds=1))


def test_the_routed_webhook_carries_the_routings_event_id(sink_factory, webhook_endpoint):
    webhook_endpoint("routed")
    message = delivered_message(sink_factory, "bob@example.net")
    (hook,) = WebhookDelivery.objects.filter(event="routed")
    (row,) = search(TrackingQuery(qid=message.qid, event=["routed"])).rows
    assert hook.event_id == row.event_id
    assert f'"next_hop":"{row.next_hop}"' in hook.body and '"queue":"example.net"' in hook.body


def test_a_routing_shows_its_routes_link_through_an_operators_reroute(sink_factory):
    message = delivered_message(sink_factory, "bob@example.net")
    (before,) = search(TrackingQuery(qid=message.qid, event=["routed"])).rows
    queue = Queue.objects.get(name="example.net")
    reroute.start(queue, clock.now(), to="[127.0.0.9]:25", until=None, by="ops")
    (after,) = search(TrackingQuery(qid=message.qid, event=["routed"])).rows
    assert after.next_hop == before.next_hop != Queue.objects.get(pk=queue.pk).link.name


def test_routing_again_moves_the_previous_routing_into_the_tracking_table(sink_factory):
    sink_factory("127.0.0.2", rcpt_tempfail={"slow@example.net": 1})
    message = accept("slow@example.net", sender="Ann@Example.org", body=BODY)
    drain()
    (first,) = history(qid=message.qid, event="routed")
    assert first.id < 0
    # Waiting in its queue, not for the categorizer: a placement would leave it.
    rids = list(Recipient.objects.filter(message=message).values_list("id", flat=True))
    assert live.archive_routings(rids) == 0
    clock.advance(timedelta(minutes=1))
    assert Recipient.objects.filter(message=message).resubmit(clock.now()) == 1
    drain()
    (moved,) = TrackingEvent.objects.filter(qid=message.qid, event="routed")
    assert moved.id > 0 and fields(moved) == fields(first)
    events = [r.event for r in search(TrackingQuery(qid=message.qid)).rows]
    assert events == ["delivered", "routed", "deferred", "routed", "received"]
    second = search(TrackingQuery(qid=message.qid, event=["routed"])).rows[0]
    assert second.id < 0 and second.at > first.at and second.event_id != first.event_id


def test_the_first_categorization_reads_no_previous_routing(sink_factory):
    """The categorizer looks for routings to move only for messages
    categorized again: a new message's batch costs no statement for it."""
    sink_factory("127.0.0.2")
    accept("bob@example.net", body=BODY)
    with CaptureQueriesContext(connection) as queries:
        drain()
    assert not [q for q in queries if '"routed_at" IS NOT NULL' in q["sql"]]


def test_a_recipient_routed_before_its_columns_is_not_read_as_a_routing(sink_factory):
    """Recipients routed before migration queues/0017 have their rows written."""
    message = delivered_message(sink_factory, "bob@example.net")
    Recipient.objects.filter(message=message).update(routed_at=None)
    assert not search(TrackingQuery(qid=message.qid, event=["routed"])).rows
    assert live.archive([message.pk]) == 2  # its arrival and its delivery


@pytest.mark.parametrize(
    ("logged", "built"),
    [(False, []), (True, ["received", "routed", "delivered"])],
)
def test_events_the_store_holds_are_built_only_when_something_hears_them(
    sink_factory, monkeypatch, settings, tmp_path, logged, built
):
    """No webhook endpoint and no event log: an arrival, a routing and a
    delivery go nowhere but the store's rows, and no tracking row is made."""
    settings.MAILRELAY_EVENT_LOG = str(tmp_path / "events.jsonl") if logged else ""
    record.invalidate()  # no endpoint
    made, real = [], record.new
    monkeypatch.setattr(
        record, "new", lambda event, at, **f: made.append(event) or real(event, at, **f)
    )
    delivered_message(sink_factory, "bob@example.net")
    assert made == built


DELIVERIES = (delivery_queryset, live.VALUES)
ARRIVALS = (arrival_queryset, live.ARRIVAL_VALUES)
ROUTINGS = (routing_queryset, live.ROUTING_VALUES)


@pytest.mark.skipif(connection.vendor != "postgresql", reason="PostgreSQL's plans")
@pytest.mark.parametrize(
    ("source", "criteria", "index"),
    [
        (DELIVERIES, {}, "attempt_delivered"),
        (DELIVERIES, {"remote_id": "Q7Remote"}, "attempt_remote_id"),
        (DELIVERIES, {"recipient": "bob@example.net"}, "recipient_address_trgm"),
        (DELIVERIES, {"sender": "ann@example.org"}, "messagetext_mail_from_trgm"),
        (ARRIVALS, {}, "message_received"),
        (ARRIVALS, {"recipient": "bob@example.net"}, "recipient_address_trgm"),
        (ARRIVALS, {"sender": "ann@example.org"}, "messagetext_mail_from_trgm"),
        (ARRIVALS, {"message_id": "h1@example.org"}, "messagetext_msgid_trgm"),
        (ROUTINGS, {}, "recipient_routed"),
        (ROUTINGS, {"recipient": "bob@example.net"}, "recipient_address_trgm"),
        (ROUTINGS, {"sender": "ann@example.org"}, "messagetext_mail_from_trgm"),
        (ROUTINGS, {"message_id": "h1@example.org"}, "messagetext_msgid_trgm"),
    ],
)
def test_the_search_of_the_stores_events_reads_them_by_an_index(
    sink_factory, source, criteria, index
):
    grow_store(delivered_message(sink_factory, "bob@example.net"), 20000)
    queryset, values = source
    found = queryset(parse_query(criteria), None).values(*values)[:51]
    sql, params = found.query.sql_with_params()
    with connection.cursor() as cur:
        cur.execute(f"EXPLAIN {sql}", params)
        plan = "\n".join(line for (line,) in cur.fetchall())
    assert index in plan, plan
    for table in ("queues_attempt", "queues_message", "queues_recipient", "queues_messagetext"):
        assert f"Seq Scan on {table}" not in plan, plan
    if not criteria:  # the newest first in the index's order: no sort of them all
        assert "Sort" not in plan, plan
