"""Group commit on ingress: several sessions' messages in one transaction, each
250 only after its commit; a failed batch answers nobody 250 and fails no
innocent message (they are stored one by one)."""

from __future__ import annotations

import concurrent.futures
import threading
import time
from collections.abc import Iterator

import pytest
from django.db import OperationalError, connection

from delivery.smtpd import server
from delivery.smtpd.server import GroupCommitter
from queues import accept
from queues.accept import IncomingEnvelope, IncomingRecipient, messages_accept
from queues.models import Message, Recipient

pytestmark = pytest.mark.django_db(transaction=True)

BODY = b"Subject: group\r\n\r\nbody\r\n"
POISON = "poison@example.net"


def envelope(rcpt: str) -> IncomingEnvelope:
    return IncomingEnvelope("sender@example.org", [IncomingRecipient(rcpt)])


@pytest.fixture
def poison_trigger() -> Iterator[callable]:
    """A real PostgreSQL error for the recipient POISON: at its insert, or (deferred) at COMMIT."""
    table = Recipient._meta.db_table
    made: list[str] = []

    def install(at_commit: bool = False) -> None:
        with connection.cursor() as cursor:
            cursor.execute(
                "CREATE OR REPLACE FUNCTION mr_test_poison() RETURNS trigger AS $$ BEGIN "
                f"IF NEW.address = '{POISON}' THEN RAISE EXCEPTION 'poisoned recipient'; END IF; "
                "RETURN NEW; END $$ LANGUAGE plpgsql"
            )
            if at_commit:
                cursor.execute(
                    f"CREATE CONSTRAINT TRIGGER mr_test_poison AFTER INSERT ON {table} "
                    "DEFERRABLE INITIALLY DEFERRED FOR EACH ROW EXECUTE FUNCTION mr_test_poison()"
                )
            else:
                cursor.execute(
                    f"CREATE TRIGGER mr_test_poison BEFORE INSERT ON {table} "
                    "FOR EACH ROW EXECUTE FUNCTION mr_test_poison()"
                )
        made.append(table)

    yield install
    with connection.cursor() as cursor:
        cursor.execute(f"DROP TRIGGER IF EXISTS mr_test_poison ON {table}")
        cursor.execute("DROP FUNCTION IF EXISTS mr_test_poison()")


def stored_addresses() -> set[str]:
    return set(Recipient.objects.values_list("address", flat=True))


# ------------------------------------------------------------ messages_accept


def test_a_batch_is_one_transaction_and_every_message_gets_its_row():
    batch = [(envelope(f"r{i}@example.net"), BODY) for i in range(5)]
    results = messages_accept(batch)
    assert all(isinstance(r, Message) and r.pk for r in results)
    assert stored_addresses() == {f"r{i}@example.net" for i in range(5)}
    for result in results:  # each message's recipients point at that message
        assert list(
            Recipient.objects.filter(message_id=result.pk).values_list("address", flat=True)
        )
    assert Message.objects.count() == 5


@pytest.mark.parametrize("at_commit", [False, True], ids=["at-insert", "at-commit"])
def test_a_failing_message_fails_alone_and_the_others_are_stored(poison_trigger, at_commit):
    poison_trigger(at_commit=at_commit)
    rcpts = ["a@example.net", "b@example.net", POISON, "c@example.net"]
    results = messages_accept([(envelope(r), BODY) for r in rcpts])
    assert [isinstance(r, Exception) for r in results] == [False, False, True, False]
    assert stored_addresses() == {"a@example.net", "b@example.net", "c@example.net"}
    committed = {r.qid for r in results if isinstance(r, Message)}
    assert set(Message.objects.values_list("qid", flat=True)) == committed


def test_a_connection_lost_after_the_commit_stores_nothing_twice(monkeypatch):
    original = accept.insert_many_with_children

    def commit_then_lose_the_reply(*args, **kwargs):
        original(*args, **kwargs)
        raise OperationalError("server closed the connection unexpectedly")

    monkeypatch.setattr(accept, "insert_many_with_children", commit_then_lose_the_reply)
    results = messages_accept([(envelope(f"r{i}@example.net"), BODY) for i in range(3)])
    assert all(isinstance(r, Message) for r in results)
    assert Message.objects.count() == 3  # found by queue id, not stored again


def test_a_connection_lost_before_the_commit_stores_each_message_once(monkeypatch):
    def lost(*args, **kwargs):
        raise OperationalError("server closed the connection unexpectedly")

    monkeypatch.setattr(accept, "insert_many_with_children", lost)
    results = messages_accept([(envelope(f"r{i}@example.net"), BODY) for i in range(3)])
    assert all(isinstance(r, Message) for r in results)
    assert Message.objects.count() == 3


# ------------------------------------------------------------ the committer


