"""One-statement bulk updates of rows with different values (the delivery hot path).

Django's ``bulk_update`` builds a CASE expression per field and row in
Python, which costs more than the update itself for a few hundred rows. On
PostgreSQL this writes ``UPDATE … FROM (VALUES …)`` instead: one statement,
one round trip, typed parameters. Other databases use ``bulk_update``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import psycopg
import psycopg.adapt
from django.db import connection, models


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


def _values(obj: models.Model, fields: Sequence[models.Field]) -> list[object]:
    return [field.get_db_prep_save(getattr(obj, field.attname), connection) for field in fields]


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
    parts = parts or {}
    if connection.vendor != "postgresql":
        _insert_with_orm(parent, children, fk, parts)
        return
    model, child_model = type(parent), type(children[0])
    quote = connection.ops.quote_name
    meta, child_meta = model._meta, child_model._meta
    parent_fields = [f for f in meta.concrete_fields if not f.primary_key]
    fk_field = child_meta.get_field(fk)
    child_fields = [
        f for f in child_meta.concrete_fields if not f.primary_key and f is not fk_field
    ]
    casts = ", ".join(f"%s::{f.db_type(connection)}" for f in child_fields)
    child_columns = ", ".join(quote(f.column) for f in child_fields)
    placeholders = [
        "(" + " || ".join(["%b"] * len(parts[f.name])) + ")"
        if f.name in parts
        else "%s"  # typed by the column it is inserted into
        for f in parent_fields
    ]
    sql = (
        f"WITH p AS (INSERT INTO {quote(meta.db_table)} "
        f"({', '.join(quote(f.column) for f in parent_fields)}) "
        f"VALUES ({', '.join(placeholders)}) RETURNING {quote(meta.pk.column)}) "
        f"INSERT INTO {quote(child_meta.db_table)} ({quote(fk_field.column)}, {child_columns}) "
        f"SELECT p.{quote(meta.pk.column)}, v.* FROM p, "
        f"(VALUES {', '.join([f'({casts})'] * len(children))}) AS v({child_columns}) "
        f"RETURNING {quote(fk_field.column)}"
    )
    params: list[object] = []
    for f in parent_fields:
        if f.name in parts:
            params.extend(parts[f.name])
        else:
            params.extend(_values(parent, [f]))
    for child in children:
        params += _values(child, child_fields)
    connection.validate_no_broken_transaction()  # as Django's own cursor does
    connection.ensure_connection()
    # A server-side-binding cursor (Django's is a ClientCursor, which would
    # inline the body into the query text as hex: three times its size).
    with connection.wrap_database_errors, psycopg.Cursor(connection.connection) as cursor:
        for kind in (bytes, bytearray, memoryview):
            cursor.adapters.register_dumper(kind, _BufferDumper)
        cursor.execute(sql, params)
        parent.pk = cursor.fetchone()[0]
    parent._state.adding = False
    for name in parts:
        parent.__dict__.pop(meta.get_field(name).attname, None)


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
