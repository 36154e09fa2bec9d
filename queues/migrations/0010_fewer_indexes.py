"""Two indexes that every message paid for and no query used (issue #24):

- ``queues_attempt.message_id``'s own index: ``attempt_by_message``
  (message_id, started_at) leads with the same column and serves the same
  lookups (a message's history, the cascade on delete);
- the ``varchar_pattern_ops`` copy of ``queues_message.qid`` that Django adds
  beside a unique CharField's index for ``LIKE 'x%'``: the queue id is only
  ever looked up exactly (the unique index serves that). Every insert and
  every one of a message's state changes wrote to it.
"""

import django.db.models.deletion
from django.db import migrations, models


def drop_qid_pattern_index(apps, schema_editor):
    if schema_editor.connection.vendor == "postgresql":
        schema_editor.execute("DROP INDEX IF EXISTS queues_message_qid_507973e0_like")


def create_qid_pattern_index(apps, schema_editor):
    if schema_editor.connection.vendor == "postgresql":
        schema_editor.execute(
            "CREATE INDEX IF NOT EXISTS queues_message_qid_507973e0_like "
            "ON queues_message (qid varchar_pattern_ops)"
        )


class Migration(migrations.Migration):
    dependencies = [
        ("queues", "0009_reroute_from"),
    ]

    operations = [
        migrations.AlterField(
            model_name="attempt",
            name="message",
            field=models.ForeignKey(
                db_index=False,
                on_delete=django.db.models.deletion.CASCADE,
                related_name="attempts",
                to="queues.message",
            ),
        ),
        migrations.RunPython(drop_qid_pattern_index, create_qid_pattern_index),
    ]
