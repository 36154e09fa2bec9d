"""Keyset (cursor) pagination for every list of the operator surface.

A page is one indexed query ordered by a key and the id (``Sort``), never
an OFFSET: the cursor carries the last key and id seen, so page 10,000 of a
million rows costs what page 1 costs. ``FilterError`` is the one error a
bad filter, sort, limit or cursor raises (the API's 400).
"""

from __future__ import annotations

import base64
import json
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Generic, TypeVar

from django.db import models
from django.db.models import Model, Q, QuerySet

T = TypeVar("T", bound=Model)

DEFAULT_LIMIT = 50
MAX_LIMIT = 500


class FilterError(ValueError):
    """A filter, sort or cursor parameter that cannot be understood (HTTP 400)."""


class FilterForbidden(FilterError):
    """A filter on what the caller's role may not see (a viewer and Message-IDs): 403."""


# The largest value a bigint column (ids, sizes) holds: past it PostgreSQL errs.
MAX_BIGINT = 2**63 - 1


@dataclass
class Sort:
    field: str  # model field of the key; the id breaks ties
    descending: bool

    @classmethod
    def parse(cls, value: str | None, sorts: Mapping[str, str], default: str) -> Sort:
        value = (value or default).strip()
        descending = value.startswith("-")
        name = value.lstrip("-")
        if name not in sorts:
            raise FilterError(
                f"sort: {value!r} is not one of {', '.join(sorts)} (- for descending)"
            )
        return cls(sorts[name], descending)


@dataclass
class Page(Generic[T]):
    items: list[T]
    next_cursor: str | None
    previous_cursor: str | None


def _encode_cursor(value: Any, pk: int, forward: bool) -> str:
    if isinstance(value, datetime):
        value = value.isoformat()
    raw = json.dumps([value, pk, "n" if forward else "p"], separators=(",", ":"))
    return base64.urlsafe_b64encode(raw.encode()).decode().rstrip("=")


def _decode_cursor(cursor: str, model_field: models.Field) -> tuple[Any, int, bool]:
    try:
        raw = base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4))
        value, pk, direction = json.loads(raw)
        if not isinstance(pk, int) or direction not in ("n", "p") or not 0 <= pk <= MAX_BIGINT:
            raise ValueError
        value = model_field.to_python(value)
        if value is None or (isinstance(value, int) and abs(value) > MAX_BIGINT):
            raise ValueError
    except Exception:  # noqa: BLE001 - whatever is wrong with it, it is not ours
        raise FilterError("cursor: not a cursor this list handed out") from None
    return value, pk, direction == "n"


def parse_limit(value: Any, default: int = DEFAULT_LIMIT, maximum: int = MAX_LIMIT) -> int:
    if value in (None, ""):
        return default
    try:
        limit = int(value)
    except (TypeError, ValueError):
        raise FilterError(f"limit: {value!r} is not a number") from None
    if not 1 <= limit <= maximum:
        raise FilterError(f"limit: must be between 1 and {maximum}")
    return limit


def keyset_page(
    qs: QuerySet[T], sort: Sort, cursor: str | None = None, limit: int = DEFAULT_LIMIT
) -> Page[T]:
    """One page of ``qs`` ordered by (sort key, id), after or before a cursor.

    Steps:
    1. decode the cursor: the (key, id) of the row it points at and the way to go;
    2. keep the rows strictly past it: ``key < v OR (key = v AND id < i)`` (for a
       descending sort), with ``key <= v`` added so the index scan starts at v;
    3. order by (key, id) that way, read one row more than ``limit`` to know
       whether there is a further page;
    4. going backwards the rows come reversed: put them back in display order.
    """
    model_field = qs.model._meta.get_field(sort.field)
    key = sort.field
    forward = True
    if cursor:
        value, pk, forward = _decode_cursor(cursor, model_field)
        # Going backwards is going forwards in the opposite order.
        down = sort.descending == forward
        if down:
            qs = qs.filter(**{f"{key}__lte": value}).filter(
                Q(**{f"{key}__lt": value}) | Q(**{key: value, "id__lt": pk})
            )
        else:
            qs = qs.filter(**{f"{key}__gte": value}).filter(
                Q(**{f"{key}__gt": value}) | Q(**{key: value, "id__gt": pk})
            )
    else:
        down = sort.descending
    if key == "id":
        order = ["-id"] if down else ["id"]
    else:
        order = [f"-{key}", "-id"] if down else [key, "id"]
    rows = list(qs.order_by(*order)[: limit + 1])
    more = len(rows) > limit
    rows = rows[:limit]
    if not forward:
        rows.reverse()
    if not rows:
        return Page([], None, None)
    first, last = rows[0], rows[-1]
    has_next = more if forward else bool(cursor)
    has_previous = bool(cursor) if forward else more
    return Page(
        rows,
        _encode_cursor(getattr(last, key), last.pk, True) if has_next else None,
        _encode_cursor(getattr(first, key), first.pk, False) if has_previous else None,
    )
