"""The hot paths' statements per batch: a batch of many messages costs the same
statements as a batch of few (per-batch SQL, never per-message SQL).

Counted with Django's CaptureQueriesContext on the real PostgreSQL, with real
sinks on loopback and the loopback DNS server; a regression that adds a query
per message (or per recipient) shows as a count that grows with the batch.
"""

from __future__ import annotations

import concurrent.futures
import queue
import re
from collections import deque
from datetime import timedelta

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext

from delivery.qmgr.tasks import categorize_pending
from delivery.smtp import deliver
from queues.accept import IncomingEnvelope, IncomingRecipient, message_accept
from queues.models import Attempt, Link, Message, MessageState, Recipient, RecipientState
from queues.transitions.flow import Claim, deliveries_heard
from tracking import record

pytestmark = pytest.mark.django_db

BODY = b"From: a@example.org\r\nTo: x\r\nSubject: hot path\r\n\r\nbody\r\n"

# What a batch costs today on PostgreSQL (test transactions count their
# SAVEPOINTs too): pinned, so an added statement is a decision, not an accident.
# The tracking rows go in a savepoint of their own (tracking.record.write: a
# failed tracking insert must not undo a delivery): SAVEPOINT + RELEASE, 2 each.
# A delivery writes no tracking row (its attempt is its event: tracking.history):
# 3 fewer than when its row went into tracking_event (32). A batch of new
# messages neither: their arrivals and routings are their rows (9; 12 when
# the routings went into tracking_event, with its SAVEPOINT and RELEASE).
CATEGORIZE_STATEMENTS = 9
DELIVER_STATEMENTS = 29
# Each finished message is committed before its connection's next transaction
# (one record for whatever finished meanwhile on any connection). A delivery
# that owes no "relayed" report is one statement of the store
# (Recipient.objects.record_delivered: recipients, attempts — which are the
# deliveries' tracking events too —, finished messages). The link, queue and
# cleared retry data wait for the round's end. With no tracking row to write
# beside it (no webhook endpoint, no event log: queues.transitions.deliveries_heard)
# the statement is its own transaction: 1. It was 9 (a SELECT of the rows, four
# writes, a savepoint), then 4 (the tracking rows' INSERT beside it), then 3 (in
# a transaction: the test's two savepoints; BEGIN and COMMIT in production).
EARLY_RECORD_STATEMENTS = 1


@pytest.fixture
def relay(dns_settings, settings, smtp_port, sink_factory, monkeypatch):
    settings.MAILRELAY_REMOTE_SMTP_PORT = smtp_port
    settings.MAILRELAY_SMTP_CONNECT_TIMEOUT = timedelta(seconds=2)
    settings.MAILRELAY_SMTP_CLIENT_TIMEOUT = timedelta(seconds=5)
    dns_settings.a("example.net", "127.0.0.2")
    # One record per round (no early records): their number depends on timing.
    monkeypatch.setattr(deliver, "RECORD_EACH_MESSAGE", False)
    # The webhook endpoints are read once per CONFIG_TTL (10 s): warm_up reads
    # them, and they must not expire between the batches compared.
    monkeypatch.setattr(record, "CONFIG_TTL", 3600.0)
    record.invalidate()
    yield sink_factory("127.0.0.2")
    record.invalidate()


def accept_many(n: int, tag: str, domain: str = "example.net") -> list[Message]:
    return [
        message_accept(
            IncomingEnvelope(
                mail_from="a@example.org",
                recipients=[IncomingRecipient(f"{tag}{i}@{domain}")],
                client_address="127.0.0.1",
                client_helo="client.test",
            ),
            BODY,
        )
        for i in range(n)
    ]


def warm_up() -> None:
    """The first message creates the link and its queue (and fills the caches)."""
    accept_many(1, "first")
    while categorize_pending():
        pass
    assert deliver.deliver_link(Link.objects.get().pk) == 1


def categorize_and_count(n: int, tag: str) -> list[str]:
    """The statements of one categorizer batch of ``n`` messages."""
    accept_many(n, tag)
    with CaptureQueriesContext(connection) as queries:
        assert categorize_pending() == n
    return [q["sql"][:160] for q in queries]


def deliver_and_count(n: int, tag: str) -> int:
    accept_many(n, tag)
    while categorize_pending():
        pass
    link_id = Link.objects.get().pk
    with CaptureQueriesContext(connection) as queries:
        assert deliver.deliver_link(link_id) == n
    return len(queries)


