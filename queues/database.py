"""How the store talks to PostgreSQL: the one batch writer, which database
errors are an outage, and the database going away and coming back as one
process sees it.

**The one batch writer**: many rows, different values, one statement.

Django's ``bulk_update`` builds a CASE expression per field and row in
Python, and ``bulk_create`` prepares every value and sends a placeholder
each, which costs more than the statement itself for a few hundred rows.
On PostgreSQL the batch goes as ONE JSON parameter read by
``json_to_recordset()`` (``json_rows``, ``json_payload``): the JSON
encoder is several times cheaper than psycopg's binding of a VALUES list
(23 placeholders a row) or of one array per column. ``json``, not ``jsonb``:
the server only checks the text and reads each row's fields once, where
``jsonb`` first builds the whole document in its binary form (a batch of 20
tracking rows: 0.24–0.31 ms against 0.42–0.51 ms of the server's time,
bench/README.md "Session 18"); the values come out the same. Used by every batch
write of the hot paths: a round's recipients (``update_json``), its
attempts and tracking rows (``insert_json``), the webhook outbox.
``bulk_update_rows`` writes ``UPDATE … FROM (VALUES …)``; other databases
use ``bulk_update``. ``insert_with_children`` is the ingress's insert.

**Errors** (``is_outage``, ``drop_connection``): which database errors are an
outage (the server is away: reconnect and try again) and which are about the
statement or its data (trying again gives the same error: handle it as a
failure of that work).

**Outages** (``OUTAGE``, ``retry_outages``, ``waits_for_database``): what an
owner, a task and the ingress do while the database is away (issue #25).

**The hot paths' query helpers**: the ``any`` lookup (``filter(id__any=ids)``,
one array parameter) and whether the hand-written PostgreSQL statements may
be used (``postgresql()``).
"""

from __future__ import annotations

import functools
import json
import logging
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime
from functools import cache
from typing import Any, ParamSpec, Protocol, TypeVar

import psycopg
import psycopg.adapt
from django.db import (
    DEFAULT_DB_ALIAS,
    InterfaceError,
    OperationalError,
    connection,
    connections,
    models,
)
from django.db.backends.base.base import BaseDatabaseWrapper
from django.db.models import Lookup
from django.db.models.lookups import In

from queues.config import store_settings

log = logging.getLogger(__name__)
T = TypeVar("T")


def _json_value(value: object) -> str:
    return value.isoformat() if isinstance(value, datetime) else str(value)


def json_payload(rows: Iterable[Mapping[str, object]]) -> str:
    """The batch as the one JSON parameter of ``json_rows`` (times as ISO text)."""
    return json.dumps(list(rows), default=_json_value)


def json_rows(alias: str, columns: Sequence[tuple[str, str]], placeholder: str = "%s") -> str:
    """``json_to_recordset(%s::json) AS alias(column type, …)``: the batch as a
    table in a statement; its parameter is ``json_payload(rows)``."""
    typed = ", ".join(f"{name} {kind}" for name, kind in columns)
    return f"json_to_recordset({placeholder}::json) AS {alias}({typed})"


def json_column_type(field: models.Field) -> str:
    """The column type of a model field in a ``json_rows`` column list."""
    if field.is_relation:
        return "bigint"
    return field.cast_db_type(connection) or "text"


def field_columns(model: type[models.Model], names: Sequence[str]) -> list[tuple[str, str]]:
    """(column, type) of ``names``, fields of ``model``, for ``json_rows``."""
    meta = model._meta
    return [(f.column, json_column_type(f)) for f in (meta.get_field(n) for n in names)]


