"""The read side of the operator surface: one message filter, one queue filter,
statuses and sorting (keyset pages: ``queues.paging``), shared by the Queue Viewer,
the REST API and the management commands.

Every list is one indexed query (see migration 0003 for the index each filter
uses) and pages by keyset, never by OFFSET, so page 10,000 of a million
queued messages costs what page 1 costs.

Each filter parameter is declared once, as a ``FilterParam`` row of
``MESSAGE_FILTERS`` or ``QUEUE_FILTERS``: its name, how its value is parsed
and what it means. That row feeds every edge (``queues.spec`` renders it as
the Queue Viewer's form field, the API's query parameter and OpenAPI entry,
and the command's option) and the query (``MessageFilter.from_params`` parses
the row's value into the field of the same name that ``queryset`` reads).
Parameters come as plain strings (a query string, CLI options, the ``filter``
object of a bulk action); ``MessageFilter.as_params`` gives them back for
links and the audit log.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, fields
from datetime import UTC, datetime
from email.parser import BytesHeaderParser
from email.policy import compat32
from typing import Any

from django.db import models
from django.db.models import CharField, Exists, OuterRef, Q, QuerySet, TextField
from django.db.models.lookups import IContains, Lookup
from django.utils.dateparse import parse_datetime

from queues.holdings import holds_q
from queues.lib import clock, header_block, parse_duration, parse_size
from queues.models import (
    AuditEntry,
    DeliveryType,
    Link,
    LinkState,
    Message,
    MessageSource,
    MessageState,
    Queue,
    Recipient,
    RecipientState,
)
from queues.paging import (
    DEFAULT_LIMIT,
    MAX_BIGINT,
    FilterError,
    FilterForbidden,
    Page,
    Sort,
    keyset_page,
)

# error_group's digit tokens each become a regular expression; PostgreSQL refuses
# an expression that is too complex, so a group has at most this many.
MAX_ERROR_GROUP_TOKENS = 40


# --- a substring lookup the pg_trgm indexes can serve --------------------------


@CharField.register_lookup
@TextField.register_lookup
class TrigramIContains(IContains):
    """``field__ticontains``: case-insensitive substring match.

    Django's ``icontains`` compiles to ``UPPER(col) LIKE UPPER(%s)`` on
    PostgreSQL, which a GIN index on ``col gin_trgm_ops`` cannot serve;
    ``col ILIKE %s`` can. Other databases get the plain ``icontains``.
    """

    lookup_name = "ticontains"

    def as_sql(self, compiler, connection):
        return IContains(self.lhs, self.rhs).as_sql(compiler, connection)

    def as_postgresql(self, compiler, connection):
        # Lookup.process_lhs: the bare column, without BuiltinLookup's UPPER() cast.
        lhs, lhs_params = Lookup.process_lhs(self, compiler, connection)
        rhs, rhs_params = self.process_rhs(compiler, connection)
        return f"{lhs} ILIKE {rhs}", [*lhs_params, *rhs_params]


# --- statuses -----------------------------------------------------------------


class MessageStatus(models.TextChoices):
    """What the Queue Viewer shows for a message, first match wins (in this order)."""

    SUSPENDED = "suspended", "Suspended"  # an operator (or the poison guard) holds it
    SUBMISSION = "submission", "Submission"  # waits for (or is in) the categorizer
    ACTIVE = "active", "Active"  # a recipient is being delivered right now
    RETRY = "retry", "Retry"  # a recipient was tried and waits to be tried again
    READY = "ready", "Ready"  # recipients wait in their queues, not yet tried
    DELIVERED = "delivered", "Delivered"  # done, every recipient delivered
    FAILED = "failed", "Failed"  # done, some recipient failed or expired


class QueueStatus(models.TextChoices):
    READY = "ready", "Ready"
    ACTIVE = "active", "Active"
    RETRY = "retry", "Retry"
    SUSPENDED = "suspended", "Suspended"


def _has_recipient(*states: str) -> Exists:
    return Exists(Recipient.objects.filter(message=OuterRef("pk"), state__in=states))


def message_status_q(status: str) -> Q:
    """The condition for one MessageStatus, exactly as message_status decides it."""
    live = Q(state=MessageState.QUEUED, suspended=False)
    if status == MessageStatus.SUSPENDED:
        return Q(suspended=True) & ~Q(state=MessageState.DONE)
    if status == MessageStatus.SUBMISSION:
        return Q(state__in=[MessageState.SUBMISSION, MessageState.CATEGORIZING], suspended=False)
    active = _has_recipient(RecipientState.ACTIVE)
    deferred = _has_recipient(RecipientState.DEFERRED)
    if status == MessageStatus.ACTIVE:
        return live & Q(active)
    if status == MessageStatus.RETRY:
        return live & ~Q(active) & Q(deferred)
    if status == MessageStatus.READY:
        return live & ~Q(active) & ~Q(deferred)
    failed = _has_recipient(RecipientState.FAILED, RecipientState.EXPIRED)
    if status == MessageStatus.DELIVERED:
        return Q(state=MessageState.DONE) & ~Q(failed)
    if status == MessageStatus.FAILED:
        return Q(state=MessageState.DONE) & Q(failed)
    raise FilterError(f"unknown status {status!r}")


def message_status(message: Message, recipient_states: Iterable[str]) -> str:
    """The MessageStatus of ``message`` given its recipients' states."""
    states = set(recipient_states)
    if message.state == MessageState.DONE:
        if states & {RecipientState.FAILED, RecipientState.EXPIRED}:
            return MessageStatus.FAILED
        return MessageStatus.DELIVERED
    if message.suspended:
        return MessageStatus.SUSPENDED
    if message.state in (MessageState.SUBMISSION, MessageState.CATEGORIZING):
        return MessageStatus.SUBMISSION
    if RecipientState.ACTIVE in states:
        return MessageStatus.ACTIVE
    if RecipientState.DEFERRED in states:
        return MessageStatus.RETRY
    return MessageStatus.READY


