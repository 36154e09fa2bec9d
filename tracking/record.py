"""What the store's facts become: tracking rows, one INSERT per batch, the webhook
outbox rows in the same transaction, the event-log lines and the Prometheus
counters after its commit.

The store's signals (``recipients_placed``, ``attempts_recorded``, ...;
``tracking.apps`` connects them) reach the hooks at the end of this module,
which build the rows and write them here.

Rows are plain slotted objects inserted with one hand-written statement:
Django model instances and ``bulk_create`` preparing each of their 23
fields cost several times as much CPU per row, on the path of every message
(categorize, deliver).
"""

from __future__ import annotations

import json
import logging
import threading
import time
import uuid
from collections.abc import Container, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

from celery import current_app
from django.db import DatabaseError, connection, transaction

from delivery.smtp.outcome import remote_queue_id
from queues import counters
from queues.database import insert_json, json_payload, json_rows
from queues.lib import clock, first_categorization, scrub_nul
from queues.models import AuditEntry, DeliveryType, Link, Message, Queue, RecipientState
from queues.signals import PLACED_FACTS
from tracking import eventlog, events
from tracking.events import webhook_type
from tracking.models import WebhookDelivery, WebhookEndpoint

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
    # Not a column: False for an event that is a row of the store already (a
    # delivery is its attempt, an arrival its message, a routing its recipient:
    # tracking.history reads it there while its message lives and moves it
    # here when the message is purged or the recipient routed again). Its
    # webhooks and event-log line go out as any other's.
    stored: bool = True


COLUMNS = tuple(name for name in Row.__dataclass_fields__ if name != "stored")
# PostgreSQL: one INSERT … SELECT FROM json_to_recordset() of the whole batch
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
PG_COLUMNS = [(c, PG_TYPES.get(c, "text")) for c in COLUMNS]  # queues.database.insert_json
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


def _store(rows: Sequence[Row]) -> None:
    """``insert`` of the rows that are not the store's already (``Row.stored``)."""
    stored = [r for r in rows if r.stored]
    if stored:
        insert(stored)


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
    if not own_savepoint or (
        not endpoints() and not any(r.stored for r in rows)
    ):  # nothing to write that could fail on its own: no savepoint
        _store(rows)
        enqueue(rows)
        _log_after_commit(rows)
        return
    # In a savepoint of its own: a tracking row that cannot be written (a lock
    # timeout behind partition maintenance, a value the table refuses) must not
    # roll back the delivery or routing it describes — that would send a
    # message again. The row and its webhooks stay atomic with each other.
    try:
        with transaction.atomic():
            _store(rows)
            enqueue(rows)
    except DatabaseError as exc:
        if len(rows) == 1 or _transient(exc):
            log.exception(
                "could not write %d tracking rows; the mail goes on without them", len(rows)
            )
            return
        # A row the table refuses loses only itself: the others one by one.
        log.warning("could not write a batch of %d tracking rows (%s); row by row", len(rows), exc)
        rows = [row for row in rows if _write_one(row)]
    _log_after_commit(rows)


def _log_after_commit(rows: Sequence[Row]) -> None:
    """Hand the rows' event-log lines to ``tracking.eventlog`` once their
    transaction commits: nothing when ``MAILRELAY_EVENT_LOG`` is off, nothing
    if it rolls back."""
    if not eventlog.target():
        return
    lines = eventlog.lines_of(rows)
    transaction.on_commit(lambda: eventlog.emit(lines))


# Errors of the moment (a lock or statement timeout, a deadlock, a lost
# connection): the rows one by one would each wait for the same again.
_TRANSIENT_STATES = ("55P03", "57014", "40P01", "40001", "08")


def _transient(exc: DatabaseError) -> bool:
    state = getattr(exc.__cause__, "sqlstate", None) or ""
    return not state or state.startswith(_TRANSIENT_STATES)


def _write_one(row: Row) -> bool:
    try:
        with transaction.atomic():
            _store([row])
            enqueue([row])
    except DatabaseError:
        log.exception("could not write the tracking row %s %s", row.event, row.qid)
        return False
    return True


# ----------------------------------------------------------------------------
# The webhook outbox: one row per event and endpoint that wants it, written in
# the transaction of the event; the broker only rings for the sender.
#
# The enabled endpoints and the event types they want are read at most every
# ``CONFIG_TTL`` seconds per process: with no endpoint, an event costs no query.
# ----------------------------------------------------------------------------


SEND_WEBHOOKS = "tracking.tasks.send_webhooks"  # routed to the queue ``webhooks``