def held_committer(threads: int, first_size: int):
    """A committer whose first batch ("m0", ``first_size`` bytes) waits in the
    database until released; the batches it stored (a message "bad" fails), and
    the events of the first one's release and of the next batch's start."""
    entered, release, second = threading.Event(), threading.Event(), threading.Event()
    calls: list[list[str]] = []

    def store_batch(batch):
        calls.append([env for env, _data in batch])
        if len(calls) == 1:
            entered.set()
            assert release.wait(10)
        else:
            second.set()
        return [ValueError(env) if env == "bad" else f"qid-{env}" for env, _data in batch]

    committer = GroupCommitter(threads, store_batch=store_batch)
    first = committer.submit("m0", b"x" * first_size)
    assert entered.wait(10)
    return committer, first, calls, release, second


def test_the_committer_batches_what_waits_and_answers_each_message():
    committer, first, calls, release, _second = held_committer(1, 1)
    try:
        rest = [committer.submit(name, b"x") for name in ("m1", "bad", "m2")]
        release.set()
        assert first.result(10) == "qid-m0"
        assert [f.exception(10) is not None for f in rest] == [False, True, False]
        assert rest[0].result() == "qid-m1" and rest[2].result() == "qid-m2"
        assert calls == [["m0"], ["m1", "bad", "m2"]]  # the waiting three in one batch
    finally:
        committer.shutdown()


def test_beside_a_small_batch_in_the_database_the_next_waits_and_takes_all_that_came():
    """Two committer threads: while one small batch commits, the messages that
    arrive meanwhile are the next batch, not a batch of one on the other thread."""
    committer, first, calls, release, second = held_committer(2, 100)
    try:
        rest = [committer.submit("m1", b"x")]
        assert not second.wait(0.3)  # the other thread did not store m1 alone
        rest += [committer.submit(name, b"x") for name in ("m2", "m3")]
        release.set()
        assert [f.result(10) for f in [first, *rest]] == ["qid-m0", "qid-m1", "qid-m2", "qid-m3"]
        assert calls == [["m0"], ["m1", "m2", "m3"]]
    finally:
        release.set()
        committer.shutdown()


def test_beside_a_large_batch_in_the_database_the_next_one_starts_at_once():
    """A large message's insert does not hold up the small ones behind it."""
    committer, first, calls, release, second = held_committer(2, server.OVERLAP_ABOVE)
    try:
        small = committer.submit("m1", b"x")
        assert second.wait(10) and small.result(10) == "qid-m1"
        assert not first.done()  # stored while the large one is still in the database
        release.set()
        assert first.result(10) == "qid-m0"
        assert calls == [["m0"], ["m1"]]
    finally:
        release.set()
        committer.shutdown()


def test_a_batch_that_raises_fails_every_message_of_it():
    def store_batch(batch):
        raise OperationalError("database down")

    committer = GroupCommitter(1, store_batch=store_batch)
    try:
        future = committer.submit("m", b"x")
        with pytest.raises(OperationalError):
            future.result(10)
    finally:
        committer.shutdown()


# ------------------------------------------------------------ over SMTP


@pytest.mark.parametrize("at_commit", [False, True], ids=["at-insert", "at-commit"])
def test_over_smtp_the_failing_message_gets_451_and_the_others_250(
    start_ingress, monkeypatch, poison_trigger, at_commit
):
    """Five sessions' messages wait while a commit runs, then go in one batch that
    fails: each message is stored alone, the poisoned one answered 451, the
    others 250, and every 250 is a committed message."""
    poison_trigger(at_commit=at_commit)
    entered, release = threading.Event(), threading.Event()
    batches: list[int] = []
    original = server._store_batch

    def held_store_batch(batch):
        batches.append(len(batch))
        if len(batches) == 1:
            entered.set()
            assert release.wait(10)
        return original(batch)

    monkeypatch.setattr(server, "_store_batch", held_store_batch)
    ingress = start_ingress(db_threads=1)  # one committer thread
    committer = ingress.server._committer
    assert committer is not None
    rcpts = ["a@example.net", "b@example.net", POISON, "c@example.net", "d@example.net"]
    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        first = pool.submit(ingress.send, BODY, rcpt_to=["first@example.net"])
        assert entered.wait(10)
        replies = [pool.submit(ingress.send, BODY, rcpt_to=[r]) for r in rcpts]
        deadline = time.monotonic() + 10
        while committer._jobs.qsize() < len(rcpts):  # all five wait for the committer
            assert time.monotonic() < deadline
            time.sleep(0.01)
        release.set()
        assert first.result(10)[0] == 250
        codes = [r.result(10)[0] for r in replies]
    assert codes == [250, 250, 451, 250, 250]
    assert batches == [1, 5]
    assert stored_addresses() == {"first@example.net"} | (set(rcpts) - {POISON})


