"""The tracking history as its readers see it (tracking.search): the rows of
``tracking_event`` and the arrivals, routings and deliveries of messages
still in the store, which are their messages, recipients and attempts
(tracking.history). Tests read a
message's life through it."""

from __future__ import annotations

from typing import Any

from tracking.history import (
    ARRIVAL_VALUES,
    ROUTING_VALUES,
    VALUES,
    arrivals,
    as_arrival,
    as_event,
    as_routing,
    deliveries,
    routings,
)
from tracking.models import TrackingEvent


def _matches(row: TrackingEvent, filters: dict[str, Any]) -> bool:
    for key, wanted in filters.items():
        name, _, op = key.partition("__")
        value = getattr(row, name)
        if op == "in":
            if value not in wanted:
                return False
        elif op:
            raise ValueError(f"history(): no lookup {op!r}")
        elif value != wanted:
            return False
    return True


def history(**filters: Any) -> list[TrackingEvent]:
    """The events matching ``filters`` (``field=value``, ``field__in=values``),
    oldest first, by (at, id) as the search orders them."""
    stored = list(TrackingEvent.objects.filter(**filters))
    live = (
        [as_arrival(v) for v in arrivals().values(*ARRIVAL_VALUES)]
        + [as_routing(v) for v in routings().values(*ROUTING_VALUES)]
        + [as_event(v) for v in deliveries().values(*VALUES)]
    )
    rows = stored + [row for row in live if _matches(row, filters)]
    return sorted(rows, key=lambda r: (r.at, r.id))
