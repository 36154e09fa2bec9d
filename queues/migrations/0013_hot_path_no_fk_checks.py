"""No foreign-key constraints in the database on the references the hot path
writes: a recipient's message and queue, an attempt's recipient, message and
queue (issue #24).

Each constraint made PostgreSQL check the row referred to at every COMMIT that
wrote one: a lookup and a row lock on the message (the accept, the round's
record), the recipient (the record) and the queue (the categorizer's placement,
the record) — a WAL record each, and a MultiXact when two transactions locked
the same queue row, which every placement and record of a queue does. The
store's transitions write these references, and rows are only deleted through
the ORM (a finished message's purge), which cascades and protects as before
(``on_delete``); the indexes stay.
"""

import django.db.models.deletion
from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [
        ("queues", "0012_message_text"),
    ]

    operations = [
        migrations.AlterField(
            model_name="attempt",
            name="message",
            field=models.ForeignKey(
                db_constraint=False,
                db_index=False,
                on_delete=django.db.models.deletion.CASCADE,
                related_name="attempts",
                to="queues.message",
            ),
        ),
        migrations.AlterField(
            model_name="attempt",
            name="queue",
            field=models.ForeignKey(
                db_constraint=False,
                null=True,
                on_delete=django.db.models.deletion.SET_NULL,
                related_name="+",
                to="queues.queue",
            ),
        ),
        migrations.AlterField(
            model_name="attempt",
            name="recipient",
            field=models.ForeignKey(
                db_constraint=False,
                on_delete=django.db.models.deletion.CASCADE,
                related_name="attempts",
                to="queues.recipient",
            ),
        ),
        migrations.AlterField(
            model_name="recipient",
            name="message",
            field=models.ForeignKey(
                db_constraint=False,
                on_delete=django.db.models.deletion.CASCADE,
                related_name="recipients",
                to="queues.message",
            ),
        ),
        migrations.AlterField(
            model_name="recipient",
            name="queue",
            field=models.ForeignKey(
                blank=True,
                db_constraint=False,
                null=True,
                on_delete=django.db.models.deletion.PROTECT,
                related_name="recipients",
                to="queues.queue",
            ),
        ),
    ]
