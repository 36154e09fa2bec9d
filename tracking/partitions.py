"""Storage of the tracking rows: day partitions on PostgreSQL, a pruned table on SQLite.

PostgreSQL: ``tracking_event`` is partitioned by range of ``at``, one
partition per UTC day (``tracking_event_p20260124``), plus a default
partition that only catches rows outside the prepared days (a clock far off,
a beat that did not run for more than ``DAYS_AHEAD`` days). Beat runs
``maintain`` hourly: it creates the partitions of the next ``DAYS_AHEAD``
days (moving rows of those days out of the default partition first, under a
lock), drops partitions entirely older than ``MAILRELAY_TRACKING_RETENTION``
(a DROP TABLE, no big DELETE) and deletes expired rows of the default
partition in small batches. Each day is made or dropped on its own, and
dropping and pruning run whatever became of the making. When today's
partition is missing (rows of today already in the default one, which are
not moved while the day is written to) an Event ``tracking_partition`` says
so every run.

SQLite (the embedded default): one plain table, expired rows deleted in
batches of ``PRUNE_BATCH``.
"""

from __future__ import annotations

import logging
import re
import time
from dataclasses import dataclass, field
from datetime import UTC, date, datetime, timedelta

from django.db import IntegrityError, OperationalError, connection, transaction

log = logging.getLogger(__name__)

TABLE = "tracking_event"
DEFAULT_PARTITION = f"{TABLE}_default"
# Partitions are made this many days ahead: a beat stopped for up to a week
# still finds today's partition when it comes back.
DAYS_AHEAD = 10
PRUNE_BATCH = 5000
PRUNE_BATCHES_PER_RUN = 200  # up to 1,000,000 rows a run …
PRUNE_SECONDS = 120  # … or two minutes of deleting, whichever comes first
_NAME = re.compile(rf"^{TABLE}_p(\d{{8}})$")

COLUMNS_PG = """
    id bigserial NOT NULL,
    at timestamptz NOT NULL,
    event varchar(20) NOT NULL,
    event_id uuid NOT NULL,
    qid varchar(20) NOT NULL DEFAULT '',
    message_pk bigint NULL,
    message_id varchar(998) NOT NULL DEFAULT '',
    sender varchar(512) NOT NULL DEFAULT '',
    recipient varchar(512) NOT NULL DEFAULT '',
    client varchar(64) NOT NULL DEFAULT '',
    account varchar(150) NOT NULL DEFAULT '',
    size bigint NULL,
    queue varchar(255) NOT NULL DEFAULT '',
    next_hop varchar(1024) NOT NULL DEFAULT '',
    host varchar(300) NOT NULL DEFAULT '',
    ip varchar(64) NOT NULL DEFAULT '',
    tls varchar(160) NOT NULL DEFAULT '',
    code smallint NULL,
    enhanced varchar(16) NOT NULL DEFAULT '',
    reply text NOT NULL DEFAULT '',
    remote_id varchar(100) NOT NULL DEFAULT '',
    actor varchar(150) NOT NULL DEFAULT '',
    detail jsonb NOT NULL DEFAULT '{}'
"""

# One index per search kind (tracking.search); each ends with ``at`` where a
# search lists newest first, so a partition answers "newest 50 of X" from the
# index alone. Created on the parent, PostgreSQL adds them to every partition.
INDEXES = (
    ("tracking_event_at", "(at)"),
    ("tracking_event_qid", "(qid, at)"),
    # A hash: a Message-ID is the sender's text, up to 998 characters of UTF-8 (about
    # 4,000 bytes), more than a btree entry holds (2,704); search matches the hash
    # and the text (tracking.search).
    ("tracking_event_msgid_md5", "(md5(message_id), at)"),
    ("tracking_event_sender_nz", "(lower(sender), at)"),
    ("tracking_event_rcpt_nz", "(lower(recipient), at)"),
    ("tracking_event_remote", "(remote_id, at)"),
    ("tracking_event_event", "(event, at)"),
)
# Indexes of migration 0001 that 0002 replaced (dropped where they exist).
REPLACED = ("tracking_event_sender", "tracking_event_rcpt", "tracking_event_msgid")
# What SQLite indexes instead (it has no md5() of its own, and no entry size limit).
SQLITE_COLUMNS = {"tracking_event_msgid_md5": "(message_id, at)"}
# Indexes dropped for good (migration 0002), with their definition for a rollback.
DROPPED_DEFINITIONS: dict[str, str] = {}
DROPPED = tuple(DROPPED_DEFINITIONS)
# Partial where many rows have nothing to index (a search names a value, and
# tracking.search adds the same ``<> ''`` so the planner can use them): only
# ``received`` rows have a Message-ID, only ``delivered`` a remote id,
# message-wide rows have no recipient, DSNs have the null sender.
PARTIAL = {
    "tracking_event_msgid_md5": "message_id <> ''",
    "tracking_event_remote": "remote_id <> ''",
    "tracking_event_sender_nz": "sender <> ''",
    "tracking_event_rcpt_nz": "recipient <> ''",
}


