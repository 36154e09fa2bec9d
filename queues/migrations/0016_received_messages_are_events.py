"""A message's arrival is its own tracking event (issue #24: "tracking rows
that can be derived are not written twice").

A message carries the stable id of its ``received`` event (``event_id``: its
webhook's and event-log line's id too); ``tracking.history`` reads the
arrivals of messages still in the store from their rows (the facts the
``received`` row repeated: time, client, account, size, source), and the
sweep's purge moves them into ``tracking_event`` when it deletes them.
Messages stored before this migration keep ``event_id`` NULL: their
``received`` rows are in ``tracking_event`` (or are written there at their
first categorization).

The column is added without a default (every existing row NULL), then given
its Python default: a new message's id is made where its row is. The
categorizer's pinned read of the recipients it routes (``queues_to_route``,
migration 0014) returns it too: ``tracking.record.placed`` gives the
``received`` webhook and event-log line that id.
"""

import importlib
import uuid

from django.db import migrations, models

PINNED = importlib.import_module("queues.migrations.0014_pinned_plans")
SIGNATURE = "queues_to_route(bigint[])"


def _previous() -> str:
    return PINNED.original(SIGNATURE)


def _current() -> str:
    """0014's function, returning the message's ``event_id`` last."""
    return PINNED.edited(
        SIGNATURE,
        [
            (
                "o_next_attempt_at timestamptz, o_source varchar)",
                "o_next_attempt_at timestamptz, o_source varchar, o_event_id uuid)",
            ),
            (
                "m.received_at, m.next_attempt_at, m.source\n",
                "m.received_at, m.next_attempt_at, m.source,\n    m.event_id\n",
            ),
        ],
    )


def _replace(sql: str):
    def run(apps, schema_editor) -> None:
        if schema_editor.connection.vendor == "postgresql":
            # Its result type changes: CREATE OR REPLACE cannot do that alone.
            schema_editor.execute(f"DROP FUNCTION IF EXISTS {SIGNATURE}")
            schema_editor.execute(sql)

    return run


class Migration(migrations.Migration):
    dependencies = [
        ("queues", "0015_delivered_attempts_are_events"),
    ]

    operations = [
        migrations.AddField(
            model_name="message",
            name="event_id",
            field=models.UUIDField(blank=True, null=True),
        ),
        migrations.AlterField(
            model_name="message",
            name="event_id",
            field=models.UUIDField(blank=True, default=uuid.uuid4, null=True),
        ),
        migrations.RunPython(_replace(_current()), _replace(_previous())),
    ]