CONFIG_TTL = 10.0  # seconds: an endpoint change reaches every process within this

_config_lock = threading.Lock()
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
    with _config_lock:
        _config = (time.monotonic() + CONFIG_TTL, value)
    return value


def heard() -> bool:
    """Whether an event goes anywhere but the store (an enabled webhook endpoint,
    the event log): else one that is a store's row (``Row.stored`` False) is
    not even built."""
    return bool(endpoints()) or bool(eventlog.target())


def invalidate() -> None:
    """Read the endpoints again at the next event (an endpoint changed in this process)."""
    global _config
    with _config_lock:
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
    + json_rows(
        "x", [("endpoint_id", "bigint"), ("event_id", "uuid"), ("event", "text"), ("body", "text")]
    )
    + f" JOIN {ENDPOINTS} e ON e.id = x.endpoint_id FOR KEY SHARE OF e"
)
# SQLite serialises writers: a row only for an endpoint that exists now.
OUTBOX_SQLITE_INSERT = (
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
            cur.execute(PG_INSERT, [now, now, json_payload(batch)])
        else:
            when = connection.ops.adapt_datetimefield_value(now)
            cur.executemany(
                OUTBOX_SQLITE_INSERT, [(e, i.hex, t, b, when, when, e) for e, i, t, b in out]
            )
    transaction.on_commit(ring)
    return len(out)


def ring() -> None:
    """Tell a webhook worker there is work (a lost ring costs latency: beat rings too).
    By task name: the outbox imports nothing of the tasks that import it."""
    try:
        current_app.send_task(SEND_WEBHOOKS)
    except Exception:  # noqa: BLE001 - beat's webhook_sweep finds the work
        log.warning("could not ring the webhook sender; beat will", exc_info=True)


# ----------------------------------------------------------------------------
# The Prometheus counters (queues.counters' instruments) that the same signals
# feed: the engine counts nothing itself, so a count and the tracking rows
# tell the same story. Counted when the store's transaction commits (a try
# that rolled back counts nothing).
# ----------------------------------------------------------------------------


def reply_class(code: int | None) -> str:
    """``250`` → "2xx"; None (no reply at all) → "none"."""
    if code is None or not 200 <= code < 600:
        return "none"
    return f"{code // 100}xx"


def _failure_reason(code: int | None, enhanced: str) -> str:
    # A recipient made final while its last answer was temporary ran out of retries.
    if (code is not None and 400 <= code < 500) or enhanced.startswith("4."):
        return "retry_timeout"
    return "permanent"


def _count(
    classes: Mapping[str, int], delivered: int, deferred: int, failed: Mapping[str, int]
) -> None:
    def count() -> None:
        for key, n in classes.items():
            counters.DELIVERY_ATTEMPTS.labels(reply_class=key).inc(n)
        if delivered:
            counters.RECIPIENTS_DELIVERED.inc(delivered)
        if deferred:
            counters.RECIPIENTS_DEFERRED.inc(deferred)
        for reason, n in failed.items():
            counters.RECIPIENTS_FAILED.labels(reason=reason).inc(n)

    transaction.on_commit(count)


def count_round(attempts: Iterable[Any], recipients: Iterable[Any]) -> None:
    """A round's attempts by reply class, and its recipients (the rows it could
    still write: ``state``, ``last_code``, ``last_enhanced``) by outcome."""
    classes: dict[str, int] = {}
    for a in attempts:
        key = reply_class(a.code)
        classes[key] = classes.get(key, 0) + 1
    delivered = deferred = 0
    failed: dict[str, int] = {}
    for r in recipients:
        if r.state == RecipientState.DELIVERED:
            delivered += 1
        elif r.state == RecipientState.DEFERRED:
            deferred += 1
        elif r.state == RecipientState.FAILED:
            reason = _failure_reason(r.last_code, r.last_enhanced or "")
            failed[reason] = failed.get(reason, 0) + 1
    _count(classes, delivered, deferred, failed)


def count_unroutable(placements: Mapping[str, Any]) -> None:
    """The categorizer's routing failures: one attempt without a reply per
    recipient, failed (to the dead letters) or deferred (Unreachable)."""
    attempts = deferred = 0
    failed: dict[str, int] = {}
    for placement in placements.values():
        n = len(placement.recipient_ids)
        if placement.route is not None or not n:
            continue
        attempts += n
        if placement.error.permanent:
            reason = _failure_reason(None, placement.error.enhanced)
            failed[reason] = failed.get(reason, 0) + n
        else:
            deferred += n
    if attempts:
        _count({"none": attempts}, 0, deferred, failed)


# ----------------------------------------------------------------------------
# The receivers that record a message's life, from the queue store's signals
# (connected in tracking.apps; the engine and the store import nothing of this app).
#
# Each takes what the sender already holds and writes a batch of tracking rows
# with at most one SELECT (the messages' envelope facts) and one INSERT, in the
# sender's transaction (tracking.record):
#
# - ``placed`` (signal ``recipients_placed``): the categorizer placed a batch
#   (``received`` once per message on its first categorization, ``routed`` /
#   ``failed`` / ``deferred`` per recipient);
# - ``attempted`` (``attempts_recorded``): a delivery round's results (one row
#   per attempt: ``delivered`` with the remote queue id, ``deferred`` or
#   ``failed``);
# - ``expired`` (``recipients_expired``): the sweep expired recipients;
# - ``on_dsn_sent``: a DSN was queued (signal of queues.bounce.notify);
# - ``on_audit``: an operator action (post_save of queues.models.AuditEntry).
# ----------------------------------------------------------------------------


_FACTS = ("id", "qid", "mail_from", "message_id")


def _facts(message_ids: Iterable[int]) -> dict[int, tuple[str, str, str]]:
    """qid, sender and Message-ID of each message (one SELECT)."""
    return {
        mid: (qid, sender, msgid)
        for mid, qid, sender, msgid in Message.objects.filter(id__any=set(message_ids)).values_list(
            *_FACTS
        )
    }


def _message_fields(facts: Mapping[int, tuple[str, str, str]], mid: int) -> dict[str, Any]:
    qid, sender, msgid = facts.get(mid, ("", "", ""))
    return {"message_pk": mid, "qid": qid, "sender": sender, "message_id": msgid}


def _received(fact: tuple, common: dict[str, Any], heard: bool) -> Row | None:
    """The ``received`` event of a message (the rest of its PLACED_FACTS) at its
    first categorization, when it is due at its arrival; else None (once).

    An arrival is its message (Message.event_id: tracking.history reads it
    there): None too when nothing ``heard`` it; a message stored before
    migration queues/0016 has none, and its row is written."""
    client, account, size, received_at, next_attempt_at, source, event_id = fact[6:]
    if not first_categorization(received_at, next_attempt_at):
        return None
    if event_id is not None and not heard:
        return None
    arrival = {"event_id": event_id, "stored": False} if event_id is not None else {}
    return new(
        events.RECEIVED,
        received_at,
        client=client or "",
        account=account,
        size=size,
        detail={"source": source},
        **common,
        **arrival,
    )


def routing_event_id(recipient_id: int, at: datetime) -> uuid.UUID:
    """The id of a recipient's ``routed`` event, made of what its row keeps of
    it (tracking.history): its id and the time, the same in its webhook, its
    event-log line, the search and the table it moves to. An RFC 9562 version 8
    UUID: the time in microseconds in its first 60 free bits, the id in its last
    62."""
    micros = (at - _EPOCH) // timedelta(microseconds=1) & (2**60 - 1)
    return uuid.UUID(
        int=(micros >> 12) << 80
        | 0x8 << 76
        | (micros & 0xFFF) << 64
        | 0b10 << 62
        | recipient_id & (2**62 - 1)
    )


_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)