def test_categorizing_a_batch_costs_the_same_statements_for_3_or_40_messages(relay):
    warm_up()
    few = categorize_and_count(3, "few")
    many = categorize_and_count(40, "many")
    shown = "\n".join(["few:", *few, "many:", *many])
    assert len(few) == len(many), shown
    assert len(many) == CATEGORIZE_STATEMENTS, shown
    batches = Message.objects.exclude(recipients__address__startswith="first")
    assert set(batches.values_list("state", flat=True)) == {MessageState.QUEUED}
    assert batches.count() == 43
    waiting = Recipient.objects.exclude(address__startswith="first")
    assert set(waiting.values_list("state", flat=True)) == {RecipientState.QUEUED}


def test_delivering_a_round_costs_the_same_statements_for_3_or_40_messages(relay):
    warm_up()
    few = deliver_and_count(3, "few")
    many = deliver_and_count(40, "many")
    assert few == many
    assert many == DELIVER_STATEMENTS
    assert len(relay.messages) == 44
    assert set(Message.objects.values_list("state", flat=True)) == {MessageState.DONE}
    assert set(Recipient.objects.values_list("state", flat=True)) == {RecipientState.DELIVERED}


def test_a_finished_message_is_made_durable_in_a_few_statements(relay, monkeypatch, settings):
    """One connection, so one message per early record: what each costs."""
    monkeypatch.setattr(deliver, "RECORD_EACH_MESSAGE", True)
    settings.MAILRELAY_MAX_CONNECTIONS_PER_DESTINATION = 1
    settings.MAILRELAY_MAX_MESSAGES_PER_CONNECTION = 100
    warm_up()
    few = deliver_and_count(3, "few")
    many = deliver_and_count(40, "many")
    assert many - few == EARLY_RECORD_STATEMENTS * (40 - 3)
    assert len(relay.messages) == 44
    assert set(Recipient.objects.values_list("state", flat=True)) == {RecipientState.DELIVERED}
    assert Attempt.objects.count() == 44


def test_a_round_whose_results_were_all_recorded_early_reads_none_again(relay, monkeypatch):
    """The round's final record writes what the early records left it (the
    link, its queues, the retry data); when they wrote every result, it does not
    read the round's recipient rows again (no row can be found: none of the
    results is left)."""
    monkeypatch.setattr(deliver, "RECORD_EACH_MESSAGE", True)
    warm_up()
    accept_many(3, "early")
    while categorize_pending():
        pass
    with CaptureQueriesContext(connection) as queries:
        assert deliver.deliver_link(Link.objects.get().pk) == 3
    reads = [
        q["sql"]
        for q in queries
        if q["sql"].startswith("SELECT") and '"queues_recipient"."lease_owner" =' in q["sql"]
    ]
    assert reads == []
    assert set(Recipient.objects.values_list("state", flat=True)) == {RecipientState.DELIVERED}
    assert Attempt.objects.count() == 4


def test_an_early_record_heard_by_a_webhook_is_one_transaction_with_its_tracking_rows(
    relay, monkeypatch, settings, webhook_endpoint
):
    """With an enabled webhook endpoint a delivery is a tracking row too: each
    early record is then its statement and that row's INSERT in one
    transaction (here the test's savepoint and its release around them)."""
    monkeypatch.setattr(deliver, "RECORD_EACH_MESSAGE", True)
    settings.MAILRELAY_MAX_CONNECTIONS_PER_DESTINATION = 1
    settings.MAILRELAY_MAX_MESSAGES_PER_CONNECTION = 100
    assert not deliveries_heard()
    webhook_endpoint("delivered")
    assert deliveries_heard()
    warm_up()
    few = deliver_and_count(3, "few")
    many = deliver_and_count(40, "many")
    assert many - few == (EARLY_RECORD_STATEMENTS + 3) * (40 - 3)
    assert set(Recipient.objects.values_list("state", flat=True)) == {RecipientState.DELIVERED}