class _Prepared(psycopg.Cursor):
    """Parameters bound by the server and the statement prepared on its
    connection at its first run (psycopg keeps the last 100 per connection)."""

    def execute(self, query: Any, params: Any = None, **kwargs: Any) -> Any:  # type: ignore[override]
        kwargs.setdefault("prepare", True)
        return super().execute(query, params, **kwargs)

    def _send_query_prepared(self, name: bytes, pgq: Any, *, binary: bool | None = None) -> None:
        # psycopg notes the query it sent only when it is not prepared; Django's
        # query log (and tests counting statements) reads it from there.
        self._query = pgq
        super()._send_query_prepared(name, pgq, binary=binary)


def prepared_cursor() -> Any:
    """A cursor for the hot paths' batch inserts (``insert_json``: the tracking
    rows, a round's attempts, the webhook outbox) and for the calls of the
    pinned functions (migrations queues/0014, 0018: the claims, placements and
    records): their text never changes and their own plan reads no table (a
    function's statements keep the plans the function pinned), so PostgreSQL
    parses and plans each once per connection, and the ids and the JSON go as
    bound parameters, not as quoted literals built by psycopg in Python and
    parsed again by the server. Other statements that find rows are not
    prepared: a generic plan made while a table was small keeps scanning it after
    it has grown, until the next ANALYZE (measured: a seq scan per categorizer batch).
    Django's cursor wrapper all the same: its errors, its execute wrappers, its
    query log. ``MAILRELAY_DB_PREPARE`` off (a pooler in transaction mode
    without prepared statements), or another database: Django's own cursor."""
    if (
        connection.vendor != "postgresql"
        or not store_settings().db_prepare
        or connection.settings_dict["OPTIONS"].get("prepare_threshold") is None
    ):
        return connection.cursor()
    connection.close_if_health_check_failed()
    connection.ensure_connection()
    with connection.wrap_database_errors:
        return connection._prepare_cursor(_Prepared(connection.connection))


@contextmanager
def pipelined() -> Iterator[None]:
    """The statements run inside sent as one pipeline (PostgreSQL; psycopg's
    pipeline mode): one round trip for all, their results (and an error)
    arriving at the end or when read. Elsewhere: nothing."""
    if connection.vendor != "postgresql":
        yield
        return
    connection.ensure_connection()
    # An error arrives when the pipeline is sent: as Django's, as any other.
    with connection.wrap_database_errors, connection.connection.pipeline():
        yield


def insert_json(
    table: str, columns: Sequence[tuple[str, str]], rows: Sequence[Mapping[str, object]]
) -> None:
    """``INSERT INTO table (columns) SELECT columns FROM json_rows`` (PostgreSQL),
    in the caller's transaction; ``rows`` map each column to its value."""
    names = ", ".join(name for name, _ in columns)
    sql = f"INSERT INTO {table} ({names}) SELECT {names} FROM {json_rows('x', columns)}"
    with prepared_cursor() as cur:
        cur.execute(sql, [json_payload(rows)])


def insert_all(rows: Sequence[models.Model]) -> None:
    """New rows of one model, no pk back (none is needed): on PostgreSQL one
    ``insert_json`` of the whole batch (bulk_create prepares each field of each
    row and sends a placeholder per value, several times the CPU);
    bulk_create elsewhere."""
    if not rows:
        return
    model = type(rows[0])
    if connection.vendor != "postgresql":
        model.objects.bulk_create(rows)
        return
    fields, columns = _insert_fields(model)
    values = [{f.column: getattr(row, f.attname) for f in fields} for row in rows]
    insert_json(model._meta.db_table, columns, values)


@cache
def _insert_fields(model: type[models.Model]) -> tuple[list[models.Field], list[tuple[str, str]]]:
    fields = [f for f in model._meta.concrete_fields if not f.primary_key]
    return fields, [(f.column, json_column_type(f)) for f in fields]


