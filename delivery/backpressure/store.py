"""Back pressure in the database: every node's readings, level-change events,
and the one read used by the API and the ``backpressure`` command."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from django.db import transaction

from delivery.backpressure.engine import (
    LETTERS,
    NOT_MONITORED,
    Resource,
    ResourceStatus,
    Snapshot,
    Transition,
)
from delivery.models import ResourcePressure
from queues.lib import clock
from queues.models import Event, EventLevel

EVENT_KIND = "backpressure"
# Exchange's event ids (MSExchangeTransport, category Resource Manager).
EVENT_RAISED = 15004
EVENT_LOWERED = 15005
STALE_AFTER = timedelta(seconds=10)  # at least; see pressure_nodes
PRUNE_AFTER = timedelta(days=1)  # rows of a node silent this long are removed

_UPDATE_FIELDS = [
    "reading",
    "level",
    "normal",
    "medium",
    "high",
    "history_depth",
    "pressure_intervals",
    "history",
    "action",
    "delay_seconds",
    "note",
    "updated_at",
]


def _number(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value:,.0f}" if float(value).is_integer() else f"{value:,.2f}"


def _reading_text(resource: Resource, value: float | None) -> str:
    if value is None:
        return "not monitored"
    unit = resource.unit
    return f"{_number(value)} %" if unit == "%" else f"{_number(value)} {unit}"


def transition_event(node: str, transition: Transition, now: datetime) -> Event:
    """Exchange's 15004 (up, error) / 15005 (down, information); "not monitored"
    is a warning either way."""
    resource = transition.resource
    old = transition.old.replace("_", " ")
    new = transition.new.replace("_", " ")
    if NOT_MONITORED in (transition.old, transition.new):
        level, event_id = EventLevel.WARNING, None
        text = f"Back pressure: {resource.label} is {new} (was {old}) on {node}"
        if transition.note:
            text += f": {transition.note}"
    elif transition.rising:
        level, event_id = EventLevel.ERROR, EVENT_RAISED
        text = (
            f"Back pressure: {resource.label} rose from {old} to {new} on {node} "
            f"(reading {_reading_text(resource, transition.reading)})"
        )
    else:
        level, event_id = EventLevel.INFO, EVENT_LOWERED
        text = (
            f"Back pressure: {resource.label} fell from {old} to {new} on {node} "
            f"(reading {_reading_text(resource, transition.reading)})"
        )
    t = transition.thresholds
    data: dict[str, Any] = {
        "node": node,
        "resource": resource.value,
        "old": transition.old,
        "new": transition.new,
        "reading": transition.reading,
        "thresholds": (
            {"normal": t.normal, "medium": t.medium, "high": t.high} if t is not None else None
        ),
    }
    if event_id is not None:
        data["event_id"] = event_id
    return Event(created_at=now, level=level, kind=EVENT_KIND, text=text, data=data)


def pressure_save(node: str, snapshot: Snapshot, transitions: Sequence[Transition] = ()) -> None:
    """Upsert this node's rows (one statement) and record its level changes."""
    now = clock.now()
    rows = [_row(node, status, now) for status in snapshot.statuses.values()]
    with transaction.atomic():
        ResourcePressure.objects.bulk_create(
            rows,
            update_conflicts=True,
            unique_fields=["node", "resource"],
            update_fields=_UPDATE_FIELDS,
        )
        if transitions:
            Event.objects.bulk_create([transition_event(node, t, now) for t in transitions])


def _row(node: str, status: ResourceStatus, now: datetime) -> ResourcePressure:
    t = status.thresholds
    return ResourcePressure(
        node=node,
        resource=status.resource.value,
        reading=status.reading,
        level=status.level_name,
        normal=t.normal if t else None,
        medium=t.medium if t else None,
        high=t.high if t else None,
        history_depth=status.history_depth,
        pressure_intervals=status.pressure_intervals,
        history=status.history,
        action=status.action.value,
        delay_seconds=status.delay,
        note=status.note[:500],
        updated_at=now,
    )


def pressure_forget(node: str) -> None:
    """A node that stops removes its rows."""
    ResourcePressure.objects.filter(node=node).delete()


def pressure_prune(now: datetime | None = None) -> int:
    """Remove the rows of nodes silent for a day (they died without saying so)."""
    cutoff = (now or clock.now()) - PRUNE_AFTER
    deleted, _ = ResourcePressure.objects.filter(updated_at__lt=cutoff).delete()
    return deleted


def pressure_event(node: str, text: str, data: dict[str, Any], level: str) -> None:
    Event.objects.create(
        created_at=clock.now(),
        level=level,
        kind=EVENT_KIND,
        text=text,
        data={"node": node, **data},
    )


# ----------------------------------------------------------------- reading


@dataclass(frozen=True)
class NodePressure:
    node: str
    updated_at: datetime
    stale: bool
    rows: list[ResourcePressure]


_ORDER = {r.value: i for i, r in enumerate(Resource)}


def pressure_nodes(interval: float = 2.0, now: datetime | None = None) -> list[NodePressure]:
    """Every node's resources, in Exchange's order; a node whose last interval is
    older than three intervals (at least 10 s) is stale."""
    now = now or clock.now()
    stale_after = max(STALE_AFTER, timedelta(seconds=3 * interval))
    by_node: dict[str, list[ResourcePressure]] = {}
    for row in ResourcePressure.objects.order_by("node"):
        by_node.setdefault(row.node, []).append(row)
    nodes = []
    for node, rows in by_node.items():
        rows.sort(key=lambda r: _ORDER.get(r.resource, len(_ORDER)))
        updated = max(r.updated_at for r in rows)
        nodes.append(NodePressure(node, updated, now - updated > stale_after, rows))
    return nodes


def history_levels(history: str) -> list[str]:
    return [LETTERS.get(letter, NOT_MONITORED) for letter in history]


def row_dict(row: ResourcePressure) -> dict[str, Any]:
    resource = Resource(row.resource)
    return {
        "resource": resource.value,
        "name": resource.label,
        "exchange_name": resource.exchange_name,
        "reading": row.reading,
        "unit": resource.unit,
        "level": row.level,
        "thresholds": (
            {"normal": row.normal, "medium": row.medium, "high": row.high}
            if row.high is not None
            else None
        ),
        "history_depth": row.history_depth,
        "pressure_intervals": row.pressure_intervals,
        "history": history_levels(row.history),
        "action": row.action,
        "delay_seconds": row.delay_seconds,
        "note": row.note,
        "updated_at": row.updated_at,
    }


def node_dict(node: NodePressure) -> dict[str, Any]:
    return {
        "node": node.node,
        "updated_at": node.updated_at,
        "stale": node.stale,
        "resources": [row_dict(row) for row in node.rows],
    }