def create_table(vendor: str) -> list[str]:
    """The statements that create the table and its indexes on ``vendor``."""
    if vendor == "postgresql":
        statements = [
            f"CREATE TABLE {TABLE} ({COLUMNS_PG}, PRIMARY KEY (id, at)) PARTITION BY RANGE (at)",
            f"CREATE TABLE {DEFAULT_PARTITION} PARTITION OF {TABLE} DEFAULT",
        ]
    else:
        columns = (
            COLUMNS_PG.replace("bigserial NOT NULL", "integer PRIMARY KEY AUTOINCREMENT")
            .replace("timestamptz", "datetime")
            .replace("uuid", "char(32)")
            .replace("jsonb", "text")
        )
        statements = [f"CREATE TABLE {TABLE} ({columns})"]
    statements.extend(create_indexes(vendor))
    return statements


def create_indexes(vendor: str = "postgresql") -> list[str]:
    """CREATE INDEX IF NOT EXISTS of every index (on the parent: every partition gets it)."""
    out = []
    for name, columns in INDEXES:
        if vendor != "postgresql":
            columns = SQLITE_COLUMNS.get(name, columns)
        where = f" WHERE {PARTIAL[name]}" if name in PARTIAL else ""
        out.append(f"CREATE INDEX IF NOT EXISTS {name} ON {TABLE} {columns}{where}")
    return out


def partition_name(day: date) -> str:
    return f"{TABLE}_p{day:%Y%m%d}"


def _bounds(day: date) -> tuple[datetime, datetime]:
    start = datetime(day.year, day.month, day.day, tzinfo=UTC)
    return start, start + timedelta(days=1)


def partitions() -> dict[date, str]:
    """The day partitions that exist (PostgreSQL)."""
    with connection.cursor() as cur:
        cur.execute(
            "SELECT c.relname FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid "
            "JOIN pg_class p ON p.oid = i.inhparent WHERE p.relname = %s",
            [TABLE],
        )
        names = [row[0] for row in cur.fetchall()]
    days = {}
    for name in names:
        match = _NAME.match(name)
        if match:
            days[datetime.strptime(match[1], "%Y%m%d").date()] = name
    return days


# ATTACH and DROP lock the parent table: never wait behind a long search while
# every writer queues up behind us; give up and try again at the next run.
LOCK_TIMEOUT = "2s"
# A day still written to: today, and yesterday for an hour after midnight (a
# ``received`` row is dated its message's arrival).
LIVE_GRACE = timedelta(hours=1)


class LiveRowsInDefault(Exception):
    """Rows of a day still written to wait in the default partition: not attached."""


def _default_has_rows(cur, start: datetime, end: datetime) -> bool:
    cur.execute(
        f"SELECT EXISTS (SELECT 1 FROM {DEFAULT_PARTITION} WHERE at >= %s AND at < %s)",
        [start, end],
    )
    return bool(cur.fetchone()[0])


def create_partition(day: date, now: datetime | None = None) -> None:
    """The partition of ``day``; rows of that day waiting in the default partition move in.

    The default partition is locked (SHARE ROW EXCLUSIVE: writers into it wait,
    searches go on) before the move, so no row of the day commits into it
    between the move and the ATTACH (which would fail with a CheckViolation).
    A writer that waited then fails PostgreSQL's re-check of the default
    partition's constraint, so a day still written to (``now`` within it) is
    not made while rows of it are in the default: ``LiveRowsInDefault``; its
    rows stay there (searchable, pruned after the retention).
    """
    name = partition_name(day)
    start, end = _bounds(day)
    with transaction.atomic(), connection.cursor() as cur:
        cur.execute(f"SET LOCAL lock_timeout = '{LOCK_TIMEOUT}'")
        if _default_has_rows(cur, start, end):
            if now is not None and start <= now < end + LIVE_GRACE:
                raise LiveRowsInDefault(name)
            cur.execute(f"LOCK TABLE {DEFAULT_PARTITION} IN SHARE ROW EXCLUSIVE MODE")
        cur.execute(f"CREATE TABLE IF NOT EXISTS {name} (LIKE {TABLE} INCLUDING DEFAULTS)")
        # The bounds as a constraint: ATTACH need not scan the new table.
        cur.execute(
            f"ALTER TABLE {name} ADD CONSTRAINT {name}_bounds CHECK (at >= %s AND at < %s)",
            [start, end],
        )
        cur.execute(
            f"WITH moved AS (DELETE FROM {DEFAULT_PARTITION} WHERE at >= %s AND at < %s "
            f"RETURNING *) INSERT INTO {name} SELECT * FROM moved",
            [start, end],
        )
        cur.execute(
            f"ALTER TABLE {TABLE} ATTACH PARTITION {name} FOR VALUES FROM (%s) TO (%s)",
            [start, end],
        )
        cur.execute(f"ALTER TABLE {name} DROP CONSTRAINT {name}_bounds")


