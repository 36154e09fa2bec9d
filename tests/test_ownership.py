"""Ownership follows liveness: claims renewed by live owners, taken back from dead ones.

In-process, with real sinks on loopback and real PostgreSQL. Tests about the
lease itself shorten it; the real-process tests at the default settings are in
tests/test_ownership_system.py and tests/test_faults.py.
"""

from __future__ import annotations

import threading
import time
from datetime import timedelta

import pytest

from delivery.qmgr.sweep import reclaim, sweep
from delivery.qmgr.tasks import _process, categorize_pending
from delivery.qmgr.tasks import claim_batch as claim_for_categorizer
from delivery.smtp.deliver import deliver_link
from queues.accept import IncomingEnvelope, IncomingRecipient, message_accept
from queues.lib import clock
from queues.models import (
    Attempt,
    DeliveryType,
    Link,
    Message,
    MessageState,
    Recipient,
    RecipientState,
)
from queues.transitions.flow import Claim, while_renewing
from tests.support.pipeline import drain

BODY = b"From: a@example.org\r\nTo: x\r\nSubject: t\r\n\r\nbody\r\n"


def accept(*rcpts: str, body: bytes = BODY) -> Message:
    env = IncomingEnvelope(
        mail_from="a@example.org",
        recipients=[IncomingRecipient(r) for r in rcpts],
        client_address="127.0.0.1",
        client_helo="client.test",
    )
    return message_accept(env, body)


@pytest.fixture
def relay(dns_settings, settings, smtp_port):
    settings.MAILRELAY_REMOTE_SMTP_PORT = smtp_port
    settings.MAILRELAY_SMTP_CONNECT_TIMEOUT = timedelta(seconds=2)
    settings.MAILRELAY_SMTP_CLIENT_TIMEOUT = timedelta(seconds=10)
    return dns_settings


# --- exact poison counting -----------------------------------------------------------


@pytest.mark.django_db
def test_a_batch_whose_categorizer_died_is_not_blamed_on_every_message(relay, settings):
    """A hard crash of a batch counts against nobody; its messages are then tried
    one at a time, and only the one that keeps killing its worker goes to Poison."""
    settings.MAILRELAY_POISON_THRESHOLD = 2
    relay.a("example.net", "127.0.0.2")
    messages = [accept(f"u{i}@example.net") for i in range(4)]
    killer = messages[2]
    lease = settings.MAILRELAY_DELIVERY_LEASE

    # The whole batch is claimed, and the worker dies (nothing is written).
    assert sorted(claim_for_categorizer("dies-with-batch", 10)) == [m.pk for m in messages]
    assert set(Message.objects.values_list("crash_count", flat=True)) == {0}
    clock.advance(lease + timedelta(seconds=1))
    assert reclaim().messages_reclaimed == 4
    assert set(Message.objects.values_list("isolate", flat=True)) == {True}

    # From now on each is claimed alone. The killer kills its worker every time
    # (twice: the threshold); the others are routed by the worker that took them.
    crashes = 0
    while crashes < 2:
        ids = claim_for_categorizer("one-at-a-time", 10)
        assert len(ids) == 1
        if ids == [killer.pk]:
            crashes += 1
            clock.advance(lease + timedelta(seconds=1))
            reclaim()
        else:
            _process(ids, "one-at-a-time")
    assert Message.objects.get(pk=killer.pk).crash_count == 2
    while categorize_pending():  # the third claim of the killer parks it
        pass
    innocent = Message.objects.exclude(pk=killer.pk)
    assert set(innocent.values_list("state", flat=True)) == {MessageState.QUEUED}
    assert set(innocent.values_list("crash_count", flat=True)) == {0}
    assert not innocent.filter(suspended=True).exists()
    killer = Message.objects.get(pk=killer.pk)
    assert killer.suspended
    assert Recipient.objects.get(message=killer).queue.delivery_type == DeliveryType.POISON
    assert killer.events.filter(kind="poison").count() == 1