def update_json(
    table: str,
    columns: Sequence[tuple[str, str]],
    rows: Sequence[Mapping[str, object]],
    *,
    where: str = "",
    params: Sequence[object] = (),
) -> set[int]:
    """``UPDATE table AS t SET column = v.column, … FROM json_rows WHERE t.id =
    v.id [AND where] RETURNING t.id`` (PostgreSQL): each row (with its ``id``)
    written in one statement, ``where`` (on ``t``, with ``params``) fencing
    which; returns the ids written."""
    assignments = ", ".join(f"{name} = v.{name}" for name, _ in columns)
    recordset = json_rows("v", [("id", "bigint"), *columns])
    sql = (
        f"UPDATE {table} AS t SET {assignments} FROM {recordset} WHERE t.id = v.id"
        + (f" AND {where}" if where else "")
        + " RETURNING t.id"
    )
    with connection.cursor() as cur:
        cur.execute(sql, [json_payload(rows), *params])
        return {row[0] for row in cur.fetchall()}


def bulk_update_rows(rows: Sequence[models.Model], fields: Sequence[str]) -> None:
    if not rows:
        return
    model = type(rows[0])
    if connection.vendor != "postgresql":
        model.objects.bulk_update(rows, list(fields))
        return
    meta = model._meta
    pk = meta.pk
    columns = [pk] + [meta.get_field(name) for name in fields]
    casts = [f"%s::{field.db_type(connection)}" for field in columns]
    row_sql = "(" + ", ".join(casts) + ")"
    params: list[object] = []
    for row in rows:
        for field in columns:
            params.append(field.get_db_prep_save(getattr(row, field.attname), connection))
    quote = connection.ops.quote_name
    names = [quote(field.column) for field in columns]
    assignments = ", ".join(f"{name} = v.{name}" for name in names[1:])
    sql = (
        f"UPDATE {quote(meta.db_table)} AS t SET {assignments} "
        f"FROM (VALUES {', '.join([row_sql] * len(rows))}) AS v({', '.join(names)}) "
        f"WHERE t.{names[0]} = v.{names[0]}"
    )
    with connection.cursor() as cursor:
        cursor.execute(sql, params)


_NONE = type(None)
_DJANGO = frozenset[type]()  # every value through the field's get_db_prep_save
# The field classes (exactly these, not subclasses) whose get_db_prep_save hands
# PostgreSQL the very object it is given when the value is of one of these exact
# types: their to_python/get_prep_value return it unchanged (an aware datetime:
# no naive-time warning; PostgreSQL's adapt_datetimefield_value returns it). The
# value is then added as it is, without the field's three calls per value.
# Integers are not among them: PostgreSQL's adapt_integerfield_value wraps them.
_AS_IS_TYPES: dict[type[models.Field], frozenset[type]] = {
    models.CharField: frozenset({str, _NONE}),
    models.TextField: frozenset({str, _NONE}),
    models.BooleanField: frozenset({bool, _NONE}),
    models.DateTimeField: frozenset({datetime, _NONE}),
    models.IntegerField: frozenset({_NONE}),
    models.BigIntegerField: frozenset({_NONE}),
    models.PositiveIntegerField: frozenset({_NONE}),
    models.PositiveSmallIntegerField: frozenset({_NONE}),
}


def _as_is_types(fields: Sequence[models.Field], vendor: str) -> tuple[frozenset[type], ...]:
    """For each field, the value types it sends as they are (``_AS_IS_TYPES``; PostgreSQL)."""
    if vendor != "postgresql":
        return tuple(_DJANGO for _ in fields)
    return tuple(_AS_IS_TYPES.get(type(f), _DJANGO) for f in fields)


@dataclass(frozen=True)
class _InsertShape:
    """The fields and SQL pieces of a parent-with-children insert, built once per model pair."""

    parent_fields: tuple[models.Field, ...]
    # of each parent field: its position in a row's values, whether it is sent
    # as text (GenericIPAddressField), the types it sends as they are (_as_is_types)
    parent_slots: tuple[tuple[models.Field, int, bool, frozenset[type]], ...]
    child_fields: tuple[models.Field, ...]
    child_slots: tuple[tuple[models.Field, int, frozenset[type]], ...]
    parent_table: str
    parent_columns: str
    pk_column: str
    child_table: str
    fk_column: str
    child_columns: str
    child_casts: tuple[str, ...]  # "::type" of each child column
    child_columns_of_v: str  # "v.col, …"


