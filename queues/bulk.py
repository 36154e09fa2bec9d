"""One-statement bulk updates of rows with different values (the delivery hot path).

Django's ``bulk_update`` builds a CASE expression per field and row in
Python, which costs more than the update itself for a few hundred rows. On
PostgreSQL this writes ``UPDATE … FROM (VALUES …)`` instead: one statement,
one round trip, typed parameters. Other databases use ``bulk_update``.
"""

from __future__ import annotations

from collections.abc import Sequence

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
