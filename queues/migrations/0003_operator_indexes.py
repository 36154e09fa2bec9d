"""Operator surface: queue counts and samples, the Queue Viewer's indexes, roles.

The substring filters of the Queue Viewer (sender, recipient, Message-ID,
subject, last error) are ``ILIKE '%…%'`` / ``~`` searches. On PostgreSQL they
are served by pg_trgm GIN indexes, created here with raw SQL and kept out of
the model state (Django has no portable way to say "trigram", and SQLite, the
embedded default of ``make run``, has neither the extension nor the need).
Each index names the query that needs it.
"""

import logging

import django.db.models.deletion
from django.db import migrations, models, transaction

log = logging.getLogger(__name__)

TRIGRAM_INDEXES = [
    # messages list ?sender=: WHERE mail_from ILIKE '%text%'
    ("message_mail_from_trgm", "queues_message", "mail_from", ""),
    # messages list ?subject=: WHERE subject ILIKE '%text%'
    ("message_subject_trgm", "queues_message", "subject", ""),
    # messages list ?message_id=: WHERE message_id ILIKE '%text%'
    ("message_message_id_trgm", "queues_message", "message_id", ""),
    # messages list ?recipient=: EXISTS (… recipient WHERE address ILIKE '%text%' …)
    ("recipient_address_trgm", "queues_recipient", "address", ""),
    # messages list ?error= / ?error_group=: EXISTS (… recipient WHERE state IN
    # ('deferred','failed','expired') AND last_text ILIKE '%text%' (or ~ pattern) …).
    # Partial: delivered and waiting-untried recipients never carry an error.
    (
        "recipient_error_trgm",
        "queues_recipient",
        "last_text",
        "WHERE state IN ('deferred', 'failed', 'expired')",
    ),
]

ROLES = ("viewer", "operator", "admin")


def create_trigram_indexes(apps, schema_editor):
    if schema_editor.connection.vendor != "postgresql":
        return
    try:
        # A savepoint: without the right to create the extension the migration
        # goes on, and the substring filters scan instead.
        with transaction.atomic(using=schema_editor.connection.alias):
            schema_editor.execute("CREATE EXTENSION IF NOT EXISTS pg_trgm")
    except Exception:  # noqa: BLE001
        log.warning("pg_trgm is not available: substring filters will not be indexed")
        return
    for name, table, column, where in TRIGRAM_INDEXES:
        schema_editor.execute(
            f"CREATE INDEX IF NOT EXISTS {name} ON {table} "
            f"USING gin ({column} gin_trgm_ops) {where}"
        )


def drop_trigram_indexes(apps, schema_editor):
    if schema_editor.connection.vendor != "postgresql":
        return
    for name, _table, _column, _where in TRIGRAM_INDEXES:
        schema_editor.execute(f"DROP INDEX IF EXISTS {name}")


def create_roles(apps, schema_editor):
    Group = apps.get_model("auth", "Group")
    for name in ROLES:
        Group.objects.get_or_create(name=name)


def drop_roles(apps, schema_editor):
    Group = apps.get_model("auth", "Group")
    Group.objects.filter(name__in=ROLES).delete()


class Migration(migrations.Migration):

    dependencies = [
        ('queues', '0002_retry_and_audit'),
        ('auth', '0012_alter_user_first_name_max_length'),
    ]

    operations = [
        migrations.CreateModel(
            name='QueueSample',
            fields=[
                ('id', models.BigAutoField(auto_created=True, primary_key=True, serialize=False, verbose_name='ID')),
                ('sampled_at', models.DateTimeField()),
                ('seconds', models.FloatField()),
                ('depth', models.PositiveIntegerField()),
                ('incoming', models.PositiveIntegerField(default=0)),
                ('delivered', models.PositiveIntegerField(default=0)),
                ('failed', models.PositiveIntegerField(default=0)),
                ('attempt_mark', models.BigIntegerField(default=0)),
                ('message_mark', models.BigIntegerField(default=0)),
            ],
        ),
        migrations.AddField(
            model_name='queue',
            name='incoming_rate',
            field=models.FloatField(default=0),
        ),
        migrations.AddField(
            model_name='queue',
            name='oldest_received_at',
            field=models.DateTimeField(blank=True, null=True),
        ),
        migrations.AddField(
            model_name='queue',
            name='outgoing_rate',
            field=models.FloatField(default=0),
        ),
        migrations.AddIndex(
            model_name='message',
            index=models.Index(fields=['received_at', 'id'], name='message_received'),
        ),
        migrations.AddIndex(
            model_name='message',
            index=models.Index(fields=['size', 'id'], name='message_size'),
        ),
        migrations.AddIndex(
            model_name='recipient',
            index=models.Index(fields=['domain', 'message'], name='recipient_domain'),
        ),
        migrations.AddField(
            model_name='queuesample',
            name='queue',
            field=models.ForeignKey(blank=True, db_index=False, null=True, on_delete=django.db.models.deletion.CASCADE, related_name='samples', to='queues.queue'),
        ),
        migrations.AddIndex(
            model_name='queuesample',
            index=models.Index(fields=['queue', 'sampled_at'], name='queuesample_by_queue'),
        ),
        migrations.AddIndex(
            model_name='queuesample',
            index=models.Index(fields=['sampled_at'], name='queuesample_by_time'),
        ),
        migrations.RunPython(create_trigram_indexes, drop_trigram_indexes),
        migrations.RunPython(create_roles, drop_roles),
    ]