@pytest.mark.django_db
def test_a_batch_claim_counts_no_crash_and_a_claim_of_one_does(relay):
    accept("a@example.net")
    accept("b@example.net")
    ids = claim_for_categorizer("batch", 10)
    assert len(ids) == 2
    assert list(Message.objects.values_list("crash_count", flat=True)) == [0, 0]
    Message.objects.update(state=MessageState.SUBMISSION, lease_owner="", isolate=True)
    assert len(claim_for_categorizer("alone", 10)) == 1
    assert sorted(Message.objects.values_list("crash_count", flat=True)) == [0, 1]


# --- renewal while working; loss of a claim ----------------------------------------


@pytest.mark.django_db(transaction=True)
def test_a_live_round_keeps_its_claim_past_the_lease_and_sends_one_copy(
    relay, sink_factory, settings
):
    """A next hop slower than the lease: the owner renews while it waits, so the
    sweep running all the while takes nothing back, and each message goes once."""
    settings.MAILRELAY_DELIVERY_LEASE = timedelta(seconds=0.9)  # renewed every 0.3 s
    relay.a("example.net", "127.0.0.2")
    sink = sink_factory("127.0.0.2", delays={"DATA": 1.2})
    for i in range(3):
        accept(f"u{i}@example.net")
    while categorize_pending():
        pass
    link = Link.objects.get()
    stop = threading.Event()
    reclaimed: list[int] = []

    def sweeper() -> None:
        from django.db import connection

        try:
            while not stop.is_set():
                reclaimed.append(reclaim().recipients_reclaimed)
                time.sleep(0.1)
        finally:
            connection.close()

    thread = threading.Thread(target=sweeper)
    thread.start()
    try:
        started = time.monotonic()
        assert deliver_link(link.pk) == 3
        assert time.monotonic() - started > 3 * 0.9  # the round outlived its lease
    finally:
        stop.set()
        thread.join()
    assert sum(reclaimed) == 0
    assert sorted(m.rcpt_tos[0] for m in sink.messages) == [f"u{i}@example.net" for i in range(3)]
    assert set(Recipient.objects.values_list("state", flat=True)) == {RecipientState.DELIVERED}
    assert Attempt.objects.count() == 3


@pytest.mark.django_db(transaction=True)
def test_a_round_that_loses_its_claim_stops_before_its_next_message(relay, sink_factory, settings):
    """Another owner took the link meanwhile: the message in progress completes,
    the next is never sent, and what was not tried waits again (not ACTIVE)."""
    settings.MAILRELAY_DELIVERY_LEASE = timedelta(seconds=0.6)
    settings.MAILRELAY_MAX_CONNECTIONS_PER_DESTINATION = 1
    relay.a("example.net", "127.0.0.2")
    sink = sink_factory("127.0.0.2", delays={"DATA": 0.5})
    for i in range(4):
        accept(f"u{i}@example.net")
    while categorize_pending():
        pass
    link = Link.objects.get()

    def steal() -> None:
        from django.db import connection

        try:
            assert sink.wait_for(1, timeout=10)
            Link.objects.filter(pk=link.pk).update(
                lease_owner="someone-else", lease_until=clock.now() + timedelta(hours=1)
            )
        finally:
            connection.close()

    thief = threading.Thread(target=steal)
    thief.start()
    deliver_link(link.pk)
    thief.join()
    sent = len(sink.messages)
    assert 1 <= sent < 4
    states = list(Recipient.objects.values_list("state", flat=True))
    assert states.count(RecipientState.DELIVERED) == sent
    assert RecipientState.ACTIVE not in states
    assert Attempt.objects.count() == sent
    Link.objects.filter(pk=link.pk).update(lease_owner="", lease_until=None)
    drain()
    assert len(sink.messages) == 4
    assert len({m.rcpt_tos[0] for m in sink.messages}) == 4


def test_a_claim_that_cannot_be_renewed_for_a_lease_is_lost():
    calls = []

    def failing(until):
        calls.append(until)
        raise ConnectionError("database unreachable")

    claim = Claim("test", failing, lease=timedelta(seconds=0.3))
    claim.renew()
    assert claim.held()  # one failure is not a loss
    time.sleep(0.31)
    claim.renew()
    assert not claim.held()
    assert len(calls) == 2


