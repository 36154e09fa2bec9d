"""The store's query helpers for PostgreSQL's hand-written hot paths: the
``any`` lookup (``filter(id__any=ids)``) and whether they may be used."""

from __future__ import annotations

from django.db import connection, models
from django.db.models import Lookup
from django.db.models.lookups import In


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