_SHAPES: dict[tuple[type, type, str, str], _InsertShape] = {}


def _shape(model: type[models.Model], child_model: type[models.Model], fk: str) -> _InsertShape:
    key = (model, child_model, fk, connection.vendor)
    shape = _SHAPES.get(key)
    if shape is None:
        quote = connection.ops.quote_name
        meta, child_meta = model._meta, child_model._meta
        fk_field = child_meta.get_field(fk)
        parent_fields = tuple(f for f in meta.concrete_fields if not f.primary_key)
        child_fields = tuple(
            f for f in child_meta.concrete_fields if not f.primary_key and f is not fk_field
        )
        parent_at, child_at = meta.concrete_fields.index, child_meta.concrete_fields.index
        shape = _SHAPES[key] = _InsertShape(
            parent_fields=parent_fields,
            parent_slots=tuple(
                (f, parent_at(f), isinstance(f, models.GenericIPAddressField), as_is)
                for f, as_is in zip(
                    parent_fields, _as_is_types(parent_fields, connection.vendor), strict=True
                )
            ),
            child_fields=child_fields,
            child_slots=tuple(
                (f, child_at(f), as_is)
                for f, as_is in zip(
                    child_fields, _as_is_types(child_fields, connection.vendor), strict=True
                )
            ),
            parent_table=quote(meta.db_table),
            parent_columns=", ".join(quote(f.column) for f in parent_fields),
            pk_column=quote(meta.pk.column),
            child_table=quote(child_meta.db_table),
            fk_column=quote(fk_field.column),
            child_columns=", ".join(quote(f.column) for f in child_fields),
            child_columns_of_v=", ".join("v." + quote(f.column) for f in child_fields),
            child_casts=tuple(f"::{f.db_type(connection)}" for f in child_fields),
        )
    return shape


class _Params:
    """Query parameters with PostgreSQL's own ``$n`` placeholders.

    The statements here are long (a batch of messages with its recipients):
    psycopg would parse ``%s`` placeholders out of each one with a regular
    expression (its cache takes only short queries), which cost more than
    building them. ``psycopg.RawCursor`` sends ``$n`` as written.
    """

    def __init__(self) -> None:
        self.values: list[object] = []

    def add(self, value: object) -> str:
        self.values.append(value)
        return f"${len(self.values)}"


@functools.lru_cache(maxsize=4096)
def _placeholders(
    start: int, count: int, joined: tuple[tuple[int, int], ...], casts: tuple[str, ...]
) -> str:
    """A VALUES row's text for ``count`` columns whose parameters start after the
    ``start``-th: ``($7, ($8 || $9), $10::int)``. ``joined`` gives (column, pieces)
    of each column sent in pieces; ``casts`` each column's cast, or none. The
    rows of a batch repeat from one batch to the next: made once each."""
    pieces = dict(joined)
    texts = []
    n = start
    for column in range(count):
        width = pieces.get(column, 0)
        if width:
            texts.append("(" + " || ".join(f"${n + j}" for j in range(1, width + 1)) + ")")
            n += width
        else:
            n += 1
            texts.append(f"${n}{casts[column]}" if casts else f"${n}")
    return "(" + ", ".join(texts) + ")"