def queue_status(queue: Queue) -> str:
    """Suspended when an operator suspended the queue, else its link's state."""
    if queue.suspended:
        return QueueStatus.SUSPENDED
    link = queue.link if queue.link_id else None
    return link.state if link is not None else QueueStatus.READY


# --- the normalised error of "deferrals grouped by error" ---------------------

# Any token holding a digit: counts, ids, IP addresses, host names with numbers.
# The same class in Python and in PostgreSQL's regexp_replace (ERROR_TOKEN_SQL),
# spelled out in ASCII: \w, \d and [[:alnum:]] differ between the two (Unicode
# digits, the database's locale), so the summary's groups and the error_group
# filter would not agree on replies with non-ASCII letters or digits.
_TOKEN_CLASS = "[A-Za-z0-9_.+=/-]"
_TOKEN_WITH_DIGIT = re.compile(f"{_TOKEN_CLASS}*[0-9]{_TOKEN_CLASS}*")
ERROR_TOKEN_SQL = f"{_TOKEN_CLASS}*[0-9]{_TOKEN_CLASS}*"
_SPACES = re.compile(r"\s+")


def error_normalize(text: str) -> str:
    """``greylisted for 300s (id 4F2A)`` → ``greylisted for # (id #)``.

    Every token that holds a digit (counts, ids, addresses, queue ids)
    becomes ``#`` and runs of white space one space, so errors that differ
    only in those fall into one group. (Reply and enhanced codes are
    columns of their own and are grouped on separately.)
    """
    return _SPACES.sub(" ", _TOKEN_WITH_DIGIT.sub("#", text)).strip()


def error_pattern(normalized: str) -> str:
    """A regular expression that matches every text normalising to ``normalized``."""
    parts = [re.escape(p) for p in _SPACES.sub(" ", normalized.strip()).split("#")]
    body = ERROR_TOKEN_SQL.join(parts).replace(r"\ ", r"\s+")
    return "^\\s*" + body + "\\s*$"


# --- the message filter -------------------------------------------------------


def _text(value: str, name: str) -> str:
    value = value.strip()
    if len(value) > 998:
        raise FilterError(f"{name}: at most 998 characters")
    if "\x00" in value:  # PostgreSQL text cannot hold NUL
        raise FilterError(f"{name}: must not contain NUL characters")
    return value


def _when(value: str, name: str) -> datetime:
    """A duration back from now (``2h``) or an ISO 8601 time."""
    value = value.strip()
    try:
        return clock.now() - parse_duration(value)
    except ValueError:
        pass
    except OverflowError:  # 99999999999w: further back than any calendar
        raise FilterError(f"{name}: {value!r} is too long ago") from None
    try:
        parsed = parse_datetime(value)
    except ValueError:  # well formed but no such time (2026-02-30, +25:00)
        raise FilterError(f"{name}: {value!r} is not a valid time") from None
    if parsed is None:
        raise FilterError(f"{name}: {value!r} is neither a duration (2h, 30m) nor an ISO time")
    if parsed.tzinfo is None:
        raise FilterError(f"{name}: {value!r} has no time zone (add Z or +00:00)")
    try:
        return parsed.astimezone(UTC)
    except OverflowError:  # 0001-01-01T00:00+01:00 is in year 0
        raise FilterError(f"{name}: {value!r} is out of range") from None


