"""Sender and recipient indexes partial (``<> ''``): DSNs have the null sender,
message-wide rows no recipient, so those rows cost no index entries.

On PostgreSQL the indexes are dropped and made on the partitioned parent
(PostgreSQL does each partition); on SQLite on the plain table. A database
that 0001 made with the current definitions already has them (IF NOT EXISTS).
Webhook outbox: an index of the pending rows by age (failing the expired ones).
"""

from django.db import migrations, models


def forwards(apps, schema_editor) -> None:
    from tracking import partitions

    for name in (*partitions.REPLACED, *partitions.DROPPED):
        schema_editor.execute(f"DROP INDEX IF EXISTS {name}")
    for statement in partitions.create_indexes(schema_editor.connection.vendor):
        schema_editor.execute(statement)


def backwards(apps, schema_editor) -> None:
    from tracking import partitions

    for name in ("tracking_event_sender_nz", "tracking_event_rcpt_nz"):
        schema_editor.execute(f"DROP INDEX IF EXISTS {name}")
    table = partitions.TABLE
    schema_editor.execute(
        f"CREATE INDEX IF NOT EXISTS tracking_event_sender ON {table} (lower(sender), at)"
    )
    schema_editor.execute(
        f"CREATE INDEX IF NOT EXISTS tracking_event_rcpt ON {table} (lower(recipient), at)"
    )
    for name, columns in partitions.DROPPED_DEFINITIONS.items():
        schema_editor.execute(f"CREATE INDEX IF NOT EXISTS {name} ON {table} {columns}")


class Migration(migrations.Migration):
    dependencies = [("tracking", "0001_initial")]

    operations = [
        migrations.RunPython(forwards, backwards),
        migrations.AddIndex(
            model_name="webhookdelivery",
            index=models.Index(
                condition=models.Q(("state", "pending")),
                fields=["created_at"],
                name="tracking_wh_pending_age",
            ),
        ),
    ]
