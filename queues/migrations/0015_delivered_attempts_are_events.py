"""A delivery is its own tracking event (issue #24: "a delivered message's
history is one attempt, not several rows in several tables").

A delivered attempt carries the event's stable id (``event_id``: its webhook's
and event-log line's id too) the next hop's queue id (``remote_id``) and the link it went out on (``link``);
``tracking.history`` reads the deliveries of messages still in the store from
these rows, and the sweep's purge moves them into ``tracking_event`` when it
deletes their message. Two partial indexes serve the tracking search on them:
newest first, and by remote queue id. Attempts written before this migration
keep ``event_id`` NULL: their tracking rows were written beside them.

The round's record of its deliveries (``queues_record_delivered``, migration
0014) writes the three columns; its pinned settings are unchanged.
"""

import importlib

import django.db.models.deletion
from django.db import migrations, models

PINNED = importlib.import_module("queues.migrations.0014_pinned_plans")
SIGNATURE = "queues_record_delivered(json, bigint[], text, timestamptz, varchar[])"


def _previous() -> str:
    return PINNED.original(SIGNATURE)


def _current() -> str:
    """0014's function, writing ``event_id``, ``remote_id`` and ``link_id`` too."""
    return PINNED.edited(
        SIGNATURE,
        [
            (
                "auth_used varchar(20), last_host text)",
                "auth_used varchar(20), last_host text, event_id uuid, remote_id varchar(100),\n"
                "    link_id bigint)",
            ),
            (
                "tls_policy, auth_used, queue_id)",
                "tls_policy, auth_used, queue_id, event_id, remote_id, link_id)",
            ),
            (
                "v.tls_verified, v.tls_policy, v.auth_used, t.queue_id",
                "v.tls_verified, v.tls_policy, v.auth_used, t.queue_id, v.event_id,\n"
                "        coalesce(v.remote_id, ''), v.link_id",
            ),
        ],
    )


def create(apps, schema_editor) -> None:
    if schema_editor.connection.vendor == "postgresql":
        schema_editor.execute(_current())


def restore(apps, schema_editor) -> None:
    if schema_editor.connection.vendor == "postgresql":
        schema_editor.execute(_previous())


class Migration(migrations.Migration):
    dependencies = [
        ("queues", "0014_pinned_plans"),
    ]

    operations = [
        migrations.AddField(
            model_name="attempt",
            name="event_id",
            field=models.UUIDField(blank=True, null=True),
        ),
        migrations.AddField(
            model_name="attempt",
            name="remote_id",
            field=models.CharField(blank=True, max_length=100),
        ),
        migrations.AddField(
            model_name="attempt",
            name="link",
            field=models.ForeignKey(
                blank=True,
                db_constraint=False,
                db_index=False,
                null=True,
                on_delete=django.db.models.deletion.DO_NOTHING,
                related_name="+",
                to="queues.link",
            ),
        ),
        migrations.AddIndex(
            model_name="attempt",
            index=models.Index(
                condition=models.Q(("outcome", "delivered")),
                fields=["-started_at", "id"],
                name="attempt_delivered",
            ),
        ),
        migrations.AddIndex(
            model_name="attempt",
            index=models.Index(
                condition=models.Q(
                    ("outcome", "delivered"), models.Q(("remote_id", ""), _negated=True)
                ),
                fields=["remote_id"],
                name="attempt_remote_id",
            ),
        ),
        migrations.RunPython(create, restore),
    ]