def _size(value: str, name: str) -> int:
    try:
        size = parse_size(value)
    except ValueError:
        raise FilterError(f"{name}: {value!r} is not a size (e.g. 10K, 2MB, 1048576)") from None
    if size > MAX_BIGINT:
        raise FilterError(f"{name}: {value!r} is too large")
    return size


def _int(value: str, name: str) -> int:
    try:
        number = int(value)
    except ValueError:
        raise FilterError(f"{name}: {value!r} is not a number") from None
    if number < 0:
        raise FilterError(f"{name}: must not be negative")
    if number > MAX_BIGINT:
        raise FilterError(f"{name}: {value!r} is too large")
    return number


def _choices(value: str, name: str, choices: Iterable[str]) -> list[str]:
    allowed = list(choices)
    out = [v.strip().lower() for v in value.split(",") if v.strip()]
    for v in out:
        if v not in allowed:
            raise FilterError(f"{name}: {v!r} is not one of {', '.join(allowed)}")
    return out


def _bool(value: str, name: str) -> bool:
    return value.strip().lower() in ("1", "true", "yes", "on")


# How a parameter's string becomes a value, by kind (each raises FilterError).
_PARSERS: dict[str, Callable[[str, str], Any]] = {
    "text": _text,
    "domain": lambda value, name: _text(value, name).lower().rstrip(".").lstrip("@"),
    "int": _int,
    "when": _when,
    "size": _size,
    "bool": _bool,
}
# Where a parameter appears: the Queue Viewer's filter form, the API, the commands.
EDGES = frozenset({"form", "api", "cli"})


@dataclass(frozen=True)
class FilterParam:
    """One filter parameter, declared once for every edge and for the query.

    ``name`` is the query parameter, the form field and (``--name-with-dashes``)
    the command's option; ``attr`` the field of the filter object it fills.
    """

    name: str
    kind: str  # a key of _PARSERS, or "choices" (a comma list of ``choices``' values)
    help: str  # what it means: the API's and the command's description
    label: str = ""  # the form's label (default: from the name)
    hint: str = ""  # the form's placeholder
    choices: Callable[[], Sequence[tuple[str, str]]] | None = None
    attr: str = ""
    edges: frozenset[str] = EDGES
    # Filters by what only content readers see (queues.permissions.can_read_content):
    # refused for viewers, or a viewer could confirm a value by its results.
    private: bool = False

    @property
    def field_name(self) -> str:
        return self.attr or self.name

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")

    def values(self) -> list[str]:
        return [value for value, _ in (self.choices() if self.choices else [])]

    def parse(self, raw: str) -> Any:
        if self.kind == "choices":
            return _choices(raw, self.name, self.values())
        return _PARSERS[self.kind](raw, self.name)


def _parse_into(
    target: Any, table: Sequence[FilterParam], params: Mapping[str, Any], content: bool = True
) -> None:
    """Fill ``target``'s fields from the non-empty ``params`` of ``table`` (others ignored).

    ``content``: whether the caller may read message content; without it a
    private parameter is refused (FilterForbidden).
    """
    for spec in table:
        raw = params.get(spec.name)
        if raw is None or not str(raw).strip():
            continue
        if spec.private and not content:
            raise FilterForbidden(f"{spec.name}: this filter needs the operator role")
        value = str(raw)
        target.params[spec.name] = value
        setattr(target, spec.field_name, spec.parse(value))


_WHEN = "2h, 30m, 1d or an ISO time"
_SIZE = "bytes, or 10K, 2MB"

