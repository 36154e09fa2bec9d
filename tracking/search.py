"""Search of the tracking rows, shared by the UI, the API and ``manage.py track``.

Each criterion is answered by an index of ``tracking_event`` (tracking.partitions),
and, for the arrivals, routings and deliveries of messages still in the
store, by an index of the store's tables (``tracking.history``: an arrival is
its message, a routing its recipient, a delivery its attempt):
sender and recipient (exact, any case), Message-ID (with or without its
angle brackets), our queue id, the remote queue id, event kinds, and a time
window; newest first, paged by a cursor on (at, id).
"""

from __future__ import annotations

import base64
import hashlib
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from datetime import datetime

from django.db.models import Q, QuerySet
from django.db.models.functions import MD5, Lower
from django.utils.dateparse import parse_datetime

from queues import filters  # noqa: F401 - registers the ticontains lookup
from queues.lib import clock, parse_duration
from queues.models import Attempt, Message, Recipient
from tracking import history
from tracking.config import tracking_settings
from tracking.events import DELIVERED, RECEIVED, ROUTED, TRACKING_EVENTS
from tracking.models import TrackingEvent

DEFAULT_LIMIT = 50
MAX_LIMIT = 500


class SearchError(ValueError):
    """A criterion that cannot be understood (HTTP 400, a command error)."""


@dataclass
class TrackingQuery:
    sender: str = ""
    recipient: str = ""
    message_id: str = ""
    qid: str = ""
    remote_id: str = ""
    event: list[str] = field(default_factory=list)
    since: datetime | None = None
    until: datetime | None = None

    @property
    def criteria(self) -> dict[str, str]:
        """The criteria given, as text (for links and the page)."""
        out = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if value:
                out[f.name] = (
                    ",".join(value)
                    if isinstance(value, list)
                    else value.isoformat()
                    if isinstance(value, datetime)
                    else value
                )
        return out


PARAMETERS = ("sender", "recipient", "message_id", "qid", "remote_id", "event", "since", "until")


def parse_time(name: str, text: str, now: datetime) -> datetime:
    """``2d`` (that long ago) or an ISO 8601 time (UTC when it names no zone)."""
    text = text.strip()
    try:
        ago = parse_duration(text)
    except (ValueError, TypeError):
        pass
    except OverflowError:  # a duration past timedelta's days
        raise SearchError(f"{name}: {text[:40]!r} is too long ago") from None
    else:
        try:
            return now - ago
        except OverflowError:  # before year 1
            raise SearchError(f"{name}: {text[:40]!r} is too long ago") from None
    try:
        value = parse_datetime(text)
    except ValueError:
        value = None
    if value is None:
        raise SearchError(f"{name}: {text!r} is neither a duration (2d, 90m) nor an ISO time")
    if value.tzinfo is None:
        value = value.replace(tzinfo=clock.now().tzinfo)
    return value


def parse_query(params: Mapping[str, str]) -> TrackingQuery:
    now = clock.now()
    query = TrackingQuery()
    for name in PARAMETERS:  # PostgreSQL text holds no NUL: a clear 400, not a 500
        if "\x00" in (params.get(name) or ""):
            raise SearchError(f"{name}: no NUL character")
    for name in ("sender", "recipient", "message_id", "qid", "remote_id"):
        setattr(query, name, (params.get(name) or "").strip())
    kinds = [k.strip() for k in (params.get("event") or "").split(",") if k.strip()]
    unknown = [k for k in kinds if k not in TRACKING_EVENTS]
    if unknown:
        raise SearchError(
            f"event: unknown {', '.join(unknown)} (one of {', '.join(TRACKING_EVENTS)})"
        )
    query.event = kinds
    for name in ("since", "until"):
        if params.get(name):
            setattr(query, name, parse_time(name, params[name], now))
    return query