class MovableClock:
    """A monotonic clock that tests move by hand."""

    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def test_a_frozen_owner_loses_its_claim_by_its_own_clock_before_the_lease_ends():
    """Nobody tells a frozen (SIGSTOP) or cut-off owner that it lost: when it
    wakes, time alone says so, before anyone else may have taken its rows."""
    now = MovableClock()
    claim = Claim(
        "test", lambda until: True, lease=timedelta(seconds=30), monotonic=now, acquired_at=now.t
    )
    margin = settings_margin()
    now.t += 30 - margin - 0.01
    assert claim.held()
    now.t += 0.02  # past the lease less the margin: the sweep's reclaim is near
    assert not claim.held()
    claim.renew()  # a renewal that succeeds later does not bring it back
    assert not claim.held()


def test_a_claim_counts_from_the_start_of_a_slow_renewal():
    """A renewal whose answer took 20 s bought the lease from when it was sent."""
    now = MovableClock()

    def slow(until):
        now.t += 20
        return True

    claim = Claim("test", slow, lease=timedelta(seconds=30), monotonic=now, acquired_at=now.t)
    now.t += 10
    claim.renew()  # sent at +10, answered at +30: valid until +10 + 30 - margin
    assert claim.held()
    now.t = 1000 + 10 + 30 - settings_margin() + 0.01
    assert not claim.held()


def test_a_renewal_that_keeps_failing_stops_the_owner_within_the_lease_less_the_margin():
    now = MovableClock()

    def failing(until):
        raise ConnectionError("database unreachable")

    claim = Claim("test", failing, lease=timedelta(seconds=30), monotonic=now, acquired_at=now.t)
    for _ in range(2):
        now.t += 10
        claim.renew()
        assert claim.held()  # two failed renewals are not a loss yet
    now.t += 30 - 20 - settings_margin()
    assert not claim.held()


def test_the_margin_is_at_most_a_third_of_a_short_lease(settings):
    settings.MAILRELAY_DELIVERY_LEASE_MARGIN = timedelta(seconds=5)
    assert Claim("t", lambda u: True, lease=timedelta(seconds=3)).valid_for == 2.0
    assert Claim("t", lambda u: True, lease=timedelta(seconds=30)).valid_for == 25.0


def settings_margin() -> float:
    from django.conf import settings

    return settings.MAILRELAY_DELIVERY_LEASE_MARGIN.total_seconds()


def test_a_claim_whose_rows_were_taken_is_lost_at_once():
    claim = Claim("test", lambda until: False, lease=timedelta(seconds=30))
    claim.renew()
    assert not claim.held()


def test_while_renewing_renews_the_claim_while_the_work_runs_and_hands_back_its_outcome():
    renewals: list[object] = []
    lease = timedelta(seconds=0.3)
    claim = Claim("test", lambda until: renewals.append(until) or True, lease=lease)

    def slow() -> str:
        time.sleep(0.35)
        return "done"

    assert while_renewing(claim, slow) == "done"
    assert len(renewals) >= 2  # every 0.1 s
    assert claim.held()

    def cut() -> None:
        time.sleep(0.05)
        raise TimeoutError("the work's own deadline")

    # the work's TimeoutError is its outcome, not the wait's
    with pytest.raises(TimeoutError, match="own deadline"):
        while_renewing(claim, cut)


@pytest.mark.django_db(transaction=True)
def test_a_cut_off_owners_locked_rows_never_stall_the_reclaim(relay, settings):
    """A host partitioned away in the middle of a transaction leaves its session
    idle in it, holding its rows: the reclaim takes every other expired claim at
    once, and PostgreSQL ends the idle session (the relay's connection options),
    after which those rows are taken too."""
    import psycopg
    from django.db import connection

    from delivery.smtp.deliver import claim_round

    relay.a("example.net", "127.0.0.2")
    for i in range(4):
        accept(f"u{i}@example.net")
    while categorize_pending():
        pass
    link = Link.objects.get()
    assert claim_round(link.pk, "gone-host/1", 2) and claim_round(link.pk, "dead-host/1", 2)
    params = connection.get_connection_params()
    assert "idle_in_transaction_session_timeout=15000" in params["options"]
    params["options"] = params["options"].replace("=15000", "=1500")  # 1.5 s for the test
    zombie = psycopg.connect(**params)
    zombie.execute(
        "UPDATE queues_recipient SET last_text = 'sent' WHERE lease_owner = 'gone-host/1'"
    )  # ... and its COMMIT never arrives
    clock.advance(settings.MAILRELAY_DELIVERY_LEASE + timedelta(seconds=1))
    started = time.monotonic()
    assert reclaim().recipients_reclaimed == 2  # the dead host's rows, not the locked ones
    assert time.monotonic() - started < 1.0
    time.sleep(2.0)  # PostgreSQL ends the session that sat idle in its transaction
    with pytest.raises(psycopg.errors.IdleInTransactionSessionTimeout):
        zombie.execute("SELECT 1")
    assert reclaim().recipients_reclaimed == 2
    assert set(Recipient.objects.values_list("state", flat=True)) == {RecipientState.QUEUED}
    assert not Recipient.objects.filter(last_text="sent").exists()  # rolled back