def _routed(rid: int, address: str, placement: Any, now: datetime, common: dict) -> Row:
    """A recipient's ``routed`` event: its row in the store (Recipient.routed_at)."""
    return new(
        events.ROUTED,
        now,
        event_id=routing_event_id(rid, now),
        stored=False,
        recipient=address,
        queue=placement.route.queue_name,
        next_hop=placement.route.link_name,
        **common,
    )


def _unrouted(domain: str, address: str, placement: Any, now: datetime, common: dict) -> Row:
    """A recipient the categorizer could not route: ``failed`` or ``deferred``."""
    error = placement.error
    code = 550 if error.permanent else 451
    return new(
        events.FAILED if error.permanent else events.DEFERRED,
        now,
        recipient=address,
        host=domain,
        code=code,
        enhanced=error.enhanced,
        reply=f"{code} {error.enhanced} {error.text}",
        queue=(DeliveryType.DEAD_LETTER if error.permanent else DeliveryType.UNREACHABLE).label,
        detail={"phase": "route"},
        **common,
    )


def placed(
    placements: Mapping[str, Any],
    now: datetime,
    facts: Mapping[int, tuple] | None = None,
    placed_ids: Container[int] | None = None,
) -> None:
    """After the categorizer decided a batch (queues.signals.recipients_placed).

    ``placements`` maps a domain to its decision: ``recipient_ids`` and either
    ``route`` (queue_name, link_name) or ``error`` (permanent, enhanced, text).
    ``facts``: the PLACED_FACTS of the recipients by id, when the caller has
    them (else one SELECT). ``placed_ids``: the routed recipients it placed
    (None: all); a routing not placed is no event.
    """
    by_id: dict[int, tuple[str, Any]] = {}
    for domain, placement in placements.items():
        for rid in placement.recipient_ids:
            by_id[rid] = (domain, placement)
    if not by_id:
        return
    if facts is not None and all(rid in facts for rid in by_id):
        recipients = [facts[rid] for rid in by_id]
    else:
        from queues.models import Recipient

        recipients = list(Recipient.objects.filter(id__any=list(by_id)).values_list(*PLACED_FACTS))
    rows = []
    seen: set[int] = set()
    listened = heard()  # else the arrivals and routings, rows of the store, go nowhere
    for fact in recipients:
        rid, address, mid, qid, sender, msgid = fact[:6]
        common = {"message_pk": mid, "qid": qid, "sender": sender, "message_id": msgid}
        if mid not in seen:
            seen.add(mid)
            arrival = _received(fact, common, listened)
            if arrival is not None:
                rows.append(arrival)
        domain, placement = by_id[rid]
        if placement.route is None:
            rows.append(_unrouted(domain, address, placement, now, common))
        elif listened and (placed_ids is None or rid in placed_ids):
            rows.append(_routed(rid, address, placement, now, common))
    write(rows)