def test_bodies_asked_for_at_once_are_read_in_one_statement():
    """Bodies too large to come with the round's envelopes are read when their
    connections ask (delivery.smtp.deliver._give_bodies): the requests waiting
    together cost one SELECT; a request whose connection stopped meanwhile is
    skipped, a message no longer stored fails its own request only."""
    stored = accept_many(3, "large")
    gone = stored[2].pk
    Message.objects.filter(pk=gone).delete()
    futures = [concurrent.futures.Future() for _ in range(3)]
    stopped: concurrent.futures.Future = concurrent.futures.Future()
    stopped.cancel()  # its connection stopped (claim lost) before the read
    wanted = [(stored[0].pk, futures[0]), (stored[1].pk, stopped), (stored[1].pk, futures[1])]
    wanted.append((gone, futures[2]))
    claim = Claim("test", lambda until: True, lease=timedelta(seconds=30))
    with CaptureQueriesContext(connection) as queries:
        deliver._give_bodies(claim, wanted)
    assert len(queries) == 1
    for message, future in zip(stored[:2], futures, strict=False):
        assert future.result() == bytes(Message.objects.get(pk=message.pk).data)
    assert stopped.cancelled()
    with pytest.raises(LookupError, match=f"message {gone} is no longer stored"):
        futures[2].result()


def test_the_bodies_read_together_are_those_asked_for_before_the_next_record():
    """The owner reads at once the body requests at the front of its backlog
    and, only when nothing else waits there, those queued meanwhile; a record
    request met on the way stays in order for the next turn."""
    first, body2, body3, body4 = ((n, object()) for n in range(1, 5))
    sent = ("sent", [], object())
    backlog = deque([body2, sent, body3])
    requests: queue.SimpleQueue = queue.SimpleQueue()
    requests.put(body4)
    assert deliver._bodies_wanted(first, backlog, requests) == [first, body2]
    assert list(backlog) == [sent, body3] and requests.get_nowait() == body4

    backlog = deque()
    for item in (body2, sent, body3):
        requests.put(item)
    assert deliver._bodies_wanted(first, backlog, requests) == [first, body2]
    assert list(backlog) == [sent] and requests.get_nowait() == body3


def prepared() -> dict[str, int]:
    """The statements prepared on this connection, each with the times it ran
    (PostgreSQL counts a plan per run: generic or custom)."""
    with connection.cursor() as cur:
        cur.execute("SELECT statement, generic_plans + custom_plans FROM pg_prepared_statements")
        return dict(cur.fetchall())


def test_the_batch_inserts_are_prepared_once_and_nothing_that_finds_rows_is(relay):
    """MAILRELAY_DB_PREPARE (on by default): the tracking rows' and the attempts'
    inserts are parsed and planned once per connection, and a second batch runs
    them again. No statement that finds rows (a claim, a placement, a round's
    record) is prepared, but for the calls of the pinned functions: a generic
    plan made while the table was small would keep scanning it as it grows (a
    pinned function's own statements keep plans pinned to the indexes: below;
    the call's plan is a function scan)."""
    warm_up()
    # A recipient the categorizer cannot route (no such domain) in each batch:
    # its failure is a tracking row (arrivals, routings and deliveries are the
    # store's rows).
    accept_many(1, "one", "nowhere.invalid")
    deliver_and_count(3, "one")
    first = prepared()
    tracking = [text for text in first if text.startswith("INSERT INTO tracking_event")]
    attempts = [text for text in first if text.startswith("INSERT INTO queues_attempt")]
    assert len(tracking) == 1 and len(attempts) == 1, first
    finding = [text for text in first if not text.lstrip().startswith(("INSERT", "WITH p AS"))]
    assert [text for text in finding if not pinned_call(text)] == []
    accept_many(1, "two", "nowhere.invalid")
    deliver_and_count(40, "two")
    second = prepared()
    for text in (*tracking, *attempts):
        assert second[text] > first[text], text  # run again, not prepared again
    finding = [text for text in second if not text.lstrip().startswith(("INSERT", "WITH p AS"))]
    assert [text for text in finding if not pinned_call(text)] == []


def test_the_pinned_functions_are_called_by_prepared_statements(relay, monkeypatch):
    """Each pinned function's call is prepared once per connection and run again
    by the next batch: the ids go as bound arrays, not as literals psycopg
    quotes in Python and the server parses at every call."""
    monkeypatch.setattr(deliver, "RECORD_EACH_MESSAGE", True)  # a round's early records
    warm_up()
    deliver_and_count(3, "one")
    first = {text: runs for text, runs in prepared().items() if pinned_call(text)}
    called = {function for function in PINNED for text in first if f"{function}(" in text}
    assert called == set(PINNED), first
    deliver_and_count(40, "two")
    second = prepared()
    for text in first:
        assert second[text] > first[text], text  # run again, not prepared again