@pytest.mark.django_db
def test_the_reclaim_takes_back_a_dead_round_and_rings_its_link(relay, sink_factory, settings):
    from delivery.smtp.deliver import claim_round

    relay.a("example.net", "127.0.0.2")
    sink = sink_factory("127.0.0.2")
    accept("u@example.net")
    while categorize_pending():
        pass
    link = Link.objects.get()
    Link.objects.acquire(link.pk, "dead-task", clock.now(), settings.MAILRELAY_DELIVERY_LEASE)
    assert claim_round(link.pk, "dead-task/1", 10)
    assert reclaim().recipients_reclaimed == 0  # the lease still runs
    clock.advance(settings.MAILRELAY_DELIVERY_LEASE + timedelta(seconds=1))
    report = reclaim()
    assert (report.recipients_reclaimed, report.links_reclaimed) == (1, 1)
    assert report.links_rung == [link.pk]
    r = Recipient.objects.get()
    assert (r.state, r.lease_owner) == (RecipientState.QUEUED, "")
    sweep()
    drain()
    assert len(sink.messages) == 1


@pytest.mark.django_db(transaction=True)
def test_a_round_survives_its_database_connection_being_cut(relay, sink_factory):
    """The owner's PostgreSQL session is terminated while the peer holds the
    final dot (as a database restart would): the owner reconnects, renews,
    records every attempt, and nothing is sent twice."""
    from django.db import connection

    relay.a("example.net", "127.0.0.2")
    sink = sink_factory("127.0.0.2", delays={"DATA": 1.0})
    for i in range(3):
        accept(f"u{i}@example.net")
    while categorize_pending():
        pass
    link = Link.objects.get()
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_backend_pid()")
        (owner_pid,) = cursor.fetchone()

    def cut() -> None:
        from django.db import connection as own

        try:
            assert sink.wait_until(lambda: "DATA" in sink.verbs(), timeout=10)
            with own.cursor() as cursor:
                cursor.execute("SELECT pg_terminate_backend(%s)", [owner_pid])
                assert cursor.fetchone()[0]
        finally:
            own.close()

    cutter = threading.Thread(target=cut)
    cutter.start()
    assert deliver_link(link.pk) == 3
    cutter.join()
    assert sorted(m.rcpt_tos[0] for m in sink.messages) == [f"u{i}@example.net" for i in range(3)]
    assert set(Recipient.objects.values_list("state", flat=True)) == {RecipientState.DELIVERED}
    assert Attempt.objects.count() == 3


class CutOnce:
    """A connection's execute wrapper that ends the owner's PostgreSQL session
    once, at the first statement ``matches`` picks (as a restart would end it):
    ``before`` it runs, or after it ran and — a lost reply — after its commit."""

    def __init__(self, matches, *, after: bool = False) -> None:
        self.matches, self.after, self.cut = matches, after, False

    def __call__(self, execute, sql, params, many, context):
        from django.db import connection, transaction

        if self.cut or not self.matches(sql):
            return execute(sql, params, many, context)
        self.cut = True
        if not self.after:
            self._end(connection)
            return execute(sql, params, many, context)  # the session is gone: raises
        result = execute(sql, params, many, context)

        def lost_reply() -> None:
            self._end(connection)
            with connection.cursor() as cursor:
                cursor.execute("SELECT 1")  # raises: the reply never comes

        if connection.in_atomic_block:
            transaction.on_commit(lost_reply)
        else:
            lost_reply()
        return result

    @staticmethod
    def _end(connection) -> None:
        pid = connection.connection.info.backend_pid
        other = threading.Thread(target=_terminate, args=(pid,))
        other.start()
        other.join()