# In the order the Queue Viewer's filter bar shows them.
MESSAGE_FILTERS: tuple[FilterParam, ...] = (
    FilterParam(
        "sender",
        "text",
        'substring of MAIL FROM ("<>": null sender)',
        hint="substring; <> for the null sender",
    ),
    FilterParam(
        "recipient", "text", "substring of any recipient address", hint="substring of any recipient"
    ),
    FilterParam("domain", "domain", "a recipient domain, exactly", label="Recipient domain"),
    FilterParam("subject", "text", "substring of the Subject"),
    FilterParam(
        "message_id",
        "text",
        "substring of the Message-ID header (operators; refused for viewers)",
        label="Message-ID",
        private=True,
    ),
    FilterParam("qid", "text", "queue id, exactly", label="Queue id"),
    FilterParam(
        "account",
        "text",
        "the SMTP account (AUTH username) that sent it, exactly",
        label="SMTP account",
        hint="AUTH username",
    ),
    FilterParam(
        "status",
        "choices",
        "any of (comma list): " + ", ".join(MessageStatus.values),
        choices=lambda: MessageStatus.choices,
    ),
    FilterParam(
        "source",
        "choices",
        "any of (comma list): " + ", ".join(MessageSource.values),
        choices=lambda: MessageSource.choices,
    ),
    FilterParam(
        "queue",
        "int",
        "held by this queue (id), as its count counts: waiting or in flight there; "
        "Dead-letter: its dead letters; Submission: in the categorizer",
        label="Queue (number)",
    ),
    FilterParam(
        "newer_than",
        "when",
        f"received since: {_WHEN}",
        label="Received within",
        hint="e.g. 30m, 2h, or an ISO time",
    ),
    FilterParam(
        "older_than",
        "when",
        f"received before: {_WHEN}",
        label="Older than",
        hint="e.g. 4h, 2d, or an ISO time",
    ),
    FilterParam("min_size", "size", _SIZE, label="Size at least", hint="e.g. 10K, 2MB"),
    FilterParam("max_size", "size", _SIZE, label="Size at most"),
    FilterParam(
        "error",
        "text",
        "substring of a deferred or failed recipient's last reply",
        label="Last error",
        hint="substring",
    ),
    FilterParam(
        "error_group",
        "text",
        "a normalised error (deferrals grouped by error, /api/v1/errors/)",
        edges=frozenset({"api", "cli"}),
    ),
)


@dataclass
class MessageFilter:
    """What the operator asked to see. Empty fields do not filter.

    One field per row of MESSAGE_FILTERS (same name), filled by ``from_params``.
    """

    qid: str = ""  # exact queue id
    sender: str = ""  # substring of MAIL FROM; "<>" is the null sender
    recipient: str = ""  # substring of any recipient address
    domain: str = ""  # any recipient's domain, exactly
    message_id: str = ""  # substring of the Message-ID header
    subject: str = ""  # substring of the Subject
    status: list[str] = field(default_factory=list)  # MessageStatus values (any of)
    queue: int | None = None  # held by this queue (queues.holdings)
    older_than: datetime | None = None  # received before
    newer_than: datetime | None = None  # received at or after
    min_size: int | None = None
    max_size: int | None = None
    error: str = ""  # substring of a deferred/failed recipient's last reply
    error_group: str = ""  # a normalised error (error_normalize), per "deferrals by error"
    source: list[str] = field(default_factory=list)  # MessageSource values (any of)
    account: str = ""  # the SmtpAccount username that submitted it (index message_by_account)
    # The raw parameters, as given (kept for the audit log and for links).
    params: dict[str, str] = field(default_factory=dict, compare=False, repr=False)

    PARAMS = tuple(spec.name for spec in MESSAGE_FILTERS)

    @classmethod
    def from_params(cls, params: Mapping[str, Any], *, content: bool = True) -> MessageFilter:
        """Parse the filter parameters of ``params``; other keys are ignored.

        ``content=False`` (a viewer): private filters (Message-ID) are refused.
        """
        f = cls()
        _parse_into(f, MESSAGE_FILTERS, params, content)
        if f.error_group.count("#") > MAX_ERROR_GROUP_TOKENS:
            raise FilterError(f"error_group: at most {MAX_ERROR_GROUP_TOKENS} # tokens")
        return f

    def as_params(self) -> dict[str, str]:
        return dict(self.params)

    def is_empty(self) -> bool:
        return not self.params

    def queryset(self, base: QuerySet[Message] | None = None) -> QuerySet[Message]:
        """The messages that match (unordered; page them with ``messages_page``)."""
        qs = base if base is not None else Message.objects.all()
        if self.qid:
            qs = qs.filter(qid=self.qid.upper())
        # The substring filters on the sender, the Message-ID and the Subject search
        # the text the database keeps once a message (MessageText, its trigram
        # indexes), not the message's row, whose state changes.
        if self.sender:
            if self.sender == "<>":
                qs = qs.filter(mail_from="")
            else:
                qs = qs.filter(search_text__mail_from__ticontains=self.sender.strip("<>"))
        if self.recipient:
            address = self.recipient.strip("<>")
            qs = qs.filter(
                Exists(
                    Recipient.objects.filter(message=OuterRef("pk"), address__ticontains=address)
                )
            )
        if self.domain:
            qs = qs.filter(
                Exists(Recipient.objects.filter(message=OuterRef("pk"), domain=self.domain))
            )
        if self.message_id:
            qs = qs.filter(search_text__msgid__ticontains=self.message_id)
        if self.subject:
            qs = qs.filter(search_text__subject__ticontains=self.subject)
        if self.status:
            cond = Q()
            for status in self.status:
                cond |= message_status_q(status)
            qs = qs.filter(cond)
        if self.queue is not None:
            # What the queue's count counts and its actions act on (one definition).
            queue = Queue.objects.filter(pk=self.queue).first()
            qs = qs.filter(holds_q(queue)) if queue is not None else qs.none()
        if self.older_than is not None:
            qs = qs.filter(received_at__lt=self.older_than)
        if self.newer_than is not None:
            qs = qs.filter(received_at__gte=self.newer_than)
        if self.min_size is not None:
            qs = qs.filter(size__gte=self.min_size)
        if self.max_size is not None:
            qs = qs.filter(size__lte=self.max_size)
        if self.error or self.error_group:
            # state IN (...) exactly as the partial index recipient_error_trgm says
            errors = Recipient.objects.filter(
                message=OuterRef("pk"),
                state__in=[RecipientState.DEFERRED, RecipientState.FAILED, RecipientState.EXPIRED],
            )
            if self.error:
                errors = errors.filter(last_text__ticontains=self.error)
            if self.error_group:
                errors = errors.filter(last_text__regex=error_pattern(self.error_group))
            qs = qs.filter(Exists(errors))
        if self.source:
            qs = qs.filter(source__in=self.source)
        if self.account:
            qs = qs.filter(auth_account=self.account.strip())
        return qs