def queryset(query: TrackingQuery) -> QuerySet[TrackingEvent]:
    qs = TrackingEvent.objects.all()
    if query.sender:
        # ``<> ''``: the predicate of the partial index (tracking.partitions.PARTIAL)
        qs = qs.alias(sender_lower=Lower("sender")).filter(
            ~Q(sender=""), sender_lower=query.sender.lower()
        )
    if query.recipient:
        # A message's ``received`` row is message-wide (no recipient): it is
        # found through the queue ids of the recipient's own rows (both sides
        # by an index: tracking_event_rcpt_nz, tracking_event_qid).
        own = (
            TrackingEvent.objects.alias(rcpt_lower=Lower("recipient"))
            .filter(~Q(recipient=""), ~Q(qid=""), rcpt_lower=query.recipient.lower())
            .values("qid")
        )
        qs = qs.alias(rcpt_lower=Lower("recipient")).filter(
            (~Q(recipient="") & Q(rcpt_lower=query.recipient.lower()))
            | Q(event=RECEIVED, qid__in=own)
        )
    if query.message_id:
        wanted = _message_ids(query.message_id)
        # The index is on md5(message_id) where it is not '' (tracking.partitions):
        # the hash finds the rows, the text makes the match exact.
        qs = qs.alias(msgid_md5=MD5("message_id")).filter(
            ~Q(message_id=""),
            msgid_md5__in=[hashlib.md5(w.encode()).hexdigest() for w in wanted],
            message_id__in=wanted,
        )
    if query.qid:
        qs = qs.filter(qid=query.qid)
    if query.remote_id:
        qs = qs.filter(remote_id=query.remote_id)
    if query.event:
        qs = qs.filter(event__in=query.event)
    if query.since:
        qs = qs.filter(at__gte=query.since)
    if query.until:
        qs = qs.filter(at__lt=query.until)
    return qs


def encode_cursor(row: TrackingEvent) -> str:
    text = f"{row.at.timestamp():.6f}:{row.id}"
    return base64.urlsafe_b64encode(text.encode()).decode().rstrip("=")


def decode_cursor(cursor: str) -> tuple[datetime, int]:
    try:
        text = base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4)).decode()
        stamp, _, ident = text.partition(":")
        at = datetime.fromtimestamp(float(stamp), tz=clock.now().tzinfo)
        if abs(int(ident)) >= 2**62:  # no row's id (tracking.history); a bigint's bounds
            raise ValueError(ident)
        return at, int(ident)
    except (ValueError, UnicodeDecodeError, OverflowError):
        raise SearchError("cursor: not a cursor of this search") from None


@dataclass
class Page:
    rows: list[TrackingEvent]
    next_cursor: str | None


def search(query: TrackingQuery, limit: int = DEFAULT_LIMIT, cursor: str | None = None) -> Page:
    """One page of matching rows, newest first."""
    if not 1 <= limit <= MAX_LIMIT:
        raise SearchError(f"limit: must be between 1 and {MAX_LIMIT}")
    qs = queryset(query)
    after = decode_cursor(cursor) if cursor else None
    if after:
        at, ident = after
        # (at, id) < cursor, written so the at index bounds it.
        qs = qs.filter(at__lte=at).filter(Q(at__lt=at) | Q(id__lt=ident))
    rows = list(qs.order_by("-at", "-id")[: limit + 1])
    # The arrivals, routings and deliveries of messages still in the store are
    # their messages, recipients and attempts (tracking.history): the newest of
    # all, in one order.
    live = _live(query, after, limit + 1)
    if live:
        rows = sorted(rows + live, key=lambda r: (r.at, r.id), reverse=True)[: limit + 1]
    more = len(rows) > limit
    rows = rows[:limit]
    return Page(rows, encode_cursor(rows[-1]) if more and rows else None)


def delivery_queryset(
    query: TrackingQuery, cursor: tuple[datetime, int] | None
) -> QuerySet[Attempt]:
    """``search``'s attempts, in its order, none older than the tracking
    retention (as the rows of ``tracking_event``). Each criterion by an index: the
    message's queue id, its sender and Message-ID through
    ``queues_messagetext``'s trigram indexes, the recipient's address through
    its own, the remote queue id and the time by the attempts' partial
    indexes (``attempt_remote_id``, ``attempt_delivered``)."""
    since = clock.now() - tracking_settings().retention
    qs = history.deliveries().filter(started_at__gte=max(since, query.since or since))
    qs = _by_message(qs, query, "message__")
    if query.recipient:
        qs = qs.alias(rcpt_lower=Lower("recipient__address")).filter(
            recipient__address__ticontains=query.recipient,
            rcpt_lower=query.recipient.lower(),
        )
    if query.remote_id:
        qs = qs.exclude(remote_id="").filter(remote_id=query.remote_id)
    if query.until:
        qs = qs.filter(started_at__lt=query.until)
    if cursor:
        # (at, -id) < cursor: the attempt's id above the cursor's negated one.
        qs = _older(qs, "started_at", cursor[0], Q(id__gt=-cursor[1]))
    return qs.order_by("-started_at", "id")


