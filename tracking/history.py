"""A delivery is its attempt, an arrival its message, a routing its recipient:
the tracking events read from the store's rows.

A message's history holds one row of each fact, not two (issue #24): the
round writes its ``queues.models.Attempt`` (with the event's id,
``Attempt.event_id``, and the next hop's queue id), the ingress its
``queues.models.Message`` (``Message.event_id``: its ``received`` event's)
and the categorizer the routing on each ``queues.models.Recipient``
(``routed_at``, ``routed_queue``, ``routed_link``; the event's id is made of
the recipient's id and that time: ``tracking.record.routing_event_id``), and
no ``delivered``, ``received`` or ``routed`` row goes into ``tracking_event``
(``tracking.record.Row.stored``). While the message is in the store the
tracking search reads them from those rows (``tracking.search``, beside the
rows of ``tracking_event``); when the sweep deletes the message
(``queues.signals.messages_purging``), ``archive`` moves them into
``tracking_event`` in the same transaction, with the same event ids, so the
history outlives the message as before (``MAILRELAY_TRACKING_RETENTION``). A
recipient routed again (its message categorized again) has its previous
routing moved there first (``queues.signals.recipients_rerouting``).

Rows written before this (``event_id`` NULL: attempts before migration
queues/0015, messages before 0016; ``routed_at`` NULL: routings before 0017)
had their tracking rows written beside them: they are not read here, nor
archived.

The search shows each event with an ``id`` and pages on (at, id): a live
delivery's is its attempt's negated, a live arrival's its message's minus
``ARRIVAL_OFFSET``, a live routing's its recipient's minus ``ROUTING_OFFSET``;
apart from each other and from every ``tracking_event`` id (positive), while
the store's ids stay below 2**52.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from datetime import datetime
from typing import Any

from django.db import DatabaseError, transaction
from django.db.models import QuerySet

from queues.lib import clock
from queues.models import Attempt, AttemptOutcome, Message, Recipient, RecipientState
from tracking import events
from tracking.config import tracking_settings
from tracking.models import TrackingEvent
from tracking.record import (
    Row,
    attempt_detail,
    insert,
    new,
    reply_text,
    routing_event_id,
    tls_text,
)

log = logging.getLogger(__name__)

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
# What a recipient's ``routed`` event is made of (its row, its message's, its
# queue's and link's names).
ROUTING_VALUES = (
    "id",
    "routed_at",
    "address",
    "message_id",
    "message__qid",
    "message__message_id",
    "message__mail_from",
    "routed_queue__name",
    "routed_link__name",
)
ROUTING_OFFSET = 2**54


def deliveries() -> QuerySet[Attempt]:
    """The attempts that are delivery events (every delivered attempt since
    migration queues/0015)."""
    return Attempt.objects.filter(outcome=AttemptOutcome.DELIVERED, event_id__isnull=False)


def arrivals() -> QuerySet[Message]:
    """The messages that are their own ``received`` event (every message
    stored since migration queues/0016)."""
    return Message.objects.filter(event_id__isnull=False)


def routings() -> QuerySet[Recipient]:
    """The recipients whose last routing is their ``routed`` event (every
    recipient routed since migration queues/0017)."""
    return Recipient.objects.filter(routed_at__isnull=False)


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


def _routing_fields(v: dict[str, Any]) -> dict[str, Any]:
    """The tracking columns of one recipient's routing (as
    ``tracking.record.placed`` sends its webhook)."""
    return {
        "event": events.ROUTED,
        "at": v["routed_at"],
        "event_id": routing_event_id(v["id"], v["routed_at"]),
        "qid": v["message__qid"],
        "message_pk": v["message_id"],
        "message_id": v["message__message_id"],
        "sender": v["message__mail_from"],
        "recipient": v["address"],
        "queue": v["routed_queue__name"] or "",
        "next_hop": v["routed_link__name"] or "",
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


def as_routing(v: dict[str, Any]) -> TrackingEvent:
    """One recipient's routing as the search shows a row: its id the
    recipient's minus ``ROUTING_OFFSET``."""
    return _event(new(**_routing_fields(v)), v["id"] - ROUTING_OFFSET)


_COLUMNS = tuple(f.attname for f in TrackingEvent._meta.concrete_fields if not f.primary_key)


def archive(message_ids: Iterable[int], now: datetime | None = None) -> int:
    """The arrivals, routings and deliveries of messages about to be deleted,
    into ``tracking_event`` with their event ids (in the caller's transaction;
    the purge's). Those older than the tracking retention are not kept (their
    day is gone already)."""
    ids = list(message_ids)
    if not ids:
        return 0
    since = (now or clock.now()) - tracking_settings().retention
    rows = (
        [
            new(**_arrival_fields(v))
            for v in arrivals()
            .filter(id__in=ids, received_at__gte=since)
            .order_by("id")
            .values(*ARRIVAL_VALUES)
        ]
        + _routing_rows(routings().filter(message_id__in=ids, routed_at__gte=since))
        + [
            new(**_fields(v))
            for v in deliveries()
            .filter(message_id__in=ids, started_at__gte=since)
            .order_by("id")
            .values(*VALUES)
        ]
    )
    if rows:
        insert(rows)
    return len(rows)


def _routing_rows(recipients: QuerySet[Recipient]) -> list[Row]:
    return [new(**_routing_fields(v)) for v in recipients.order_by("id").values(*ROUTING_VALUES)]


def archive_routings(recipient_ids: Iterable[int], now: datetime | None = None) -> int:
    """The routings of recipients about to be routed again, into
    ``tracking_event`` (in the categorizer's transaction, in a savepoint of
    their own: rows the table cannot take are logged and lost, the mail goes
    on); not those older than the tracking retention. Only rows still waiting
    for the categorizer, locked until it placed them: one an operator or an
    expiry finishes meanwhile keeps its routing (the placement leaves it)."""
    since = (now or clock.now()) - tracking_settings().retention
    again = routings().filter(
        id__in=list(recipient_ids), routed_at__gte=since, state=RecipientState.SUBMITTED
    )
    rows = _routing_rows(again.select_for_update(of=("self",)))
    if not rows:
        return 0
    try:
        with transaction.atomic():
            insert(rows)
    except DatabaseError:
        log.exception("could not move %d previous routings into tracking_event", len(rows))
        return 0
    return len(rows)


def on_purging(sender: object, message_ids: Iterable[int], **kwargs: object) -> None:
    """queues.signals.messages_purging: the arrivals, routings and deliveries archived."""
    archive(message_ids)


def on_rerouting(sender: object, recipient_ids: Iterable[int], **kwargs: object) -> None:
    """queues.signals.recipients_rerouting: the routings about to be replaced archived."""
    archive_routings(recipient_ids)