# --- sorting (paged by queues.paging) ------------------------------------------

MESSAGE_SORTS = {"received": "received_at", "size": "size", "id": "id"}
MESSAGE_DEFAULT_SORT = "-received"
QUEUE_SORTS = {
    "name": "name",
    "count": "message_count",
    "type": "delivery_type",
    "id": "id",
    "incoming": "incoming_rate",
    "outgoing": "outgoing_rate",
}
QUEUE_DEFAULT_SORT = "-count"


def messages_page(
    f: MessageFilter,
    sort: str | None = None,
    cursor: str | None = None,
    limit: int = DEFAULT_LIMIT,
    base: QuerySet[Message] | None = None,
) -> Page[Message]:
    """One page of the messages matching ``f``; the heavy ``data`` column stays unread."""
    qs = f.queryset(base).defer("data")
    return keyset_page(qs, Sort.parse(sort, MESSAGE_SORTS, MESSAGE_DEFAULT_SORT), cursor, limit)


def messages_prefetch(messages: Sequence[Message]) -> dict[int, list[Recipient]]:
    """The recipients (with their queues) of one page of messages, in one query."""
    by_message: dict[int, list[Recipient]] = {m.pk: [] for m in messages}
    rows = (
        Recipient.objects.filter(message_id__in=list(by_message))
        .select_related("queue")
        .order_by("message_id", "id")
    )
    for r in rows:
        by_message[r.message_id].append(r)
    return by_message


# --- queues -----------------------------------------------------------------


QUEUE_FILTERS: tuple[FilterParam, ...] = (
    FilterParam("name", "text", "substring of the queue name", label="Next-hop domain"),
    FilterParam(
        "type",
        "choices",
        "delivery type(s), comma list: " + ", ".join(DeliveryType.values),
        label="Type",
        choices=lambda: DeliveryType.choices,
        attr="delivery_type",
    ),
    FilterParam(
        "status",
        "choices",
        "any of (comma list): " + ", ".join(QueueStatus.values),
        choices=lambda: QueueStatus.choices,
    ),
    FilterParam("link", "int", "the link (next hop) id", edges=frozenset({"api", "cli"})),
    FilterParam("nonempty", "bool", "only queues with messages", label="Only with messages"),
)


