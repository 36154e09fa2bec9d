"""Day partitions of the tracking table after beat stopped for days: a row that
commits into the default partition between the move and the ATTACH costs that
day only (later days are made, old ones dropped, the default pruned); today's
rows already in the default stay there (moving them would fail the writers
that wait on the lock) and an Event says today's partition is missing; the
default partition is locked before rows move out of it. Real PostgreSQL."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest
from django.db import connection

from queues.models import Event
from tracking import partitions, record
from tracking.models import TrackingEvent

pytestmark = pytest.mark.django_db

RETENTION = timedelta(days=30)


def far_ahead() -> datetime:
    """Noon of a day a year and a half ahead: no partition of it, nor of its neighbours."""
    day = (datetime.now(UTC) + timedelta(days=540)).date()
    return datetime(day.year, day.month, day.day, 12, tzinfo=UTC)


def in_default(qid: str) -> bool:
    with connection.cursor() as cur:
        cur.execute(f"SELECT count(*) FROM {partitions.DEFAULT_PARTITION} WHERE qid = %s", [qid])
        return cur.fetchone()[0] == 1


def names(now: datetime, days: range) -> list[str]:
    return [partitions.partition_name((now + timedelta(days=d)).date()) for d in days]


def test_a_row_committed_before_the_attach_costs_that_day_only(monkeypatch):
    assert connection.vendor == "postgresql"
    now = far_ahead()
    old = partitions.partitions()  # the real days, all past the retention seen from `now`
    record.write([record.new("received", now - timedelta(days=300), qid="EXPIRED")])
    victim = partitions.partition_name((now + timedelta(days=2)).date())

    def concurrent_commit(execute, sql, params, many, context):
        # What a writer committing a row of the day between the move and the
        # ATTACH does; here in our own transaction, so the ATTACH fails for real.
        if "ATTACH PARTITION" in sql and victim in sql:
            execute(
                f"INSERT INTO {partitions.DEFAULT_PARTITION} (at, event, event_id) "
                "VALUES (%s, 'received', gen_random_uuid())",
                [now + timedelta(days=2, hours=1)],
                False,
                context,
            )
        return execute(sql, params, many, context)

    with connection.execute_wrapper(concurrent_commit):
        report = partitions.maintain(now, RETENTION)
    assert report.not_made == [victim]
    made = [n for n in names(now, range(1, partitions.DAYS_AHEAD + 1)) if n != victim]
    assert set(made) <= set(report.created)
    assert sorted(report.dropped) == sorted(old.values())  # dropping ran all the same
    assert report.pruned == 1 and not TrackingEvent.objects.filter(qid="EXPIRED").exists()
    # The next run makes the day, its row moving out of the default partition.
    report = partitions.maintain(now, RETENTION)
    assert report.created == [victim] and report.not_made == []


def test_todays_rows_in_the_default_stay_there_and_an_event_says_so():
    now = far_ahead()
    assert partitions.DAYS_AHEAD >= 7
    record.write(
        [
            record.new("deferred", now - timedelta(hours=2), qid="TODAY"),
            record.new("deferred", now - timedelta(days=4), qid="STUCK"),  # an older day
        ]
    )
    report = partitions.maintain(now, RETENTION)
    today = partitions.partition_name(now.date())
    assert report.today_missing and today in report.not_made
    assert today not in report.created
    # Tomorrow and the days after are made: from midnight on, rows go to partitions.
    assert set(names(now, range(1, partitions.DAYS_AHEAD + 1))) <= set(report.created)
    assert in_default("TODAY") and in_default("STUCK")
    assert TrackingEvent.objects.filter(qid="TODAY").count() == 1  # searchable there
    event = Event.objects.get(kind="tracking_partition")
    assert today in event.text and event.level == "warning"
    # Rows stuck in the default partition are deleted once past the retention.
    report = partitions.maintain(now + RETENTION + timedelta(days=5), RETENTION)
    assert report.pruned == 2
    assert not TrackingEvent.objects.filter(qid__in=["TODAY", "STUCK"]).exists()


def test_the_default_partition_is_locked_before_rows_move_out_of_it():
    now = far_ahead()
    yesterday = now - timedelta(days=1)  # no longer written to: its rows move
    record.write([record.new("routed", yesterday, qid="YDAY")])
    held = []

    def watch(execute, sql, params, many, context):
        if sql.startswith("WITH moved AS"):
            with connection.cursor() as cur:
                cur.execute(
                    "SELECT mode FROM pg_locks WHERE pid = pg_backend_pid() "
                    "AND relation = %s::regclass",
                    [partitions.DEFAULT_PARTITION],
                )
                held.extend(row[0] for row in cur.fetchall())
        return execute(sql, params, many, context)

    with connection.execute_wrapper(watch):
        report = partitions.maintain(now, RETENTION)
    name = partitions.partition_name(yesterday.date())
    assert name in report.created
    assert "ShareRowExclusiveLock" in held
    assert not in_default("YDAY")
    with connection.cursor() as cur:
        cur.execute(f"SELECT qid FROM {name}")
        assert cur.fetchall() == [("YDAY",)]


def test_pruning_runs_even_when_making_a_partition_crashes(monkeypatch):
    now = far_ahead()
    record.write([record.new("received", now - timedelta(days=300), qid="EXPIRED")])

    def broken(day, now=None):
        raise RuntimeError("unexpected")

    monkeypatch.setattr(partitions, "create_partition", broken)
    with pytest.raises(RuntimeError):
        partitions.maintain(now, RETENTION)
    assert not TrackingEvent.objects.filter(qid="EXPIRED").exists()