def _parent_row(
    shape: _InsertShape,
    values: Sequence[object],
    parts: Mapping[str, Sequence[bytes | bytearray]],
    params: _Params,
    db: BaseDatabaseWrapper,
) -> str:
    """One parent's VALUES row (its ``values``, in its model's concrete fields'
    order, added to ``params``).

    A value goes as it is when its field would send it so (``_AS_IS_TYPES``),
    else through the field's ``get_db_prep_save``. An address goes as the text
    it is: PostgreSQL reads it into the inet column (Django would parse it
    into an ipaddress object first, a tenth of the ingress's CPU per message).
    ``db`` is the connection itself, not Django's ``connection`` proxy: the
    fields' value preparation reads it a few times per value, and each read
    through the proxy is a thread-local lookup.
    """
    out = params.values
    start = len(out)
    joined = []
    for column, (f, at, as_text, as_is) in enumerate(shape.parent_slots):
        pieces = parts.get(f.name) if parts else None
        if pieces is not None:
            out.extend(pieces)
            joined.append((column, len(pieces)))
            continue
        value = values[at]
        kind = type(value)
        if as_text:
            out.append(value or None)
        elif kind in as_is and (kind is not datetime or value.utcoffset() is not None):  # type: ignore[attr-defined]
            out.append(value)
        else:
            out.append(f.get_db_prep_save(value, db))
    return _placeholders(start, len(shape.parent_slots), tuple(joined), ())


def _child_row(
    shape: _InsertShape,
    values: Sequence[object],
    params: _Params,
    db: BaseDatabaseWrapper,
    key: str = "",
) -> str:
    out = params.values
    start = len(out)
    for f, at, as_is in shape.child_slots:
        value = values[at]
        kind = type(value)
        if kind in as_is and (kind is not datetime or value.utcoffset() is not None):  # type: ignore[attr-defined]
            out.append(value)
        else:
            out.append(f.get_db_prep_save(value, db))
    row = _placeholders(start, len(shape.child_slots), (), shape.child_casts)
    return "(" + key + ", " + row[1:] if key else row


def _execute_binary(sql: str, params: _Params) -> list[tuple]:
    """Run ``sql`` on Django's connection with bytes sent as binary parameters."""
    connection.validate_no_broken_transaction()  # as Django's own cursor does
    connection.ensure_connection()
    # A server-side-binding cursor (Django's is a ClientCursor, which would
    # inline the body into the query text as hex: three times its size).
    with connection.wrap_database_errors, psycopg.RawCursor(connection.connection) as cursor:
        for kind in (bytes, bytearray, memoryview):
            cursor.adapters.register_dumper(kind, _BufferDumper)
        cursor.execute(sql, params.values)
        return cursor.fetchall()


class InsertRow(Protocol):
    """A row to insert (``queues.accept.NewRow``): its model, its concrete fields'
    values in their order, its primary key (set by the insert), and the model
    instance it is (for the ORM's insert, off PostgreSQL)."""

    model: type[models.Model]
    values: list[object]
    pk: object

    def instance(self) -> models.Model: ...


def insert_with_children(
    parent: InsertRow,
    children: Sequence[InsertRow],
    fk: str,
    *,
    parts: Mapping[str, Sequence[bytes | bytearray]] | None = None,
) -> None:
    """Insert ``parent`` and its ``children`` (whose ``fk`` points at it) atomically.

    On PostgreSQL this is one statement, ``WITH p AS (INSERT … RETURNING id)
    INSERT … SELECT`` — one round trip and its own transaction — which is the
    SMTP ingress's whole database cost per message. Sets ``parent.pk``.
    Elsewhere: a transaction with two ORM inserts.

    ``parts`` gives binary fields of ``parent`` as pieces to concatenate (a
    header prefix and a large body): on PostgreSQL each piece is sent as a
    binary parameter (no escaping, no client-side copy into the query text)
    and the server joins them, so a message body is never copied whole by us.
    """
    insert_many_with_children([(parent, children, parts or {})], fk, key_field="")