@dataclass
class QueueFilter:
    """One field per row of QUEUE_FILTERS (``type`` fills ``delivery_type``)."""

    name: str = ""  # substring of the queue name (the next-hop domain)
    delivery_type: list[str] = field(default_factory=list)
    status: list[str] = field(default_factory=list)
    link: int | None = None
    nonempty: bool = False
    params: dict[str, str] = field(default_factory=dict, compare=False, repr=False)

    @classmethod
    def from_params(cls, params: Mapping[str, Any]) -> QueueFilter:
        f = cls()
        _parse_into(f, QUEUE_FILTERS, params)
        return f

    def as_params(self) -> dict[str, str]:
        return dict(self.params)

    def queryset(self) -> QuerySet[Queue]:
        qs = Queue.objects.select_related("link")
        if self.name:
            qs = qs.filter(name__icontains=self.name)
        if self.delivery_type:
            qs = qs.filter(delivery_type__in=self.delivery_type)
        if self.link is not None:
            qs = qs.filter(link_id=self.link)
        if self.nonempty:
            qs = qs.filter(message_count__gt=0)
        if self.status:
            cond = Q()
            for status in self.status:
                if status == QueueStatus.SUSPENDED:
                    cond |= Q(suspended=True)
                elif status == QueueStatus.READY:
                    cond |= Q(suspended=False) & (
                        Q(link__isnull=True) | Q(link__state=LinkState.READY)
                    )
                else:
                    cond |= Q(suspended=False, link__state=status)
            qs = qs.filter(cond)
        return qs


def queues_page(
    f: QueueFilter, sort: str | None = None, cursor: str | None = None, limit: int = 100
) -> Page[Queue]:
    return keyset_page(
        f.queryset(), Sort.parse(sort, QUEUE_SORTS, QUEUE_DEFAULT_SORT), cursor, limit
    )


def links_page(cursor: str | None = None, limit: int = 100) -> Page[Link]:
    return keyset_page(Link.objects.all(), Sort("name", False), cursor, limit)


# --- the audit log ------------------------------------------------------------


@dataclass
class AuditFilter:
    action: str = ""
    actor: str = ""
    target_type: str = ""
    via: str = ""
    since: datetime | None = None
    params: dict[str, str] = field(default_factory=dict, compare=False, repr=False)

    @classmethod
    def from_params(cls, params: Mapping[str, Any]) -> AuditFilter:
        f = cls()
        for spec in fields(cls):
            if spec.name == "params":
                continue
            raw = params.get(spec.name)
            if raw is None or not str(raw).strip():
                continue
            f.params[spec.name] = str(raw)
            if spec.name == "since":
                f.since = _when(str(raw), "since")
            else:
                setattr(f, spec.name, _text(str(raw), spec.name))
        return f

    def queryset(self) -> QuerySet[AuditEntry]:
        qs = AuditEntry.objects.all()
        if self.action:
            qs = qs.filter(action=self.action)
        if self.actor:
            qs = qs.filter(actor_name=self.actor)
        if self.target_type:
            qs = qs.filter(target_type=self.target_type)
        if self.via:
            qs = qs.filter(via=self.via)
        if self.since is not None:
            qs = qs.filter(created_at__gte=self.since)
        return qs


def audit_page(f: AuditFilter, cursor: str | None = None, limit: int = DEFAULT_LIMIT):
    return keyset_page(f.queryset(), Sort("id", True), cursor, limit)


# --- message content, for the detail views -------------------------------------


def message_headers(message: Message) -> list[tuple[str, str]]:
    """The header fields of the stored message, unfolded, in order (values as text)."""
    block = header_block(bytes(message.data))
    parsed = BytesHeaderParser(policy=compat32).parsebytes(block + b"\r\n\r\n")
    return [(name, _SPACES.sub(" ", str(value)).strip()) for name, value in parsed.items()]


def message_body_preview(message: Message, limit: int = 64 * 1024) -> tuple[str, bool]:
    """The first ``limit`` bytes of the body as text, and whether it was cut.

    Text only: the caller shows it escaped (never as live HTML).
    """
    data = bytes(message.data)
    match = re.search(rb"\r?\n\r?\n", data)
    body = data[match.end() :] if match else b""
    return body[:limit].decode("utf-8", "replace"), len(body) > limit


__all__ = [
    "MESSAGE_FILTERS",
    "QUEUE_FILTERS",
    "AuditFilter",
    "FilterParam",
    "MessageFilter",
    "MessageStatus",
    "QueueFilter",
    "QueueStatus",
    "audit_page",
    "error_normalize",
    "error_pattern",
    "links_page",
    "message_body_preview",
    "message_headers",
    "message_status",
    "message_status_q",
    "messages_page",
    "messages_prefetch",
    "queue_status",
]
