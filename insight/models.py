"""What insight keeps: the deferral summary at scale, and the age alerts' state."""

from __future__ import annotations

from django.db import models


class DeferralGroup(models.Model):
    """One (queue, code, enhanced, normalised error) group of deferred recipients,
    as of the last refresh (insight.deferrals.refresh). Served instead of the live
    GROUP BY when the queue is large (MAILRELAY_INSIGHT_LIVE_LIMIT)."""

    queue = models.ForeignKey(
        "queues.Queue", on_delete=models.CASCADE, related_name="+", db_index=False
    )
    code = models.PositiveSmallIntegerField(null=True, blank=True)
    enhanced = models.CharField(max_length=16, blank=True)
    text = models.TextField(blank=True)
    recipients = models.PositiveIntegerField()
    senders = models.PositiveIntegerField(default=0)
    first_seen = models.DateTimeField(null=True, blank=True)
    last_seen = models.DateTimeField(null=True, blank=True)
    # Recipients whose last try fell in each of the last hour's 10-minute slices, oldest first.
    trend = models.JSONField(default=list)
    # The queue's groups beyond its largest (insight.deferrals.GROUPS_PER_QUEUE), merged.
    other = models.BooleanField(default=False)

    class Meta:
        indexes = [
            models.Index(fields=["queue"], name="deferralgroup_by_queue"),
            models.Index(fields=["-recipients", "id"], name="deferralgroup_largest"),
        ]


class IncidentSummary(models.Model):
    """One incident as of the last refresh: deferrals of one provider and one
    normalised error (``by_error`` False), or of one error across providers
    (True), aggregated by insight.deferrals.refresh so a read of the incidents
    at scale is one indexed query (the largest first)."""

    by_error = models.BooleanField()
    provider = models.CharField(max_length=255, blank=True)  # "" when by error
    error = models.TextField(blank=True)
    codes = models.JSONField(default=list)
    queues = models.JSONField(default=list)  # the largest (insight.incidents.QUEUES_SHOWN)
    queue_count = models.PositiveIntegerField(default=0)
    recipients = models.PositiveIntegerField()
    senders = models.PositiveIntegerField(default=0)
    first_seen = models.DateTimeField(null=True, blank=True)
    last_seen = models.DateTimeField(null=True, blank=True)
    trend = models.JSONField(default=list)

    class Meta:
        indexes = [
            models.Index(fields=["by_error", "-recipients", "id"], name="incident_largest"),
        ]


class InsightRefresh(models.Model):
    """The one row saying when the deferral summary was last refreshed, over how many."""

    computed_at = models.DateTimeField()
    deferred = models.PositiveIntegerField(default=0)
    seconds = models.FloatField(default=0)


class AlertState(models.Model):
    """An alert raised and not yet cleared (one row per key). Raising and clearing
    are each an Event (queues.models.Event, kind "alert")."""

    key = models.CharField(max_length=300, unique=True)  # e.g. "age:queue:12"
    kind = models.CharField(max_length=40)  # oldest_age
    level = models.CharField(max_length=10)  # warning / critical
    queue = models.ForeignKey(
        "queues.Queue", null=True, blank=True, on_delete=models.CASCADE, related_name="+"
    )
    value = models.FloatField(default=0)  # e.g. the oldest age in seconds
    threshold = models.FloatField(default=0)
    text = models.TextField(blank=True)
    raised_at = models.DateTimeField()
    updated_at = models.DateTimeField()
