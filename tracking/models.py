"""Message tracking rows and webhook endpoints, deliveries (the outbox) and attempts.

``TrackingEvent`` is not managed by Django: on PostgreSQL it is a table
partitioned by day (``tracking.partitions``), on SQLite a plain table; both
are created by migration 0001 (RunPython, per database vendor). Rows never
reference a message: they outlive it (``MAILRELAY_TRACKING_RETENTION``).
"""

from __future__ import annotations

from django.db import models


class TrackingEvent(models.Model):
    # The real primary key on PostgreSQL is (id, at), as the partition key must
    # be part of it; id alone is unique (one sequence).
    id = models.BigAutoField(primary_key=True)
    at = models.DateTimeField()
    event = models.CharField(max_length=20)
    event_id = models.UUIDField()  # stable, for de-duplication (event log, webhooks)
    qid = models.CharField("queue id", max_length=20, blank=True)
    message_pk = models.BigIntegerField(null=True, blank=True)  # no FK: outlives the message
    message_id = models.CharField(max_length=998, blank=True)  # the Message-ID header
    sender = models.CharField(max_length=512, blank=True)
    recipient = models.CharField(max_length=512, blank=True)
    client = models.CharField(max_length=64, blank=True)  # address of the SMTP client
    account = models.CharField(max_length=150, blank=True)  # SMTP AUTH account
    size = models.BigIntegerField(null=True, blank=True)
    queue = models.CharField(max_length=255, blank=True)
    next_hop = models.CharField(max_length=1024, blank=True)  # the link's name
    host = models.CharField(max_length=300, blank=True)
    ip = models.CharField(max_length=64, blank=True)
    tls = models.CharField(max_length=160, blank=True)
    code = models.PositiveSmallIntegerField(null=True, blank=True)
    enhanced = models.CharField(max_length=16, blank=True)
    reply = models.TextField(blank=True)
    remote_id = models.CharField(max_length=100, blank=True)  # the next hop's queue id
    actor = models.CharField(max_length=150, blank=True)  # operator actions
    detail = models.JSONField(default=dict, blank=True)

    class Meta:
        managed = False
        db_table = "tracking_event"
        ordering = ["-at", "-id"]

    def __str__(self) -> str:
        return f"{self.at:%Y-%m-%d %H:%M:%S} {self.qid} {self.event} {self.recipient}"


class WebhookEndpoint(models.Model):
    name = models.CharField(max_length=100, unique=True)
    url = models.URLField(max_length=2000)
    events = models.JSONField(default=list)  # webhook event types (tracking.events)
    secret = models.CharField(max_length=200)
    enabled = models.BooleanField(default=True)
    created_at = models.DateTimeField()
    updated_at = models.DateTimeField()
    # Back-off of the endpoint as a whole: after a failed POST none of its
    # webhooks is tried before down_until (a dead endpoint costs one try per
    # interval, not one per event).
    failures = models.PositiveIntegerField(default=0)  # consecutive failed POSTs
    down_until = models.DateTimeField(null=True, blank=True)
    last_error = models.TextField(blank=True)
    last_success_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["name"]

    def __str__(self) -> str:
        return self.name


class DeliveryState(models.TextChoices):
    PENDING = "pending"
    DELIVERED = "delivered"
    FAILED = "failed"


class WebhookDelivery(models.Model):
    """One event for one endpoint: the outbox row, written in the transaction
    of the event, sent at least once by the webhook sender."""

    endpoint = models.ForeignKey(
        WebhookEndpoint, on_delete=models.CASCADE, related_name="deliveries"
    )
    event_id = models.UUIDField()
    event = models.CharField(max_length=40)  # the webhook event type
    body = models.TextField()  # the exact JSON body POSTed (signed as is)
    state = models.CharField(
        max_length=10, choices=DeliveryState.choices, default=DeliveryState.PENDING
    )
    created_at = models.DateTimeField()
    next_attempt_at = models.DateTimeField()
    attempts = models.PositiveIntegerField(default=0)
    lease_owner = models.CharField(max_length=100, blank=True)
    lease_until = models.DateTimeField(null=True, blank=True)
    last_status = models.PositiveSmallIntegerField(null=True, blank=True)
    last_error = models.TextField(blank=True)
    finished_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        indexes = [
            # The sender's claim: due pending rows, oldest first.
            models.Index(
                fields=["next_attempt_at"],
                name="tracking_wh_due",
                condition=models.Q(state="pending"),
            ),
            # An endpoint's recent deliveries (UI, API).
            models.Index(fields=["endpoint", "-created_at"], name="tracking_wh_endpoint"),
            # Pruning finished rows.
            models.Index(fields=["finished_at"], name="tracking_wh_finished"),
            # Failing pending rows older than MAILRELAY_WEBHOOK_RETRY_FOR (sender.fail_expired).
            models.Index(
                fields=["created_at"],
                name="tracking_wh_pending_age",
                condition=models.Q(state="pending"),
            ),
        ]


class WebhookAttempt(models.Model):
    delivery = models.ForeignKey(WebhookDelivery, on_delete=models.CASCADE, related_name="tries")
    endpoint = models.ForeignKey(WebhookEndpoint, on_delete=models.CASCADE, related_name="tries")
    at = models.DateTimeField()
    status = models.PositiveSmallIntegerField(null=True, blank=True)  # HTTP status
    error = models.TextField(blank=True)
    duration_ms = models.PositiveIntegerField(default=0)

    class Meta:
        indexes = [models.Index(fields=["endpoint", "-at"], name="tracking_wh_attempts")]
