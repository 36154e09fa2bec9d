"""Exim's retry data, stored: the queryset of ``RetryHint`` rows (a hint, not a
state: the rules and the arithmetic live in delivery.smtp.retry)."""

from __future__ import annotations

from collections.abc import Iterable

from django.db import models


class RetryHintQuerySet(models.QuerySet):
    """Exim's retry data, stored (the rules and the arithmetic live in delivery.smtp.retry)."""

    FIELDS = ("first_failed", "last_tried", "next_try", "expired", "error", "text")

    def load(self, keys: Iterable[str]) -> dict:
        return {h.key: h for h in self.filter(key__in=list(set(keys)))}

    def save(self, hints: Iterable) -> None:
        """Insert or update one row per key (the last one given wins)."""
        rows = {h.key: h for h in hints}
        if rows:
            self.bulk_create(
                list(rows.values()),
                update_conflicts=True,
                unique_fields=["key"],
                update_fields=list(self.FIELDS),
            )

    def clear(self, keys: Iterable[str]) -> None:
        """A success deletes the data (that resets Exim's retry clock)."""
        keys = list(set(keys))
        if keys:
            self.filter(key__any=keys).delete()