def tls_text(version: str, cipher: str, verified: str) -> str:
    """The ``tls`` column of an attempt's event: ``TLSv1.3 TLS_AES_… ca``."""
    if not version:
        return ""
    verified = verified if verified not in ("", "none") else "unverified"
    return f"{version} {cipher} {verified}".strip()[:160]


def reply_text(code: int | None, enhanced: str, text: str) -> str:
    """The ``reply`` column of an attempt's event: ``250 2.0.0 Ok: queued as …``."""
    return " ".join(str(p) for p in (code or "", enhanced, text) if p)


def attempt_detail(phase: str, duration_ms: int, auth_used: str) -> dict[str, Any]:
    """The ``detail`` column of an attempt's event."""
    return {"phase": phase, "duration_ms": duration_ms} | ({"auth": auth_used} if auth_used else {})


def attempted(
    attempts: list[Any],
    rows: Mapping[int, Any],
    link: Link,
    now: datetime,
    facts: Mapping[int, tuple[str, str, str]] | None = None,
    owned: Container[int] | None = None,
    own_savepoint: bool = True,
) -> None:
    """After a delivery round wrote its attempts (queues.signals.attempts_recorded):
    ``attempts`` are its queues.models.Attempt objects, ``rows`` the round's
    recipients by id with their new state, ``owned`` the ids of those it could
    still write (None: all); ``facts``: qid, sender and
    Message-ID by message id when the caller has them (else one SELECT);
    ``own_savepoint`` False: a failed write may roll the caller's transaction
    back (it records another way then; tracking.record.write)."""
    if not heard():  # a delivery is its attempt: only the others are rows to write
        attempts = [a for a in attempts if a.outcome != "delivered"]
    if not attempts:
        return
    if facts is None or any(a.message_id not in facts for a in attempts):
        facts = _facts(a.message_id for a in attempts)
    out = []
    for a in attempts:
        row = rows.get(a.recipient_id)
        state = getattr(row, "state", None)
        if owned is not None and a.recipient_id not in owned:
            state = None
        if a.outcome == "delivered":
            event = events.DELIVERED
        elif state == RecipientState.FAILED:
            event = events.FAILED
        else:
            # Deferred; or the round lost its claim before recording (``row`` is
            # None): the recipient waits for its new owner, not failed.
            event = events.DEFERRED
        reply = reply_text(a.code, a.enhanced, a.text)
        out.append(
            new(
                event,
                a.started_at or now,
                recipient=getattr(row, "address", ""),
                next_hop=link.name,
                host=a.host,
                ip=a.ip,
                tls=tls_text(a.tls_version, a.tls_cipher, a.tls_verified),
                code=a.code,
                enhanced=a.enhanced,
                reply=reply,
                remote_id=remote_queue_id(a.text) if event == events.DELIVERED else "",
                # A delivery is its attempt, and has its id (Attempt.event_id).
                **({"event_id": a.event_id, "stored": False} if event == events.DELIVERED else {}),
                detail=attempt_detail(a.phase, a.duration_ms, a.auth_used)
                | (
                    {"retry_timeout": True}
                    if event == events.FAILED and a.outcome != "failed"
                    else {}
                ),
                **_message_fields(facts, a.message_id),
            )
        )
    write(out, own_savepoint=own_savepoint)