@dataclass
class MaintenanceReport:
    created: list[str]
    dropped: list[str]
    pruned: int
    not_made: list[str] = field(default_factory=list)  # days due but not made this run
    today_missing: bool = False


def maintain(now: datetime, retention: timedelta) -> MaintenanceReport:
    """Prepare the coming days, drop or prune what is past ``retention``.

    Each day is made or dropped on its own (a lock timeout or a conflict skips
    that day until the next run); dropping and pruning run whatever became of
    the making of partitions.
    """
    cutoff = now - retention
    if connection.vendor != "postgresql":
        return MaintenanceReport(
            [],
            [],
            _prune(
                f"DELETE FROM {TABLE} WHERE id IN "
                f"(SELECT id FROM {TABLE} WHERE at < %s LIMIT {PRUNE_BATCH})",
                cutoff,
            ),
        )
    report = MaintenanceReport([], [], 0)
    try:
        _make_days(now, cutoff, report)
    finally:
        try:
            report.dropped = _drop_days(cutoff)
        finally:
            report.pruned = _prune(
                f"DELETE FROM {DEFAULT_PARTITION} WHERE ctid IN (SELECT ctid FROM "
                f"{DEFAULT_PARTITION} WHERE at < %s LIMIT {PRUNE_BATCH})",
                cutoff,
            )
    return report


def _make_days(now: datetime, cutoff: datetime, report: MaintenanceReport) -> None:
    existing = partitions()
    today = now.astimezone(UTC).date()
    for offset in range(-1, DAYS_AHEAD + 1):
        day = today + timedelta(days=offset)
        if day in existing or _bounds(day)[1] <= cutoff:
            continue
        name = partition_name(day)
        try:
            create_partition(day, now)
        except LiveRowsInDefault:
            log.warning("tracking partition %s not made: its rows are in the default one", name)
            report.not_made.append(name)
            continue
        except (OperationalError, IntegrityError):  # lock timeout; a row committed meanwhile
            log.warning("tracking partition %s not made now", name, exc_info=True)
            report.not_made.append(name)
            continue
        report.created.append(name)
        existing[day] = name
    if today not in existing:
        report.today_missing = True
        _today_missing(now, partition_name(today))


def _today_missing(now: datetime, name: str) -> None:
    """An Event: today's rows go to the default partition (beat did not run for days)."""
    from queues.models import Event, EventLevel

    text = (
        f"tracking partition {name} is missing: today's tracking rows go to the default "
        "partition (deleted row by row after the retention, not dropped); "
        "check that beat runs tracking.tasks.maintain hourly"
    )
    log.error(text)
    Event.objects.create(
        created_at=now,
        level=EventLevel.WARNING,
        kind="tracking_partition",
        text=text,
        data={"partition": name},
    )


def _drop_days(cutoff: datetime) -> list[str]:
    dropped = []
    for day, name in sorted(partitions().items()):
        if _bounds(day)[1] > cutoff:
            continue
        try:
            with transaction.atomic(), connection.cursor() as cur:
                cur.execute(f"SET LOCAL lock_timeout = '{LOCK_TIMEOUT}'")
                cur.execute(f"DROP TABLE {name}")
        except OperationalError:
            log.warning("tracking partition %s not dropped now", name, exc_info=True)
            continue
        dropped.append(name)
    return dropped


def _prune(sql: str, cutoff: datetime) -> int:
    """Delete in batches of ``PRUNE_BATCH`` until done, or ``PRUNE_SECONDS`` passed
    (the next hourly run goes on): about a million rows a run."""
    total = 0
    started = time.monotonic()
    for _ in range(PRUNE_BATCHES_PER_RUN):
        with connection.cursor() as cur:
            cur.execute(sql, [cutoff])
            deleted = cur.rowcount
        total += deleted
        if deleted < PRUNE_BATCH or time.monotonic() - started > PRUNE_SECONDS:
            break
    return total