def insert_many_with_children(
    items: Sequence[
        tuple[InsertRow, Sequence[InsertRow], Mapping[str, Sequence[bytes | bytearray]]]
    ],
    fk: str,
    *,
    key_field: str,
) -> None:
    """Insert several parents, each with its children, in ONE statement (group commit).

    ``items`` are (parent, children, parts) as for ``insert_with_children``;
    ``key_field`` names a unique field of the parent (``qid``) by which the
    children find their parent's new id. The statement is atomic: all rows
    are inserted or none. Inside a transaction it joins that transaction;
    outside one it is its own. Sets every parent's pk.
    """
    if not items:
        return
    if connection.vendor != "postgresql":
        from django.db import transaction

        with transaction.atomic():
            for parent, children, parts in items:
                _insert_with_orm(parent, children, fk, parts)
        return
    first_parent, first_children, _ = items[0]
    shape = _shape(first_parent.model, first_children[0].model, fk)
    params = _Params()
    db = connections[DEFAULT_DB_ALIAS]  # the wrapper itself: one lookup per statement
    parent_rows = [
        _parent_row(shape, parent.values, parts, params, db) for parent, _c, parts in items
    ]
    if len(items) == 1:
        # The children need no key: the one parent's id is joined to each.
        child_rows = [_child_row(shape, child.values, params, db) for child in first_children]
        sql = (
            f"WITH p AS (INSERT INTO {shape.parent_table} ({shape.parent_columns}) "
            f"VALUES {parent_rows[0]} RETURNING {shape.pk_column}) "
            f"INSERT INTO {shape.child_table} ({shape.fk_column}, {shape.child_columns}) "
            f"SELECT p.{shape.pk_column}, v.* FROM p, "
            f"(VALUES {', '.join(child_rows)}) "
            f"AS v({shape.child_columns}) RETURNING {shape.fk_column}"
        )
        first_parent.pk = _execute_binary(sql, params)[0][0]
        return
    meta = first_parent.model._meta
    key = meta.get_field(key_field)
    key_at = meta.concrete_fields.index(key)
    key_column = connection.ops.quote_name(key.column)
    key_cast = f"::{key.db_type(connection)}"
    child_rows = []
    for parent, children, _parts in items:
        key_value = parent.values[key_at]
        for child in children:
            child_rows.append(
                _child_row(shape, child.values, params, db, params.add(key_value) + key_cast)
            )
    sql = (
        f"WITH p AS (INSERT INTO {shape.parent_table} ({shape.parent_columns}) "
        f"VALUES {', '.join(parent_rows)} RETURNING {shape.pk_column}, {key_column}), "
        f"c AS (INSERT INTO {shape.child_table} ({shape.fk_column}, {shape.child_columns}) "
        f"SELECT p.{shape.pk_column}, {shape.child_columns_of_v} FROM p JOIN "
        f"(VALUES {', '.join(child_rows)}) AS v(parent_key, {shape.child_columns}) "
        f"ON v.parent_key = p.{key_column}) "
        f"SELECT {key_column}, {shape.pk_column} FROM p"
    )
    ids = dict(_execute_binary(sql, params))
    for parent, _children, _parts in items:
        parent.pk = ids[parent.values[key_at]]


class _BufferDumper(psycopg.adapt.Dumper):
    """Hands a bytes-like parameter to libpq as it is (binary bytea).

    psycopg's own binary dumper first copies the value into a new buffer;
    for a message body that is one whole copy more. libpq still copies it
    once into its output buffer.
    """

    format = psycopg.pq.Format.BINARY
    oid = psycopg.postgres.types["bytea"].oid

    def dump(self, obj: bytes | bytearray | memoryview) -> bytes | bytearray | memoryview:
        return obj


def _insert_with_orm(
    parent: InsertRow,
    children: Sequence[InsertRow],
    fk: str,
    parts: Mapping[str, Sequence[bytes | bytearray]],
) -> None:
    from django.db import transaction

    obj = parent.instance()
    for name, pieces in parts.items():
        setattr(obj, name, b"".join(pieces))
    with transaction.atomic():
        obj.save(force_insert=True)
        rows = [child.instance() for child in children]
        for row in rows:
            setattr(row, fk, obj)
        children[0].model.objects.bulk_create(rows)
    parent.pk = obj.pk