def pinned_call(text: str) -> bool:
    """A call of one of the pinned functions (PINNED, below)."""
    return re.match(r"SELECT (\* FROM )?queues_\w+\(", text.lstrip()) is not None and any(
        f"{function}(" in text for function in PINNED
    )


def test_with_prepare_off_the_hot_paths_prepare_nothing(relay, settings):
    """Behind a pooler without prepared statements: nothing is prepared, and
    the mail goes through all the same."""
    settings.MAILRELAY_DB_PREPARE = False
    before = prepared()
    warm_up()
    deliver_and_count(3, "off")
    assert prepared() == before
    assert relay.wait_for(4)


def locked(table: str, pk: int) -> bool:
    """Whether the row's current version carries a lock a committed transaction
    left on it (its xmax, set without a newer version: a lock, not an update)."""
    with connection.cursor() as cur:
        cur.execute(f"SELECT xmax::text <> '0' FROM {table} WHERE id = %s", [pk])
        return cur.fetchone()[0]


@pytest.mark.django_db(transaction=True)  # the locks a real COMMIT leaves behind
def test_a_message_s_path_locks_no_row_it_only_refers_to(relay):
    """Accepted, placed and delivered, each step committed: no foreign-key check
    locked the message, the recipient or the queue a step only refers to (a
    lookup, a row lock and its WAL record at each COMMIT; on the queue row that
    every placement and record shares, a MultiXact: migration 0013)."""
    warm_up()
    [message] = accept_many(1, "locks")
    recipient = message.recipients.get()
    assert not locked("queues_message", message.pk)  # by the recipient's insert
    while categorize_pending():
        pass
    recipient.refresh_from_db()
    assert recipient.queue_id is not None
    assert not locked("queues_queue", recipient.queue_id)  # by the placement
    assert deliver.deliver_link(Link.objects.get().pk) == 1
    assert Attempt.objects.filter(recipient=recipient).count() == 1
    for table, pk in (
        ("queues_message", message.pk),
        ("queues_recipient", recipient.pk),
        ("queues_queue", recipient.queue_id),
    ):
        assert not locked(table, pk), table  # by the attempt's insert


# The statements of the pinned functions (migration queues/0014), by a line of each.
PINNED = {
    "queues_claim_for_categorizer": "LIMIT p_limit FOR UPDATE SKIP LOCKED",
    "queues_to_route": "r.message_id = ANY(p_ids) AND r.state = 'submitted'",
    "queues_resubmit_if_recipients_submitted": "SET state = 'submission', next_attempt_at = p_now",
    "queues_record_delivered": "json_to_recordset(p_rows)",
    "queues_lease_recipients": "SET state = 'active', lease_owner = p_owner",
    "queues_queue_owned": "m.state = v_categorizing AND m.lease_owner = p_owner",
    "queues_place_recipients": "FROM unnest(p_ids, p_queues, p_links)",
}


def nested_plans(monkeypatch) -> list[str]:
    """auto_explain's plans of every statement (nested ones too) while a warm-up
    and a batch of three are categorized and delivered with early records."""
    monkeypatch.setattr(deliver, "RECORD_EACH_MESSAGE", True)
    plans: list[str] = []
    pg = connection.cursor().connection  # the psycopg connection (opened)
    pg.add_notice_handler(lambda diag: plans.append(diag.message_primary or ""))
    with connection.cursor() as cur:
        cur.execute("LOAD 'auto_explain'")
        cur.execute("SET auto_explain.log_min_duration = 0")
        cur.execute("SET auto_explain.log_nested_statements = on")
        cur.execute("SET client_min_messages = log")
    try:
        warm_up()
        deliver_and_count(3, "plans")
    finally:
        with connection.cursor() as cur:
            cur.execute("RESET client_min_messages")
            cur.execute("RESET auto_explain.log_min_duration")
    return plans


