"""A recipient's routing is its own tracking event (issue #24: "tracking rows
that can be derived are not written twice").

The categorizer writes on the recipient when it placed it, in which queue and
by which link (``routed_at``, ``routed_queue``, ``routed_link``: the facts the
``routed`` row of ``tracking_event`` repeated); ``tracking.history`` reads the
routings of recipients still in the store from their rows (newest first by
``recipient_routed``), a routing replaced by a new one (the message
categorized again) is moved into ``tracking_event`` first, and the sweep's
purge moves the last one when it deletes the message. Recipients routed
before this migration keep the columns NULL: their ``routed`` rows are in
``tracking_event``. The partial index is empty when created (no row has a
routing yet): building it reads the table once and writes nothing.
"""

import django.db.models.deletion
from django.db import migrations, models


class Migration(migrations.Migration):

    dependencies = [
        ('queues', '0016_received_messages_are_events'),
    ]

    operations = [
        migrations.AddField(
            model_name='recipient',
            name='routed_at',
            field=models.DateTimeField(blank=True, null=True),
        ),
        migrations.AddField(
            model_name='recipient',
            name='routed_link',
            field=models.ForeignKey(blank=True, db_constraint=False, db_index=False, null=True, on_delete=django.db.models.deletion.DO_NOTHING, related_name='+', to='queues.link'),
        ),
        migrations.AddField(
            model_name='recipient',
            name='routed_queue',
            field=models.ForeignKey(blank=True, db_constraint=False, db_index=False, null=True, on_delete=django.db.models.deletion.DO_NOTHING, related_name='+', to='queues.queue'),
        ),
        migrations.AddIndex(
            model_name='recipient',
            index=models.Index(condition=models.Q(('routed_at__isnull', False)), fields=['-routed_at', '-id'], name='recipient_routed'),
        ),
    ]