# --- the query helpers of the hand-written hot paths: ``id__any``, postgresql() ----


class AnyOf(Lookup):
    """``filter(id__any=ids)``: ``id = ANY(%s)`` with the ids as one array parameter
    on PostgreSQL (an ``IN (%s, %s, …)`` list of hundreds of ids costs psycopg's
    client-side binding and Django's compiler a placeholder each, and makes
    every batch size a new statement); an ``IN`` list elsewhere."""

    lookup_name = "any"
    prepare_rhs = False

    def as_sql(self, compiler, connection):  # type: ignore[no-untyped-def]
        if connection.vendor != "postgresql":
            return In(self.lhs, list(self.rhs)).as_sql(compiler, connection)
        lhs, params = self.process_lhs(compiler, connection)
        # The base type without its length: an explicit cast to varchar(n)
        # truncates, and a longer value would then match another row.
        cast = self.lhs.output_field.cast_db_type(connection).partition("(")[0]
        return f"{lhs} = ANY(%s::{cast}[])", [*params, list(self.rhs)]


models.Field.register_lookup(AnyOf)
models.ForeignObject.register_lookup(AnyOf)  # its lookups stop at ForeignObject


def postgresql() -> bool:
    """Whether the hot paths may use their hand-written PostgreSQL statements."""
    return connection.vendor == "postgresql"


# --- errors: an outage, or a failure of the work -----------------------------------

# SQLSTATE classes that say the statement or its data is wrong, never that the
# server is away: 22 data exception, 23 integrity constraint violation, 42
# syntax error or access rule violation, 54 program limit exceeded (an index
# row or a statement too large: psycopg files it under OperationalError).
NOT_AN_OUTAGE = frozenset({"22", "23", "42", "54"})


def sqlstate(exc: BaseException) -> str | None:
    """The SQLSTATE of a database error (Django's wraps the driver's), if any."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        state = getattr(current, "sqlstate", None) or getattr(current, "pgcode", None)
        if state:
            return str(state)
        current = current.__cause__  # Django raises its error from the driver's
    return None


def is_outage(exc: BaseException) -> bool:
    """True when ``exc`` means the database is unreachable or went away (a lost
    or refused connection, a server shutting down): worth a new connection and
    another try. A data error (too long a value, an index row over its limit, a
    constraint) is not, whatever class the driver gives it."""
    if isinstance(exc, InterfaceError):
        return True
    if not isinstance(exc, OperationalError):
        return False
    state = sqlstate(exc)
    return state is None or state[:2] not in NOT_AN_OUTAGE


def drop_connection() -> None:
    """Close this thread's database connection after an error: the next query
    opens a fresh one (the server may have restarted, or the connection is in
    an unknown state after a failed COMMIT)."""
    try:
        connection.close()
    except Exception:  # noqa: BLE001 - closing a broken connection may fail too
        log.debug("closing a broken database connection failed", exc_info=True)


# --- the database going away and coming back, as one process sees it (issue #25) ----
#
# While PostgreSQL has no primary (a failover, a restart) every query fails the
# same way, thousands of times a minute on a busy ingress. A traceback each
# time buries the one fact that matters, so:
#
# - ``OUTAGE.failed(exc)`` notes a failure; the first one of an outage logs
#   one ERROR line (when it started, and why); the rest log nothing here
#   (ingress logs one short line per ``451``, without a traceback);
# - ``OUTAGE.recovered()`` after a query worked again logs one line when an
#   outage ends (how long it lasted, how many failures it cost);
# - ``waits_for_database(task)``: a Celery task that finds the database away
#   waits for it (polling, with a backoff) and runs again, instead of failing
#   with a traceback; it gives up quietly after ``TASK_WAIT_SECONDS`` (the work
#   is in the database: the sweep rings for it once it is back).
#
# Nothing here changes a message: a claim held across the outage is kept or
# taken back by the lease rule (above), never marked failed.

P = ParamSpec("P")

# How long a task waits for the database before it leaves the work to the sweep.
TASK_WAIT_SECONDS = 120.0


def is_unavailable(exc: BaseException) -> bool:
    """A database that is away (connection refused, lost, read-only standby), not a bug."""
    return isinstance(exc, (OperationalError, InterfaceError))


def first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"


class Outage:
    """Whether this process's database is away, logged once as it starts and ends."""

    def __init__(self, monotonic: Callable[[], float] = time.monotonic) -> None:
        self._monotonic = monotonic
        self._lock = threading.Lock()
        self.since: float | None = None
        self.failures = 0

    @property
    def active(self) -> bool:
        return self.since is not None

    def failed(self, exc: BaseException) -> None:
        with self._lock:
            self.failures += 1
            if self.since is not None:
                return
            self.since = self._monotonic()
            self.failures = 1
        log.error("database unavailable: %s (logged once until it is back)", first_line(exc))

    def recovered(self) -> None:
        if self.since is None:  # the hot path: one attribute read
            return
        with self._lock:
            if self.since is None:
                return
            lasted, failures = self._monotonic() - self.since, self.failures
            self.since, self.failures = None, 0
        log.warning(
            "database available again after %.1f s (%d operations failed meanwhile)",
            lasted,
            failures,
        )


