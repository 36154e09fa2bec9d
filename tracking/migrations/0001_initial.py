import django.db.models.deletion
from django.db import migrations, models


def create_tracking_table(apps, schema_editor) -> None:
    from django.utils import timezone

    from tracking import partitions

    vendor = schema_editor.connection.vendor
    for statement in partitions.create_table(vendor):
        schema_editor.execute(statement)
    if vendor == "postgresql":
        partitions.maintain(timezone.now(), timezone.timedelta(days=3650))


def drop_tracking_table(apps, schema_editor) -> None:
    schema_editor.execute("DROP TABLE tracking_event")


class Migration(migrations.Migration):
    initial = True

    dependencies = []

    operations = [
        migrations.CreateModel(
            name="TrackingEvent",
            fields=[
                ("id", models.BigAutoField(primary_key=True, serialize=False)),
                ("at", models.DateTimeField()),
                ("event", models.CharField(max_length=20)),
                ("event_id", models.UUIDField()),
                ("qid", models.CharField(blank=True, max_length=20, verbose_name="queue id")),
                ("message_pk", models.BigIntegerField(blank=True, null=True)),
                ("message_id", models.CharField(blank=True, max_length=998)),
                ("sender", models.CharField(blank=True, max_length=512)),
                ("recipient", models.CharField(blank=True, max_length=512)),
                ("client", models.CharField(blank=True, max_length=64)),
                ("account", models.CharField(blank=True, max_length=150)),
                ("size", models.BigIntegerField(blank=True, null=True)),
                ("queue", models.CharField(blank=True, max_length=255)),
                ("next_hop", models.CharField(blank=True, max_length=1024)),
                ("host", models.CharField(blank=True, max_length=300)),
                ("ip", models.CharField(blank=True, max_length=64)),
                ("tls", models.CharField(blank=True, max_length=160)),
                ("code", models.PositiveSmallIntegerField(blank=True, null=True)),
                ("enhanced", models.CharField(blank=True, max_length=16)),
                ("reply", models.TextField(blank=True)),
                ("remote_id", models.CharField(blank=True, max_length=100)),
                ("actor", models.CharField(blank=True, max_length=150)),
                ("detail", models.JSONField(blank=True, default=dict)),
            ],
            options={"db_table": "tracking_event", "ordering": ["-at", "-id"], "managed": False},
        ),
        migrations.RunPython(create_tracking_table, drop_tracking_table),
        migrations.CreateModel(
            name="WebhookEndpoint",
            fields=[
                ("id", models.BigAutoField(auto_created=True, primary_key=True, serialize=False, verbose_name="ID")),
                ("name", models.CharField(max_length=100, unique=True)),
                ("url", models.URLField(max_length=2000)),
                ("events", models.JSONField(default=list)),
                ("secret", models.CharField(max_length=200)),
                ("enabled", models.BooleanField(default=True)),
                ("created_at", models.DateTimeField()),
                ("updated_at", models.DateTimeField()),
                ("failures", models.PositiveIntegerField(default=0)),
                ("down_until", models.DateTimeField(blank=True, null=True)),
                ("last_error", models.TextField(blank=True)),
                ("last_success_at", models.DateTimeField(blank=True, null=True)),
            ],
            options={"ordering": ["name"]},
        ),
        migrations.CreateModel(
            name="WebhookDelivery",
            fields=[
                ("id", models.BigAutoField(auto_created=True, primary_key=True, serialize=False, verbose_name="ID")),
                ("event_id", models.UUIDField()),
                ("event", models.CharField(max_length=40)),
                ("body", models.TextField()),
                ("state", models.CharField(choices=[("pending", "Pending"), ("delivered", "Delivered"), ("failed", "Failed")], default="pending", max_length=10)),
                ("created_at", models.DateTimeField()),
                ("next_attempt_at", models.DateTimeField()),
                ("attempts", models.PositiveIntegerField(default=0)),
                ("lease_owner", models.CharField(blank=True, max_length=100)),
                ("lease_until", models.DateTimeField(blank=True, null=True)),
                ("last_status", models.PositiveSmallIntegerField(blank=True, null=True)),
                ("last_error", models.TextField(blank=True)),
                ("finished_at", models.DateTimeField(blank=True, null=True)),
                ("endpoint", models.ForeignKey(on_delete=django.db.models.deletion.CASCADE, related_name="deliveries", to="tracking.webhookendpoint")),
            ],
            options={
                "indexes": [
                    models.Index(condition=models.Q(("state", "pending")), fields=["next_attempt_at"], name="tracking_wh_due"),
                    models.Index(fields=["endpoint", "-created_at"], name="tracking_wh_endpoint"),
                    models.Index(fields=["finished_at"], name="tracking_wh_finished"),
                ],
            },
        ),
        migrations.CreateModel(
            name="WebhookAttempt",
            fields=[
                ("id", models.BigAutoField(auto_created=True, primary_key=True, serialize=False, verbose_name="ID")),
                ("at", models.DateTimeField()),
                ("status", models.PositiveSmallIntegerField(blank=True, null=True)),
                ("error", models.TextField(blank=True)),
                ("duration_ms", models.PositiveIntegerField(default=0)),
                ("delivery", models.ForeignKey(on_delete=django.db.models.deletion.CASCADE, related_name="tries", to="tracking.webhookdelivery")),
                ("endpoint", models.ForeignKey(on_delete=django.db.models.deletion.CASCADE, related_name="tries", to="tracking.webhookendpoint")),
            ],
            options={"indexes": [models.Index(fields=["endpoint", "-at"], name="tracking_wh_attempts")]},
        ),
    ]
