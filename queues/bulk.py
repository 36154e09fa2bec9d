"""The one batch writer: many rows, different values, one statement.

Django's ``bulk_update`` builds a CASE expression per field and row in
Python, and ``bulk_create`` prepares every value and sends a placeholder
each, which costs more than the statement itself for a few hundred rows.
On PostgreSQL the batch goes as ONE JSON parameter read by
``jsonb_to_recordset()`` (``jsonb_rows``, ``jsonb_payload``): the JSON
encoder is several times cheaper than psycopg's binding of a VALUES list
(23 placeholders a row) or of one array per column. Used by every batch
write of the hot paths: a round's recipients (``update_json``), its
attempts and tracking rows (``insert_json``), the webhook outbox.
``bulk_update_rows`` writes ``UPDATE … FROM (VALUES …)``; other databases
use ``bulk_update``. ``insert_with_children`` is the ingress's insert.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime
from functools import cache

import psycopg
import psycopg.adapt
from django.db import DEFAULT_DB_ALIAS, connection, connections, models
from django.db.backends.base.base import BaseDatabaseWrapper


def _json_value(value: object) -> str:
    return value.isoformat() if isinstance(value, datetime) else str(value)


def jsonb_payload(rows: Iterable[Mapping[str, object]]) -> str:
    """The batch as the one JSON parameter of ``jsonb_rows`` (times as ISO text)."""
    return json.dumps(list(rows), default=_json_value)


def jsonb_rows(alias: str, columns: Sequence[tuple[str, str]], placeholder: str = "%s") -> str:
    """``jsonb_to_recordset(%s::jsonb) AS alias(column type, …)``: the batch as a
    table in a statement; its parameter is ``jsonb_payload(rows)``."""
    typed = ", ".join(f"{name} {kind}" for name, kind in columns)
    return f"jsonb_to_recordset({placeholder}::jsonb) AS {alias}({typed})"


def json_column_type(field: models.Field) -> str:
    """The column type of a model field in a ``jsonb_rows`` column list."""
    if field.is_relation:
        return "bigint"
    return field.cast_db_type(connection) or "text"


def field_columns(model: type[models.Model], names: Sequence[str]) -> list[tuple[str, str]]:
    """(column, type) of ``names``, fields of ``model``, for ``jsonb_rows``."""
    meta = model._meta
    return [(f.column, json_column_type(f)) for f in (meta.get_field(n) for n in names)]


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
    """``INSERT INTO table (columns) SELECT columns FROM jsonb_rows`` (PostgreSQL),
    in the caller's transaction; ``rows`` map each column to its value."""
    names = ", ".join(name for name, _ in columns)
    sql = f"INSERT INTO {table} ({names}) SELECT {names} FROM {jsonb_rows('x', columns)}"
    with connection.cursor() as cur:
        cur.execute(sql, [jsonb_payload(rows)])


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
    """``UPDATE table AS t SET column = v.column, … FROM jsonb_rows WHERE t.id =
    v.id [AND where] RETURNING t.id`` (PostgreSQL): each row (with its ``id``)
    written in one statement, ``where`` (on ``t``, with ``params``) fencing
    which; returns the ids written."""
    assignments = ", ".join(f"{name} = v.{name}" for name, _ in columns)
    recordset = jsonb_rows("v", [("id", "bigint"), *columns])
    sql = (
        f"UPDATE {table} AS t SET {assignments} FROM {recordset} WHERE t.id = v.id"
        + (f" AND {where}" if where else "")
        + " RETURNING t.id"
    )
    with connection.cursor() as cur:
        cur.execute(sql, [jsonb_payload(rows), *params])
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


def _db_value(
    field: models.Field, as_is: frozenset[type], value: object, db: BaseDatabaseWrapper
) -> object:
    """``field.get_db_prep_save(value, db)``: the value itself when that is what it returns."""
    kind = type(value)
    if kind in as_is and (kind is not datetime or value.utcoffset() is not None):  # type: ignore[attr-defined]
        return value
    return field.get_db_prep_save(value, db)


