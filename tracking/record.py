"""Write tracking rows: one INSERT per batch, the webhook outbox rows in the same
transaction, the event-log lines after its commit.

Rows are plain slotted objects inserted with one hand-written statement:
Django model instances and ``bulk_create`` preparing each of their 23
fields cost several times as much CPU per row, on the path of every message
(categorize, deliver).
"""

from __future__ import annotations

import json
import logging
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from django.db import DatabaseError, connection, transaction

from queues.bulk import insert_json
from queues.text import scrub_nul
from tracking import eventlog, outbox

log = logging.getLogger(__name__)

# Column lengths of tracking_event (tracking.partitions); longer text is cut.
LIMITS = {
    "qid": 20,
    "message_id": 998,
    "sender": 512,
    "recipient": 512,
    "client": 64,
    "account": 150,
    "queue": 255,
    "next_hop": 1024,
    "host": 300,
    "ip": 64,
    "tls": 160,
    "enhanced": 16,
    "remote_id": 100,
    "actor": 150,
}


@dataclass(slots=True)
class Row:
    """One tracking event to write (the fields of tracking.models.TrackingEvent)."""

    event: str
    at: datetime
    event_id: uuid.UUID = field(default_factory=uuid.uuid4)
    qid: str = ""
    message_pk: int | None = None
    message_id: str = ""
    sender: str = ""
    recipient: str = ""
    client: str = ""
    account: str = ""
    size: int | None = None
    queue: str = ""
    next_hop: str = ""
    host: str = ""
    ip: str = ""
    tls: str = ""
    code: int | None = None
    enhanced: str = ""
    reply: str = ""
    remote_id: str = ""
    actor: str = ""
    detail: dict[str, Any] = field(default_factory=dict)


COLUMNS = tuple(Row.__dataclass_fields__)
# PostgreSQL: one INSERT … SELECT FROM jsonb_to_recordset() of the whole batch
# as one JSON parameter: a VALUES list (23 placeholders a row) or one array
# per column cost psycopg several times more CPU to send than the JSON encoder.
PG_TYPES = {
    "event": "varchar",
    "at": "timestamptz",
    "event_id": "uuid",
    "message_pk": "bigint",
    "size": "bigint",
    "code": "smallint",
    "detail": "jsonb",
}
PG_COLUMNS = [(c, PG_TYPES.get(c, "text")) for c in COLUMNS]  # queues.bulk.insert_json
SQLITE_INSERT = (
    f"INSERT INTO tracking_event ({', '.join(COLUMNS)}) VALUES ({', '.join(['%s'] * len(COLUMNS))})"
)


def new(event: str, at: datetime, **fields: Any) -> Row:
    """A tracking row with its stable event id; text cut to its column, NUL replaced."""
    for name, value in fields.items():
        if type(value) is str and value:
            value = scrub_nul(value)  # PostgreSQL text holds no NUL; a peer's reply may
            limit = LIMITS.get(name)
            fields[name] = value[:limit] if limit else value
    return Row(event, at, **fields)


def _detail(row: Row) -> str:
    return json.dumps(row.detail, separators=(",", ":"), default=str)


def _as_dict(row: Row) -> dict[str, Any]:
    return {name: getattr(row, name) for name in COLUMNS}


def insert(rows: Sequence[Row]) -> None:
    """One INSERT for the batch, in the caller's transaction."""
    if connection.vendor == "postgresql":
        insert_json("tracking_event", PG_COLUMNS, [_as_dict(r) for r in rows])
        return
    with connection.cursor() as cur:
        adapt_time = connection.ops.adapt_datetimefield_value
        params = []
        for r in rows:
            values = [getattr(r, name) for name in COLUMNS]
            values[1], values[2], values[-1] = adapt_time(r.at), r.event_id.hex, _detail(r)
            params.append(values)
        cur.executemany(SQLITE_INSERT, params)


def write(rows: Sequence[Row], *, own_savepoint: bool = True) -> None:
    """Store ``rows`` in the caller's transaction (one INSERT), queue the webhooks
    they trigger (one more INSERT, only when an enabled endpoint wants one of
    them) and hand their event-log lines over after commit.

    ``own_savepoint`` False: no savepoint of their own (two statements fewer);
    for a caller whose transaction may roll back with them because it then
    records the same again another way (a delivery's early record: its
    round's final record writes it)."""
    if not rows:
        return
    if not own_savepoint:
        insert(rows)
        outbox.enqueue(rows)
        eventlog.after_commit(rows)
        return
    # In a savepoint of its own: a tracking row that cannot be written (a lock
    # timeout behind partition maintenance, a value the table refuses) must not
    # roll back the delivery or routing it describes — that would send a
    # message again. The row and its webhooks stay atomic with each other.
    try:
        with transaction.atomic():
            insert(rows)
            outbox.enqueue(rows)
    except DatabaseError as exc:
        if len(rows) == 1 or _transient(exc):
            log.exception(
                "could not write %d tracking rows; the mail goes on without them", len(rows)
            )
            return
        # A row the table refuses loses only itself: the others one by one.
        log.warning("could not write a batch of %d tracking rows (%s); row by row", len(rows), exc)
        rows = [row for row in rows if _write_one(row)]
    eventlog.after_commit(rows)


# Errors of the moment (a lock or statement timeout, a deadlock, a lost
# connection): the rows one by one would each wait for the same again.
_TRANSIENT_STATES = ("55P03", "57014", "40P01", "40001", "08")


def _transient(exc: DatabaseError) -> bool:
    state = getattr(exc.__cause__, "sqlstate", None) or ""
    return not state or state.startswith(_TRANSIENT_STATES)


def _write_one(row: Row) -> bool:
    try:
        with transaction.atomic():
            insert([row])
            outbox.enqueue([row])
    except DatabaseError:
        log.exception("could not write the tracking row %s %s", row.event, row.qid)
        return False
    return True
