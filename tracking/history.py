"""A delivery is its attempt, an arrival its message: the tracking events read
from the store's rows.

A message's history holds one row of each fact, not two (issue #24): the
round writes its ``queues.models.Attempt`` (with the event's id,
``Attempt.event_id``, and the next hop's queue id) and the ingress its
``queues.models.Message`` (``Message.event_id``: its ``received`` event's),
and no ``delivered`` or ``received`` row goes into ``tracking_event``
(``tracking.record.Row.stored``). While the message is in the store the
tracking search reads them from those rows (``tracking.search``, beside the
rows of ``tracking_event``); when the sweep deletes the message
(``queues.signals.messages_purging``), ``archive`` moves them into
``tracking_event`` in the same transaction, with the same event ids, so the
history outlives the message as before (``MAILRELAY_TRACKING_RETENTION``).

Rows written before this (``event_id`` NULL: attempts before migration
queues/0015, messages before 0016) had their tracking rows written beside
them: they are not read here, nor archived.

The search shows each event with an ``id`` and pages on (at, id): a live
delivery's is its attempt's negated, a live arrival's its message's minus
``ARRIVAL_OFFSET``; apart from each other and from every ``tracking_event``
id (positive), while the store's ids stay below 2**52.
"""

from __future__ import annotations

from collections.abc import Iterable
from datetime import datetime
from typing import Any

from django.db.models import QuerySet

from queues.lib import clock
from queues.models import Attempt, AttemptOutcome, Message
from tracking import events
from tracking.config import tracking_settings
from tracking.models import TrackingEvent
from tracking.record import Row, attempt_detail, insert, new, reply_text, tls_text

# What an attempt's event is made of: its own columns and its message's,
# recipient's and link's (one SELECT with three joins).
VALUES = (
    "id",
    "event_id",
    "message_id",
    "started_at",
    "duration_ms",
    "host",
    "ip",
    "phase",
    "code",
    "enhanced",
    "text",
    "tls_version",
    "tls_cipher",
    "tls_verified",
    "auth_used",
    "remote_id",
    "message__qid",
    "message__message_id",
    "message__mail_from",
    "recipient__address",
    "link__name",
)
# What a message's ``received`` event is made of (its own row).
ARRIVAL_VALUES = (
    "id",
    "event_id",
    "qid",
    "message_id",
    "mail_from",
    "received_at",
    "client_address",
    "auth_account",
    "size",
    "source",
)
ARRIVAL_OFFSET = 2**53


def deliveries() -> QuerySet[Attempt]:
    """The attempts that are delivery events (every delivered attempt since
    migration queues/0015)."""
    return Attempt.objects.filter(outcome=AttemptOutcome.DELIVERED, event_id__isnull=False)


def arrivals() -> QuerySet[Message]:
    """The messages that are their own ``received`` event (every message
    stored since migration queues/0016)."""
    return Message.objects.filter(event_id__isnull=False)


def _fields(v: dict[str, Any]) -> dict[str, Any]:
    """The tracking columns (``tracking.record.Row``) of one attempt's values."""
    return {
        "event": events.DELIVERED,
        "at": v["started_at"],
        "event_id": v["event_id"],
        "qid": v["message__qid"],
        "message_pk": v["message_id"],
        "message_id": v["message__message_id"],
        "sender": v["message__mail_from"],
        "recipient": v["recipient__address"] or "",
        "next_hop": v["link__name"] or "",
        "host": v["host"],
        "ip": v["ip"],
        "tls": tls_text(v["tls_version"], v["tls_cipher"], v["tls_verified"]),
        "code": v["code"],
        "enhanced": v["enhanced"],
        "reply": reply_text(v["code"], v["enhanced"], v["text"]),
        "remote_id": v["remote_id"],
        "detail": attempt_detail(v["phase"], v["duration_ms"], v["auth_used"]),
    }


def _arrival_fields(v: dict[str, Any]) -> dict[str, Any]:
    """The tracking columns of one message's arrival (as ``tracking.record.placed``
    sends its webhook)."""
    return {
        "event": events.RECEIVED,
        "at": v["received_at"],
        "event_id": v["event_id"],
        "qid": v["qid"],
        "message_pk": v["id"],
        "message_id": v["message_id"],
        "sender": v["mail_from"],
        "client": v["client_address"] or "",
        "account": v["auth_account"],
        "size": v["size"],
        "detail": {"source": v["source"]},
    }


def _event(row: Row, ident: int) -> TrackingEvent:
    return TrackingEvent(id=ident, **{name: getattr(row, name) for name in _COLUMNS})


def as_event(v: dict[str, Any]) -> TrackingEvent:
    """One attempt as the search shows a row: its id the attempt's, negated."""
    return _event(new(**_fields(v)), -v["id"])


def as_arrival(v: dict[str, Any]) -> TrackingEvent:
    """One message's arrival as the search shows a row: its id the message's
    minus ``ARRIVAL_OFFSET``."""
    return _event(new(**_arrival_fields(v)), v["id"] - ARRIVAL_OFFSET)


_COLUMNS = tuple(f.attname for f in TrackingEvent._meta.concrete_fields if not f.primary_key)


def archive(message_ids: Iterable[int], now: datetime | None = None) -> int:
    """The arrivals and deliveries of messages about to be deleted, into
    ``tracking_event`` with their event ids (in the caller's transaction; the
    purge's). Those older than the tracking retention are not kept (their day
    is gone already)."""
    ids = list(message_ids)
    if not ids:
        return 0
    since = (now or clock.now()) - tracking_settings().retention
    rows = [
        new(**_arrival_fields(v))
        for v in arrivals()
        .filter(id__in=ids, received_at__gte=since)
        .order_by("id")
        .values(*ARRIVAL_VALUES)
    ] + [
        new(**_fields(v))
        for v in deliveries()
        .filter(message_id__in=ids, started_at__gte=since)
        .order_by("id")
        .values(*VALUES)
    ]
    if rows:
        insert(rows)
    return len(rows)


def on_purging(sender: object, message_ids: Iterable[int], **kwargs: object) -> None:
    """queues.signals.messages_purging: the arrivals and deliveries archived."""
    archive(message_ids)