def test_the_statements_that_find_rows_are_planned_once_on_their_indexes(relay, monkeypatch):
    """The categorizer's claim, read and check for recipients sent back, a
    round's lease and an early record of deliveries, run as functions whose plan
    is made once per connection (a generic plan: its conditions keep the
    parameters, $1, …) with sequential scans off: every row reached by an index,
    whatever the tables' size and statistics when the plan was made."""
    with connection.cursor() as cur:
        cur.execute(
            "SELECT proname, proconfig FROM pg_proc WHERE proname = ANY(%s)", [list(PINNED)]
        )
        settings = dict(cur.fetchall())
    assert set(settings) == set(PINNED)
    for config in settings.values():
        assert {"plan_cache_mode=force_generic_plan", "enable_seqscan=off"} <= set(config)
    plans = nested_plans(monkeypatch)
    for function, line in PINNED.items():
        seen = [plan for plan in plans if line in plan]
        assert len(seen) >= 2, function  # the warm-up's and the batch's
        for plan in seen:
            assert "Seq Scan" not in plan and "Index" in plan, plan
            assert re.search(r"\$\d", plan), plan  # generic: the parameters kept ($1, …)


def whole_index_reads(plan: str) -> list[str]:
    """The index scans of an EXPLAIN text with no ``Index Cond``: each reads its
    index whole, and a partial index keeps every entry of the rows that left its
    predicate (dead versions) until VACUUM, so such a read grows with the queue's
    past, not with the batch."""
    lines = plan.splitlines()
    whole = []
    for at, line in enumerate(lines):
        node = re.search(r"(Bitmap Index Scan on|Index Scan using|Index Only Scan using) \S+", line)
        if node is None:
            continue
        start = node.start()
        details = []
        for detail in lines[at + 1 :]:
            if "->" in detail or len(detail) - len(detail.lstrip()) < start:
                break
            details.append(detail)
        if not any("Index Cond:" in detail for detail in details):
            whole.append(node.group(0))
    return whole


def test_whole_index_reads_are_found_in_a_plan():
    plan = (
        "Update on queues_message m\n"
        "  ->  Nested Loop Semi Join\n"
        "        Join Filter: (m.id = r.message_id)\n"
        "        ->  Bitmap Heap Scan on queues_message m\n"
        "              Recheck Cond: ((state)::text <> 'done'::text)\n"
        "              ->  Bitmap Index Scan on message_live_expiry\n"
        "        ->  Index Scan using recipient_submitted on queues_recipient r\n"
        "              Filter: ((state)::text = 'submitted'::text)\n"
        "        ->  Index Scan using queues_message_pkey on queues_message m\n"
        "              Index Cond: (id = ANY ($1))\n"
    )
    assert whole_index_reads(plan) == [
        "Bitmap Index Scan on message_live_expiry",
        "Index Scan using recipient_submitted",
    ]


def test_the_statements_that_find_rows_by_id_read_no_index_whole(relay, monkeypatch):
    """Each pinned statement reaches its rows through an index condition (a
    batch's ids, a message's id, the due time), never by reading a partial index
    whole: a generic plan made on the first batch, while the tables are small and
    unanalyzed, must not take a state's partial index for a short list (it was
    the check for recipients sent back: every message not done, read at every
    batch, 2.5 ms a batch after 8,000 messages)."""
    plans = nested_plans(monkeypatch)
    for function, line in PINNED.items():
        seen = [plan for plan in plans if line in plan]
        assert len(seen) >= 2, function
        for plan in seen:
            assert whole_index_reads(plan) == [], plan


def test_without_its_settings_a_function_plans_each_run_anew(relay, monkeypatch):
    """What the settings change: without them (PostgreSQL's default, a custom
    plan for each of the first runs) the claim's plans hold the values of the
    run they were made for."""
    with connection.cursor() as cur:  # rolled back with the test's transaction
        cur.execute(
            "ALTER FUNCTION queues_claim_for_categorizer(timestamptz, integer, text, timestamptz)"
            " RESET ALL"
        )
    plans = nested_plans(monkeypatch)
    claims = [plan for plan in plans if PINNED["queues_claim_for_categorizer"] in plan]
    assert len(claims) >= 2
    for plan in claims:
        assert "$1" not in plan and "timestamp with time zone" in plan, plan


def test_the_record_function_writes_every_column_of_an_attempt():
    """``queues_record_delivered`` names the attempt's columns in its text
    (migration queues/0014): a column added to Attempt needs a migration that
    replaces the function, or an early record would leave it empty."""
    with connection.cursor() as cur:
        cur.execute("SELECT prosrc FROM pg_proc WHERE proname = 'queues_record_delivered'")
        [source] = cur.fetchone()
    listed = re.search(r"INSERT INTO queues_attempt \(([^)]*)\)", source).group(1)
    written = {name.strip() for name in listed.split(",")}
    columns = {field.column for field in Attempt._meta.concrete_fields}
    assert written == columns - {"id"}
