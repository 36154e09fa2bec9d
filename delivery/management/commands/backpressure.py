"""`python manage.py backpressure`: every ingress node's back-pressure resources.

backpressure          a table per node
backpressure --json   one JSON object per node and line (as the API)
"""

from __future__ import annotations

import json
from typing import Any

from django.core.management.base import BaseCommand, CommandParser

from delivery.backpressure import store
from delivery.backpressure.config import BackPressureConfig
from delivery.backpressure.engine import Resource
from delivery.models import ResourcePressure
from queues.lib import clock

HISTORY_SHOWN = 20  # the newest levels of the history, one letter each


def _number(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value:.0f}" if float(value).is_integer() else f"{value:.1f}"


def _reading(row: ResourcePressure) -> str:
    if row.reading is None:
        return "not monitored"
    unit = Resource(row.resource).unit
    return f"{_number(row.reading)} %" if unit == "%" else f"{_number(row.reading)}"


def _history(row: ResourcePressure) -> str:
    recent = row.history[-HISTORY_SHOWN:]
    if row.history_depth:
        return f"{row.pressure_intervals}/{row.history_depth} {recent}"
    return recent


def _action(row: ResourcePressure) -> str:
    if row.action == "tarpit":
        return f"tarpit {_number(row.delay_seconds)}s"
    return row.action or "-"


class Command(BaseCommand):
    help = "Show every ingress node's back-pressure resources (reading, level, thresholds)."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--json", action="store_true", help="one JSON object per node")

    def handle(self, *args: Any, **options: Any) -> None:
        now = clock.now()
        nodes = store.pressure_nodes(BackPressureConfig.from_settings().interval, now)
        if options["json"]:
            for node in nodes:
                self.stdout.write(json.dumps(store.node_dict(node), default=str))
            return
        if not nodes:
            self.stdout.write("no ingress node reports back pressure (is runsmtp running?)")
            return
        header = ("RESOURCE", "READING", "LEVEL", "NORMAL", "MEDIUM", "HIGH", "HISTORY", "ACTION")
        for index, node in enumerate(nodes):
            if index:
                self.stdout.write("")
            age = (now - node.updated_at).total_seconds()
            stale = "  STALE" if node.stale else ""
            self.stdout.write(f"node {node.node} (updated {age:.0f}s ago){stale}")
            rows = [header] + [
                (
                    Resource(row.resource).label,
                    _reading(row),
                    row.level.replace("_", " "),
                    _number(row.normal),
                    _number(row.medium),
                    _number(row.high),
                    _history(row),
                    _action(row),
                )
                for row in node.rows
            ]
            widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
            for r in rows:
                self.stdout.write(
                    "  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip()
                )
            notes = [(row.resource, row.note) for row in node.rows if row.note]
            for resource, note in notes:
                self.stdout.write(f"  {Resource(resource).label}: {note}")