def arrival_queryset(
    query: TrackingQuery, cursor: tuple[datetime, int] | None
) -> QuerySet[Message]:
    """``search``'s messages, in its order, none older than the tracking
    retention. Each criterion by an index: the queue id's, the trigram
    indexes of ``queues_messagetext`` for sender and Message-ID, the
    recipients' address trigram index (a message is found by any of its
    recipients, as its stored ``received`` row is), and ``message_received``
    for the time and the order."""
    since = clock.now() - tracking_settings().retention
    qs = _by_message(history.arrivals(), query, "")
    qs = qs.filter(received_at__gte=max(since, query.since or since))
    if query.recipient:
        own = (
            Recipient.objects.alias(rcpt_lower=Lower("address"))
            .filter(address__ticontains=query.recipient, rcpt_lower=query.recipient.lower())
            .values("message_id")
        )
        qs = qs.filter(id__in=own)
    if query.until:
        qs = qs.filter(received_at__lt=query.until)
    if cursor:  # (at, id - ARRIVAL_OFFSET) < cursor
        qs = _older(qs, "received_at", cursor[0], Q(id__lt=cursor[1] + history.ARRIVAL_OFFSET))
    return qs.order_by("-received_at", "-id")


def routing_queryset(
    query: TrackingQuery, cursor: tuple[datetime, int] | None
) -> QuerySet[Recipient]:
    """``search``'s recipients, in its order, none older than the tracking
    retention. Each criterion by an index: the message's as for the
    deliveries, the address by ``recipient_address_trgm``, the time and the
    order by ``recipient_routed``."""
    since = clock.now() - tracking_settings().retention
    qs = history.routings().filter(routed_at__gte=max(since, query.since or since))
    qs = _by_message(qs, query, "message__")
    if query.recipient:
        qs = qs.alias(rcpt_lower=Lower("address")).filter(
            address__ticontains=query.recipient, rcpt_lower=query.recipient.lower()
        )
    if query.until:
        qs = qs.filter(routed_at__lt=query.until)
    if cursor:  # (at, id - ROUTING_OFFSET) < cursor
        qs = _older(qs, "routed_at", cursor[0], Q(id__lt=cursor[1] + history.ROUTING_OFFSET))
    return qs.order_by("-routed_at", "-id")


def _older(qs: QuerySet, at_field: str, at: datetime, earlier_id: Q) -> QuerySet:
    """``qs``'s rows before the cursor: before its time, or at it with an id
    ``earlier_id`` says is after it in the search's order (written so the time's
    index bounds it)."""
    return qs.filter(**{f"{at_field}__lte": at}).filter(Q(**{f"{at_field}__lt": at}) | earlier_id)


# Each kind of event read from the store: (event, its queryset, the values a
# row is made of, how).
_SOURCES = (
    (RECEIVED, arrival_queryset, history.ARRIVAL_VALUES, history.as_arrival),
    (ROUTED, routing_queryset, history.ROUTING_VALUES, history.as_routing),
    (DELIVERED, delivery_queryset, history.VALUES, history.as_event),
)


def _live(
    query: TrackingQuery, cursor: tuple[datetime, int] | None, limit: int
) -> list[TrackingEvent]:
    """The newest ``limit`` arrivals, routings and deliveries each of messages
    still in the store that ``query`` matches, after ``cursor`` (at, id)."""
    rows: list[TrackingEvent] = []
    for event, queryset, values, as_row in _SOURCES:
        if query.event and event not in query.event:
            continue
        if query.remote_id and event != DELIVERED:
            continue  # only a delivery has a remote queue id
        rows += [as_row(v) for v in queryset(query, cursor).values(*values)[:limit]]
    return rows


def _message_ids(message_id: str) -> list[str]:
    """A Message-ID as asked, with and without its angle brackets (as asked
    too: one cut at 998 characters may have lost its ">")."""
    bare = message_id.strip("<>")
    return sorted({message_id, f"<{bare}>", bare})


def _by_message(qs: QuerySet, query: TrackingQuery, to_message: str) -> QuerySet:
    """``qs`` (of a store's table; ``to_message``: its path to the message, ``""``
    for the messages) filtered by the message's criteria: sender and
    Message-ID through ``queues_messagetext``'s trigram indexes (the index
    finds, the exact text decides), the queue id by its unique index."""
    m = to_message
    if query.sender:
        qs = qs.alias(sender_lower=Lower(f"{m}mail_from")).filter(
            **{f"{m}search_text__mail_from__ticontains": query.sender},
            sender_lower=query.sender.lower(),
        )
    if query.message_id:
        qs = qs.filter(
            **{
                f"{m}search_text__msgid__ticontains": query.message_id.strip("<>"),
                f"{m}message_id__in": _message_ids(query.message_id),
            }
        )
    if query.qid:
        qs = qs.filter(**{f"{m}qid": query.qid})
    return qs


def parse_limit(value: str | None) -> int:
    if not value:
        return DEFAULT_LIMIT
    try:
        return int(value)
    except ValueError:
        raise SearchError(f"limit: {value!r} is not a number") from None