def expired(recipients: list[Any], now: datetime, reason: str) -> None:
    """After the sweep expired ``recipients`` (queues.signals.recipients_expired)."""
    facts = _facts(r.message_id for r in recipients)
    write(
        [
            new(
                events.EXPIRED,
                now,
                recipient=r.address,
                queue=DeliveryType.DEAD_LETTER.label,  # the queue's name (special_queue)
                reply=reason,
                **_message_fields(facts, r.message_id),
            )
            for r in recipients
        ]
    )


def on_placed(sender: object, **kwargs: Any) -> None:
    """queues.signals.recipients_placed: ``placed``, and the routing failures counted."""
    placed(kwargs["placements"], kwargs["now"], kwargs.get("facts"), kwargs.get("placed"))
    count_unroutable(kwargs["placements"])


def on_attempts_recorded(sender: object, **kwargs: Any) -> None:
    """queues.signals.attempts_recorded: ``attempted``, and the round counted."""
    rows, owned = kwargs["rows"], kwargs.get("owned")
    attempted(
        kwargs["attempts"],
        rows,
        kwargs["link"],
        kwargs["now"],
        kwargs.get("facts"),
        owned=owned,
        own_savepoint=kwargs.get("own_savepoint", True),
    )
    count_round(
        kwargs["attempts"],
        [row for rid, row in rows.items() if owned is None or rid in owned],
    )


def on_expired(sender: object, **kwargs: Any) -> None:
    """queues.signals.recipients_expired: ``expired``, and the recipients counted."""
    recipients = kwargs["recipients"]
    expired(recipients, kwargs["now"], kwargs["reason"])
    if recipients:
        transaction.on_commit(
            lambda: counters.RECIPIENTS_FAILED.labels(reason="expired").inc(len(recipients))
        )


def on_dsn_sent(
    sender: object,
    kind: str,
    message: Message,
    recipients: list[Any],
    report: Message | None,
    now: datetime,
    **kwargs: object,
) -> None:
    """A DSN about ``recipients`` of ``message`` was queued (queues.bounce.notify)."""
    fields = {
        "message_pk": message.pk,
        "qid": message.qid,
        "sender": message.mail_from,
        "message_id": message.message_id,
    }
    detail = {"kind": kind, "dsn_qid": report.qid if report is not None else ""}
    transaction.on_commit(lambda: counters.DSNS_SENT.labels(kind=kind).inc())
    write(
        [
            new(events.DSN_SENT, now, recipient=r.address, detail=detail, **fields)
            for r in recipients
        ]
    )


OPERATOR_TARGETS = ("message", "queue", "link")
CHUNK = 2000


def on_audit(sender: object, instance: AuditEntry, created: bool, **kwargs: object) -> None:
    """An operator action: one row per message (or queue, link) it changed or
    names, else one row."""
    if not created or instance.target_type not in OPERATOR_TARGETS:
        return
    entry = instance
    detail: dict[str, Any] = {"action": entry.action, "via": entry.via, "count": entry.count}
    if entry.detail:
        detail["text"] = entry.detail
    if entry.filter:
        detail["filter"] = entry.filter
    common = {"actor": entry.actor_name, "detail": detail}
    # The rows it changed when the action said (a bulk action by filter, or ids
    # of which some were skipped), else the ids it was given.
    ids = list(getattr(entry, "changed_ids", None) or entry.target_ids or [])
    if not ids:
        write([new(events.OPERATOR, entry.created_at, **common)])
        return
    for start in range(0, len(ids), CHUNK):
        chunk = ids[start : start + CHUNK]
        if entry.target_type == "message":
            facts = _facts(chunk)
            rows = [
                new(events.OPERATOR, entry.created_at, **_message_fields(facts, mid), **common)
                for mid in chunk
            ]
        else:
            model = Queue if entry.target_type == "queue" else Link
            names = dict(model.objects.filter(id__in=chunk).values_list("id", "name"))
            field = "queue" if entry.target_type == "queue" else "next_hop"
            rows = [
                new(events.OPERATOR, entry.created_at, **{field: names.get(i, str(i))}, **common)
                for i in chunk
            ]
        write(rows)
