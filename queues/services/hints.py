"""Storage of Exim-style retry hints (the rules and the arithmetic live in delivery)."""

from __future__ import annotations

from collections.abc import Iterable

from queues.models import RetryHint

HINT_FIELDS = ["first_failed", "last_tried", "next_try", "expired", "error", "text"]


def hints_load(keys: Iterable[str]) -> dict[str, RetryHint]:
    return {h.key: h for h in RetryHint.objects.filter(key__in=list(set(keys)))}


def hints_save(hints: Iterable[RetryHint]) -> None:
    rows = {h.key: h for h in hints}  # one row per key
    if rows:
        RetryHint.objects.bulk_create(
            list(rows.values()),
            update_conflicts=True,
            unique_fields=["key"],
            update_fields=HINT_FIELDS,
        )


def hints_clear(keys: Iterable[str]) -> None:
    keys = list(set(keys))
    if keys:
        RetryHint.objects.filter(key__in=keys).delete()
