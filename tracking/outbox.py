"""The webhook outbox: one row per event and endpoint that wants it, written in
the transaction of the event; the broker only rings for the sender.

The enabled endpoints and the event types they want are read at most every
``CONFIG_TTL`` seconds per process: with no endpoint, an event costs no query.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Sequence
from typing import Any

from celery import current_app
from django.db import connection, transaction

from queues import clock
from queues.bulk import jsonb_payload, jsonb_rows
from tracking.events import webhook_type
from tracking.models import WebhookDelivery, WebhookEndpoint

SEND_WEBHOOKS = "tracking.tasks.send_webhooks"  # routed to the queue ``webhooks``

log = logging.getLogger(__name__)

CONFIG_TTL = 10.0  # seconds: an endpoint change reaches every process within this

_lock = threading.Lock()
_config: tuple[float, list[tuple[int, frozenset[str]]]] = (0.0, [])


def endpoints() -> list[tuple[int, frozenset[str]]]:
    """(id, wanted event types) of the enabled endpoints, cached for CONFIG_TTL."""
    global _config
    expires, value = _config
    if time.monotonic() < expires:
        return value
    value = [
        (pk, frozenset(wanted))
        for pk, wanted in WebhookEndpoint.objects.filter(enabled=True).values_list("id", "events")
    ]
    with _lock:
        _config = (time.monotonic() + CONFIG_TTL, value)
    return value


def invalidate() -> None:
    """Read the endpoints again at the next event (an endpoint changed in this process)."""
    global _config
    with _lock:
        _config = (0.0, [])


def payload(row: Any, event_type: str) -> dict[str, Any]:
    """The JSON body of a webhook (docs/webhooks.md)."""
    return {
        "id": str(row.event_id),
        "type": event_type,
        "created": row.at.isoformat().replace("+00:00", "Z"),
        "qid": row.qid,
        "message_id": row.message_id,
        "sender": row.sender,
        "recipient": row.recipient,
        "reply": row.reply,
        "code": row.code,
        "enhanced": row.enhanced,
        "remote_id": row.remote_id,
        "host": row.host,
        "ip": row.ip,
        "queue": row.queue,
        "next_hop": row.next_hop,
        "actor": row.actor,
        "detail": row.detail,
    }


def body(row: Any, event_type: str) -> str:
    return json.dumps(payload(row, event_type), separators=(",", ":"), ensure_ascii=False)


TABLE = WebhookDelivery._meta.db_table
ENDPOINTS = WebhookEndpoint._meta.db_table
# As tracking.record: the batch as one JSON parameter on PostgreSQL. Only for
# endpoints that still exist, each locked against deletion (FOR KEY SHARE) until
# this transaction ends: an endpoint deleted while mail flows (this process may
# still have it cached) never fails the commit of a delivery round — the
# foreign key is checked at COMMIT, so a row for a deleted endpoint would
# undo the whole round. ``endpoints.delete`` takes the row lock first.
PG_INSERT = (
    f"INSERT INTO {TABLE} (endpoint_id, event_id, event, body, state, created_at, "
    "next_attempt_at, attempts, lease_owner, last_error) "
    "SELECT x.endpoint_id, x.event_id, x.event, x.body, 'pending', %s, %s, 0, '', '' "
    "FROM "
    + jsonb_rows(
        "x", [("endpoint_id", "bigint"), ("event_id", "uuid"), ("event", "text"), ("body", "text")]
    )
    + f" JOIN {ENDPOINTS} e ON e.id = x.endpoint_id FOR KEY SHARE OF e"
)
# SQLite serialises writers: a row only for an endpoint that exists now.
SQLITE_INSERT = (
    f"INSERT INTO {TABLE} (endpoint_id, event_id, event, body, state, created_at, "
    "next_attempt_at, attempts, lease_owner, last_error) "
    "SELECT %s, %s, %s, %s, 'pending', %s, %s, 0, '', '' "
    f"WHERE EXISTS (SELECT 1 FROM {ENDPOINTS} WHERE id = %s)"
)


def enqueue(rows: Sequence[Any]) -> int:
    """Outbox rows for the events an enabled endpoint wants (caller's transaction,
    one INSERT); after commit, ring the sender. Returns how many were queued."""
    wanted = endpoints()
    if not wanted:
        return 0
    out: list[tuple[int, Any, str, str]] = []
    for row in rows:
        event_type = webhook_type(row.event, row.detail)
        text = None
        for endpoint_id, types in wanted:
            if event_type in types:
                text = text or body(row, event_type)
                out.append((endpoint_id, row.event_id, event_type, text))
    if not out:
        return 0
    now = clock.now()
    with connection.cursor() as cur:
        if connection.vendor == "postgresql":
            batch = [
                {"endpoint_id": e, "event_id": str(i), "event": t, "body": b} for e, i, t, b in out
            ]
            cur.execute(PG_INSERT, [now, now, jsonb_payload(batch)])
        else:
            when = connection.ops.adapt_datetimefield_value(now)
            cur.executemany(SQLITE_INSERT, [(e, i.hex, t, b, when, when, e) for e, i, t, b in out])
    transaction.on_commit(ring)
    return len(out)


def ring() -> None:
    """Tell a webhook worker there is work (a lost ring costs latency: beat rings too).
    By task name: the outbox imports nothing of the tasks that import it."""
    try:
        current_app.send_task(SEND_WEBHOOKS)
    except Exception:  # noqa: BLE001 - beat's webhook_sweep finds the work
        log.warning("could not ring the webhook sender; beat will", exc_info=True)