def test_a_batch_that_committed_and_whose_lookup_failed_is_not_stored_twice(monkeypatch):
    """The connection is lost after the commit and the queue-id lookup fails as
    well: storing each message again meets its own queue id; that is the message
    (250), not a 451 that makes the client send it a second time."""
    original = accept.insert_many_with_children

    def commit_then_lose_the_reply(*args, **kwargs):
        original(*args, **kwargs)
        raise OperationalError("server closed the connection unexpectedly")

    monkeypatch.setattr(accept, "insert_many_with_children", commit_then_lose_the_reply)
    monkeypatch.setattr(accept, "_already_stored", lambda qids: {})
    results = messages_accept([(envelope(f"r{i}@example.net"), BODY) for i in range(3)])
    assert all(isinstance(r, Message) and r.pk for r in results), results
    assert Message.objects.count() == 3
    assert stored_addresses() == {f"r{i}@example.net" for i in range(3)}


def test_a_batch_stays_within_postgresql_s_parameter_limit(caplog):
    """Four messages of 1000 recipients (the default MAILRELAY_MAX_RECIPIENTS) do
    not fit one statement (65535 parameters): the committer makes batches that
    do, instead of one that fails and four stored one by one."""
    entered, release = threading.Event(), threading.Event()
    calls: list[int] = []

    def store_batch(batch):
        calls.append(len(batch))
        if len(calls) == 1:
            entered.set()
            assert release.wait(10)
        return messages_accept(batch)

    big = [
        IncomingEnvelope(
            "sender@example.org", [IncomingRecipient(f"r{i}-{n}@example.net") for n in range(1000)]
        )
        for i in range(5)
    ]
    committer = GroupCommitter(1, store_batch=store_batch)
    try:
        first = committer.submit(big[0], BODY)
        assert entered.wait(10)
        rest = [committer.submit(env, BODY) for env in big[1:]]
        release.set()
        assert all(isinstance(f.result(30), Message) for f in [first, *rest])
    finally:
        committer.shutdown()
    assert calls == [1, 2, 2]
    assert "storing them one by one" not in caplog.text
    assert Recipient.objects.count() == 5000


def test_an_error_after_the_batch_committed_answers_its_messages_stored(monkeypatch):
    """Not only a lost connection: any error once the statement committed leaves
    the messages stored; they are found by queue id, not refused and stored again."""
    original = accept.insert_many_with_children

    def commit_then_fail(*args, **kwargs):
        original(*args, **kwargs)
        raise KeyError("a bug after the INSERT returned")

    monkeypatch.setattr(accept, "insert_many_with_children", commit_then_fail)
    results = messages_accept([(envelope(f"r{i}@example.net"), BODY) for i in range(3)])
    assert all(isinstance(r, Message) for r in results)
    assert Message.objects.count() == 3


def test_the_ingress_inserts_rows_without_building_a_model_instance(monkeypatch):
    """The committer stores prepared rows (``NewRow``): no ``Message`` or
    ``Recipient`` is built for a message that is stored, and every field
    arrives as the model instance would have stored it."""
    prepared = [accept.prepare_message(envelope(f"r{i}@example.net"), BODY) for i in range(3)]
    expected = [p.message for p in prepared]  # the instance each row stands for
    built: list[str] = []
    for model in (Message, Recipient):
        init = model.__init__

        def counted(self, *args, _init=init, _name=model.__name__, **kwargs):
            built.append(_name)
            _init(self, *args, **kwargs)

        monkeypatch.setattr(model, "__init__", counted)
    results = accept.prepared_accept_many(prepared)
    assert built == []
    assert [r.qid for r in results] == [p.qid for p in prepared]
    monkeypatch.undo()
    fields = [f.attname for f in Message._meta.concrete_fields if f.attname not in ("id", "data")]
    for i, (want, result) in enumerate(zip(expected, results, strict=True)):
        stored = Message.objects.get(qid=want.qid)
        assert stored.pk == result.row.pk
        assert [getattr(stored, f) for f in fields] == [getattr(want, f) for f in fields]
        assert bytes(stored.data).endswith(BODY)
        rcpt = Recipient.objects.get(message=stored)
        assert (rcpt.address, rcpt.domain, rcpt.state) == (
            f"r{i}@example.net",
            "example.net",
            "submitted",
        )


def test_a_new_row_reads_as_its_instance():
    row = accept.NewRow(Recipient, address="a@example.net", domain="example.net")
    instance = row.instance()
    assert row.address == instance.address == "a@example.net"
    assert row.state == instance.state == "submitted"  # the field's default
    assert instance._state.adding and instance.pk is None
    with pytest.raises(AttributeError):
        row.no_such_field  # noqa: B018 - the read is the test
    with pytest.raises(KeyError):
        accept.NewRow(Recipient, no_such_field=1)
    row.pk = 7
    saved = row.instance()
    assert saved.pk == 7 and not saved._state.adding
    two = [accept.NewRow(Message).event_id for _ in range(2)]
    assert two[0] != two[1]  # a default made per row is made for each row