def _terminate(pid: int) -> None:
    from django.db import connection

    try:
        with connection.cursor() as cursor:
            cursor.execute("SELECT pg_terminate_backend(%s)", [pid])
            assert cursor.fetchone()[0]
    finally:
        connection.close()


CUT_AT = {
    # The reads of a round, outside its writes (which ride out outages already).
    "the link": lambda sql: sql.startswith("SELECT") and 'FROM "queues_link"' in sql,
    "the claim": lambda sql: "SKIP LOCKED" in sql and '"queues_recipient"."message_id"' in sql,
    "the envelopes": lambda sql: sql.startswith("SELECT") and '"queues_recipient"."orcpt"' in sql,
    "the retry data": lambda sql: sql.startswith("SELECT") and "queues_retryhint" in sql,
}


def queued_for_a_sink(relay, sink_factory, n: int):
    """``n`` messages (u0@… onwards) categorized onto the link of a live sink."""
    relay.a("example.net", "127.0.0.2")
    sink = sink_factory("127.0.0.2")
    for i in range(n):
        accept(f"u{i}@example.net")
    while categorize_pending():
        pass
    return sink, Link.objects.get()


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("where", [*CUT_AT, "the claim's lost reply"])
def test_a_round_rides_out_its_connection_cut_while_it_reads(relay, sink_factory, where):
    """The owner's session ends while the round reads what it sends (a
    PostgreSQL restart): the round reconnects and goes on under its claim, at
    once, instead of ending the task and leaving its link and rows to wait out
    their lease (30 s). A claim whose COMMIT happened but whose reply was lost
    is the round's claim when tried again: nothing is left held by nobody."""
    from django.db import connection

    sink, link = queued_for_a_sink(relay, sink_factory, 3)
    if where == "the claim's lost reply":
        cut = CutOnce(
            lambda sql: sql.startswith('UPDATE "queues_recipient" SET "state"'), after=True
        )
    else:
        cut = CutOnce(CUT_AT[where])
    started = time.monotonic()
    with connection.execute_wrapper(cut):
        handled = deliver_link(link.pk)
    elapsed = time.monotonic() - started
    assert cut.cut
    assert handled == 3
    assert sorted(m.rcpt_tos[0] for m in sink.messages) == [f"u{i}@example.net" for i in range(3)]
    assert set(Recipient.objects.values_list("state", flat=True)) == {RecipientState.DELIVERED}
    assert Link.objects.get().lease_owner == ""
    assert elapsed < 10, f"{elapsed:.1f}s: the round waited for a lease"


@pytest.mark.django_db(transaction=True)
def test_a_round_whose_record_crashed_is_parked_across_a_connection_cut(
    relay, sink_factory, settings, monkeypatch
):
    """A bug in the round's record, and then the owner's session ends as the
    round parks its rows (a PostgreSQL restart): the park is tried again under
    the claim, so the rows wait their retry interval, not held by a round
    that is gone until the lease and the reclaim hand them on."""
    from django.db import connection

    from delivery.smtp import deliver as deliver_module

    sink, link = queued_for_a_sink(relay, sink_factory, 2)

    def broken(*args, **kwargs):
        raise RuntimeError("a bug in recording")

    monkeypatch.setattr(deliver_module, "_record", broken)
    monkeypatch.setattr(deliver_module, "_record_delivered", broken)  # the early record's
    cut = CutOnce(
        lambda sql: sql.startswith('UPDATE "queues_recipient" SET') and '"last_text" = ' in sql
    )
    with connection.execute_wrapper(cut):
        deliver_link(link.pk)
    assert cut.cut
    rows = list(Recipient.objects.all())
    assert {(r.state, r.lease_owner) for r in rows} == {(RecipientState.DEFERRED, "")}
    assert all(
        r.next_attempt_at > clock.now() + settings.MAILRELAY_MESSAGE_RETRY_INTERVAL / 2
        for r in rows
    )
    assert set(Message.objects.values_list("crash_count", flat=True)) == {1}