OUTAGE = Outage()


def wait_for_database(deadline: float, sleep: Callable[[float], None] = time.sleep) -> bool:
    """Poll until a connection opens (to the primary, with a multi-host
    DATABASE_URL), with a backoff of 0.2 s to 2 s; False at ``deadline``."""
    delay = 0.2
    while True:
        try:
            connection.ensure_connection()
            return True
        except (OperationalError, InterfaceError) as exc:
            OUTAGE.failed(exc)
            drop_connection()
        if time.monotonic() + delay > deadline:
            return False
        sleep(delay)
        delay = min(delay * 2, 2.0)


def waits_for_database(
    task: Callable[P, T] | None = None, *, wait: float = TASK_WAIT_SECONDS
) -> Any:
    """Run ``task``; while the database is away, wait for it (up to ``wait``
    seconds) and run it again. ``@waits_for_database`` or ``(wait=0)``: a
    periodic task that only logs one line and leaves it to its next run."""

    def decorate(task: Callable[P, T]) -> Callable[P, T | None]:
        @functools.wraps(task)
        def run(*args: P.args, **kwargs: P.kwargs) -> T | None:
            deadline = time.monotonic() + wait
            while True:
                try:
                    result = task(*args, **kwargs)
                except (OperationalError, InterfaceError) as exc:
                    OUTAGE.failed(exc)
                    drop_connection()
                    if not wait_for_database(deadline):
                        log.warning(
                            "%s: the database is away (%s); its work waits in the database",
                            task.__name__,
                            first_line(exc),
                        )
                        return None
                    continue
                OUTAGE.recovered()
                return result

        return run

    return decorate if task is None else decorate(task)


def retry_outages(work: Callable[[], T], may_retry: Callable[[], bool]) -> T:
    """Run ``work``; when the database connection breaks, reconnect and run it
    again (after 0.2 s, doubling up to 5 s) for as long as ``may_retry()`` says
    (the owner still holds what ``work`` writes). A data error (``is_outage``:
    a value or an index row too large, a constraint) is not an outage: it is
    raised at once, not tried again."""
    delay = 0.2
    while True:
        try:
            result = work()
            OUTAGE.recovered()
            return result
        except (OperationalError, InterfaceError) as exc:
            if not is_outage(exc):
                raise
            drop_connection()
            if not may_retry():
                raise
            OUTAGE.failed(exc)  # logged once per outage
            log.debug("database unavailable (%s); trying again in %.1fs", exc, delay)
            time.sleep(delay)
            delay = min(delay * 2, 5.0)
