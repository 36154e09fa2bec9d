"""Storage of the tracking rows: day partitions on PostgreSQL, a pruned table on SQLite.

PostgreSQL: ``tracking_event`` is partitioned by range of ``at``, one
partition per UTC day (``tracking_event_p20260124``), plus a default
partition that only catches rows outside the prepared days (a clock far off,
a beat that did not run). Beat runs ``maintain`` hourly: it creates the
partitions of the next days (moving rows of those days out of the default
partition first), drops partitions entirely older than
``MAILRELAY_TRACKING_RETENTION`` (a DROP TABLE, no big DELETE) and deletes
expired rows of the default partition in small batches.

SQLite (the embedded default): one plain table, expired rows deleted in
batches of ``PRUNE_BATCH``.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from datetime import UTC, date, datetime, timedelta

from django.db import OperationalError, connection, transaction

log = logging.getLogger(__name__)

TABLE = "tracking_event"
DEFAULT_PARTITION = f"{TABLE}_default"
DAYS_AHEAD = 3
PRUNE_BATCH = 5000
PRUNE_BATCHES_PER_RUN = 20
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
    ("tracking_event_msgid", "(message_id, at)"),
    ("tracking_event_sender", "(lower(sender), at)"),
    ("tracking_event_rcpt", "(lower(recipient), at)"),
    ("tracking_event_remote", "(remote_id, at)"),
    ("tracking_event_event", "(event, at)"),
)
# Partial where most rows have nothing to index.
PARTIAL = {
    "tracking_event_msgid": "message_id <> ''",
    "tracking_event_remote": "remote_id <> ''",
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
    for name, columns in INDEXES:
        where = f" WHERE {PARTIAL[name]}" if name in PARTIAL else ""
        statements.append(f"CREATE INDEX {name} ON {TABLE} {columns}{where}")
    return statements


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


def create_partition(day: date) -> None:
    """The partition of ``day``; rows of that day waiting in the default partition move in."""
    name = partition_name(day)
    start, end = _bounds(day)
    with transaction.atomic(), connection.cursor() as cur:
        cur.execute(f"SET LOCAL lock_timeout = '{LOCK_TIMEOUT}'")
        cur.execute(f"CREATE TABLE IF NOT EXISTS {name} (LIKE {TABLE} INCLUDING DEFAULTS)")
        cur.execute(
            f"WITH moved AS (DELETE FROM {DEFAULT_PARTITION} WHERE at >= %s AND at < %s "
            f"RETURNING *) INSERT INTO {name} SELECT * FROM moved",
            [start, end],
        )
        cur.execute(
            f"ALTER TABLE {TABLE} ATTACH PARTITION {name} FOR VALUES FROM (%s) TO (%s)",
            [start, end],
        )


@dataclass
class MaintenanceReport:
    created: list[str]
    dropped: list[str]
    pruned: int


def maintain(now: datetime, retention: timedelta) -> MaintenanceReport:
    """Prepare the coming days, drop or prune what is past ``retention``."""
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
    existing = partitions()
    created = []
    today = now.astimezone(UTC).date()
    for offset in range(-1, DAYS_AHEAD + 1):
        day = today + timedelta(days=offset)
        if day not in existing and _bounds(day)[1] > cutoff:
            try:
                create_partition(day)
            except OperationalError:  # lock_timeout: the next run makes it
                log.warning(
                    "tracking partition %s not made now", partition_name(day), exc_info=True
                )
                continue
            created.append(partition_name(day))
    dropped = []
    for day, name in sorted(existing.items()):
        if _bounds(day)[1] <= cutoff:
            try:
                with transaction.atomic(), connection.cursor() as cur:
                    cur.execute(f"SET LOCAL lock_timeout = '{LOCK_TIMEOUT}'")
                    cur.execute(f"DROP TABLE {name}")
            except OperationalError:
                log.warning("tracking partition %s not dropped now", name, exc_info=True)
                continue
            dropped.append(name)
    pruned = _prune(
        f"DELETE FROM {DEFAULT_PARTITION} WHERE ctid IN (SELECT ctid FROM "
        f"{DEFAULT_PARTITION} WHERE at < %s LIMIT {PRUNE_BATCH})",
        cutoff,
    )
    return MaintenanceReport(created, dropped, pruned)


def _prune(sql: str, cutoff: datetime) -> int:
    total = 0
    for _ in range(PRUNE_BATCHES_PER_RUN):
        with connection.cursor() as cur:
            cur.execute(sql, [cutoff])
            deleted = cur.rowcount
        total += deleted
        if deleted < PRUNE_BATCH:
            break
    return total