@pytest.mark.django_db(transaction=True)
def test_a_delivery_task_run_again_after_an_outage_keeps_its_link(relay, sink_factory):
    """The link's lease is taken, and the reply lost with the connection: the
    task runs again once the database answers, as the same owner, so the lease
    it took is its own and it delivers at once (a new owner would find the link
    held and leave it for 30 s)."""
    from django.db import connection

    from delivery.qmgr.tasks import deliver_link as task

    sink, link = queued_for_a_sink(relay, sink_factory, 2)
    cut = CutOnce(lambda sql: sql.startswith('UPDATE "queues_link" SET "lease_owner"'), after=True)
    started = time.monotonic()
    with connection.execute_wrapper(cut):
        handled = task(link.pk)
    assert cut.cut
    assert handled == 2
    assert time.monotonic() - started < 10
    assert sorted(m.rcpt_tos[0] for m in sink.messages) == ["u0@example.net", "u1@example.net"]
    assert Link.objects.get().lease_owner == ""


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("where", ["the claim's lost reply", "the busy links"])
def test_a_categorizer_task_rides_out_its_connection_cut(relay, bells, where):
    """The categorizer's claim commits and its reply is lost with the session
    (a PostgreSQL restart): the task runs again once the database answers,
    under the same owner, and routes the batch it holds at once — not after
    the lease and the reclaim, which would bring the messages back isolated,
    one a batch. Cut after the batch committed (the running links looked up),
    it rings every link it placed on."""
    from django.db import connection

    from delivery.qmgr.tasks import categorize

    relay.a("example.net", "127.0.0.2")
    ids = [accept(f"u{i}@example.net").pk for i in range(3)]
    if where == "the claim's lost reply":
        cut = CutOnce(lambda sql: "queues_claim_for_categorizer(" in sql, after=True)
    else:
        cut = CutOnce(lambda sql: sql.startswith('SELECT "queues_link"."id" AS "id" FROM'))
    started = time.monotonic()
    with connection.execute_wrapper(cut):
        assert categorize() == 3
    assert cut.cut
    assert time.monotonic() - started < 10
    rows = Message.objects.filter(pk__in=ids)
    assert set(rows.values_list("state", flat=True)) == {MessageState.QUEUED}
    assert set(rows.values_list("isolate", "crash_count")) == {(False, 0)}
    assert Link.objects.get().pk in bells.links


@pytest.mark.django_db(transaction=True)
def test_a_categorizer_task_s_first_run_looks_for_no_batch_it_holds(relay, bells):
    """A task's owner is new on its first run, so it holds nothing: only a rerun
    after an outage (above) looks for the batch its owner claimed."""
    from django.db import connection
    from django.test.utils import CaptureQueriesContext

    from delivery.qmgr.tasks import categorize

    relay.a("example.net", "127.0.0.2")
    accept("u0@example.net")
    with CaptureQueriesContext(connection) as queries:
        assert categorize() == 1
    held = '"queues_message"."lease_until" >'  # MessageFlow.claim_held's condition
    assert [q["sql"] for q in queries if held in q["sql"]] == []


def deliver_watching(sink, link_id: int) -> tuple[int, list[tuple[int, int]]]:
    """``deliver_link`` while a thread samples, every 10 ms, (MAIL commands the
    sink has seen, recipients recorded delivered); returns both."""
    from django.db import connection

    seen: list[tuple[int, int]] = []
    done = threading.Event()

    def watch() -> None:
        try:
            while not done.is_set():
                mails = sink.verbs().count("MAIL")
                # read after the sink: the count can only have grown meanwhile
                recorded = Recipient.objects.filter(state=RecipientState.DELIVERED).count()
                seen.append((mails, recorded))
                time.sleep(0.01)
        finally:
            connection.close()

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        return deliver_link(link_id), seen
    finally:
        done.set()
        watcher.join()