@dataclass(frozen=True)
class _InsertShape:
    """The fields and SQL pieces of a parent-with-children insert, built once per model pair."""

    parent_fields: tuple[models.Field, ...]
    parent_text_fields: frozenset[str]  # sent as text (GenericIPAddressField)
    parent_as_is: tuple[frozenset[type], ...]  # of each parent field: _as_is_types
    child_fields: tuple[models.Field, ...]
    child_as_is: tuple[frozenset[type], ...]
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
        shape = _SHAPES[key] = _InsertShape(
            parent_fields=parent_fields,
            parent_text_fields=frozenset(
                f.name for f in parent_fields if isinstance(f, models.GenericIPAddressField)
            ),
            parent_as_is=_as_is_types(parent_fields, connection.vendor),
            child_fields=child_fields,
            child_as_is=_as_is_types(child_fields, connection.vendor),
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

    def row(self, values: Sequence[object], casts: Sequence[str]) -> str:
        start = len(self.values)
        self.values.extend(values)
        return "(" + ", ".join(f"${start + i}{cast}" for i, cast in enumerate(casts, 1)) + ")"


def _parent_row(
    shape: _InsertShape,
    parent: models.Model,
    parts: Mapping[str, Sequence[bytes | bytearray]],
    params: _Params,
    db: BaseDatabaseWrapper,
) -> str:
    """One parent's VALUES row (its values added to ``params``).

    ``db`` is the connection itself, not Django's ``connection`` proxy: the
    fields' value preparation reads it a few times per value, and each read
    through the proxy is a thread-local lookup (measured: 30 of the 205 us of
    CPU that storing a message took in a batch of five).
    """
    placeholders = []
    for f, as_is in zip(shape.parent_fields, shape.parent_as_is, strict=True):
        pieces = parts.get(f.name)
        if pieces is not None:
            placeholders.append("(" + " || ".join(params.add(p) for p in pieces) + ")")
        elif f.name in shape.parent_text_fields:
            # An address as the text it is: PostgreSQL reads it into the inet
            # column (Django would parse it into an ipaddress object first, a
            # tenth of the ingress's CPU per message).
            placeholders.append(params.add(getattr(parent, f.attname) or None))
        else:
            # typed by the column it is inserted into
            placeholders.append(params.add(_db_value(f, as_is, getattr(parent, f.attname), db)))
    return "(" + ", ".join(placeholders) + ")"


def _child_row(
    shape: _InsertShape,
    child: models.Model,
    params: _Params,
    db: BaseDatabaseWrapper,
    key: str = "",
) -> str:
    values = [
        _db_value(f, as_is, getattr(child, f.attname), db)
        for f, as_is in zip(shape.child_fields, shape.child_as_is, strict=True)
    ]
    row = params.row(values, shape.child_casts)
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


def _mark_saved(
    parent: models.Model, pk: object, parts: Mapping[str, Sequence[bytes | bytearray]]
) -> None:
    parent.pk = pk
    parent._state.adding = False
    meta = parent._meta
    for name in parts:
        parent.__dict__.pop(meta.get_field(name).attname, None)


def insert_with_children(
    parent: models.Model,
    children: Sequence[models.Model],
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
    Those fields are left deferred on ``parent`` (read from the database if
    asked for).
    """
    insert_many_with_children([(parent, children, parts or {})], fk, key_field="")


def insert_many_with_children(
    items: Sequence[
        tuple[models.Model, Sequence[models.Model], Mapping[str, Sequence[bytes | bytearray]]]
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
    shape = _shape(type(first_parent), type(first_children[0]), fk)
    params = _Params()
    db = connections[DEFAULT_DB_ALIAS]  # the wrapper itself: one lookup per statement
    parent_rows = [_parent_row(shape, parent, parts, params, db) for parent, _c, parts in items]
    if len(items) == 1:
        # The children need no key: the one parent's id is joined to each.
        child_rows = [_child_row(shape, child, params, db) for child in first_children]
        sql = (
            f"WITH p AS (INSERT INTO {shape.parent_table} ({shape.parent_columns}) "
            f"VALUES {parent_rows[0]} RETURNING {shape.pk_column}) "
            f"INSERT INTO {shape.child_table} ({shape.fk_column}, {shape.child_columns}) "
            f"SELECT p.{shape.pk_column}, v.* FROM p, "
            f"(VALUES {', '.join(child_rows)}) "
            f"AS v({shape.child_columns}) RETURNING {shape.fk_column}"
        )
        rows = _execute_binary(sql, params)
        _mark_saved(first_parent, rows[0][0], items[0][2])
        return
    key = type(first_parent)._meta.get_field(key_field)
    key_column = connection.ops.quote_name(key.column)
    key_cast = f"::{key.db_type(connection)}"
    child_rows = []
    for parent, children, _parts in items:
        key_value = getattr(parent, key.attname)
        for child in children:
            child_rows.append(
                _child_row(shape, child, params, db, params.add(key_value) + key_cast)
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
    for parent, _children, parts in items:
        _mark_saved(parent, ids[getattr(parent, key.attname)], parts)


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
    parent: models.Model,
    children: Sequence[models.Model],
    fk: str,
    parts: Mapping[str, Sequence[bytes | bytearray]],
) -> None:
    from django.db import transaction

    for name, pieces in parts.items():
        setattr(parent, name, b"".join(pieces))
    with transaction.atomic():
        parent.save(force_insert=True)
        for child in children:
            setattr(child, fk, parent)
        type(children[0]).objects.bulk_create(children)