@pytest.mark.django_db(transaction=True)
def test_each_outcome_is_committed_before_its_connection_sends_the_next_mail_from(
    relay, sink_factory, settings
):
    """Durable before the next transaction: whenever the next hop has seen the
    MAIL FROM of a connection's k+1-th message, the k messages before it are
    recorded delivered, so a crash can re-send only the one in flight."""
    relay.a("example.net", "127.0.0.2")
    sink = sink_factory("127.0.0.2", delays={"MAIL": 0.1})
    for i in range(8):
        accept(f"u{i}@example.net")
    while categorize_pending():
        pass
    link = Link.objects.get()
    settings.MAILRELAY_MAX_CONNECTIONS_PER_DESTINATION = 1  # one message after the other
    handled, seen = deliver_watching(sink, link.pk)
    assert handled == 8
    assert len(sink.messages) == 8
    assert any(mails >= 5 for mails, _ in seen), seen  # it watched the round
    late = [(mails, recorded) for mails, recorded in seen if recorded < mails - 1]
    assert not late, f"a MAIL FROM went out before the previous outcome was committed: {late}"


@pytest.mark.django_db(transaction=True)
def test_with_several_connections_a_record_gathers_their_results_and_each_stays_durable_first(
    relay, sink_factory, settings, monkeypatch
):
    """Several connections: an early record waits RECORD_GATHER for the others'
    results to join its commit (fewer, larger records), and still every
    connection's outcome is committed before that connection's next MAIL FROM."""

    from delivery.smtp import deliver

    relay.a("example.net", "127.0.0.2")
    sink = sink_factory("127.0.0.2", delays={"MAIL": 0.05})
    for i in range(12):
        accept(f"u{i}@example.net")
    while categorize_pending():
        pass
    link = Link.objects.get()
    settings.MAILRELAY_MAX_CONNECTIONS_PER_DESTINATION = 3
    settings.MAILRELAY_MAX_MESSAGES_PER_CONNECTION = 4  # three connections of four
    # Long enough that the three connections' results always meet in one record.
    monkeypatch.setattr(deliver, "RECORD_GATHER", 0.3)
    sizes: list[int] = []
    record_early = deliver._record_early

    def counted(link, results, *args):  # noqa: ANN001, ANN202 - _record_early's own
        sizes.append(len(results))
        return record_early(link, results, *args)

    monkeypatch.setattr(deliver, "_record_early", counted)
    handled, seen = deliver_watching(sink, link.pk)
    assert handled == 12
    assert len(sink.messages) == 12
    # The three connections' results meet in each record (without the gather:
    # records of 1, 2 or 3 as they happen to arrive, e.g. [3, 2, 1, 2, 1, 1, 2]).
    assert sizes == [3, 3, 3, 3], sizes
    # At most the message in flight on each of the three connections unrecorded.
    late = [(mails, recorded) for mails, recorded in seen if recorded < mails - 3]
    assert not late, f"a MAIL FROM went out before the previous outcome was committed: {late}"


@pytest.mark.django_db(transaction=True)
def test_a_round_records_finished_messages_while_it_goes_on(relay, sink_factory, settings):
    """Deliveries are recorded while the round still sends (each before its
    connection's next transaction), so a worker killed in the middle of a round
    re-sends only what it had not recorded yet, not the whole round."""
    from django.db import connection

    relay.a("example.net", "127.0.0.2")
    sink = sink_factory("127.0.0.2", delays={"DATA": 0.4})
    for i in range(6):
        accept(f"u{i}@example.net")
    while categorize_pending():
        pass
    link = Link.objects.get()
    seen: list[tuple[int, int]] = []  # (at the sink, delivered in the database)

    def watch() -> None:
        try:
            while len(sink.messages) < 6:
                at_sink = len(sink.messages)
                recorded = Recipient.objects.filter(state=RecipientState.DELIVERED).count()
                seen.append((at_sink, recorded))
                time.sleep(0.05)
        finally:
            connection.close()

    settings.MAILRELAY_MAX_CONNECTIONS_PER_DESTINATION = 1  # one message after the other
    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        assert deliver_link(link.pk) == 6
    finally:
        watcher.join()
    # While the sink had not yet all six, some were already recorded delivered.
    assert any(recorded >= 2 and at_sink < 6 for at_sink, recorded in seen), seen
    assert Attempt.objects.count() == 6  # each attempt recorded once
    assert set(Recipient.objects.values_list("state", flat=True)) == {RecipientState.DELIVERED}
