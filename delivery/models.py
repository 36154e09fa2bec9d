"""The delivery engine's own tables. The queue store (messages, queues, events)
lives in ``queues``; here is only what the engine's processes report about
themselves."""

from __future__ import annotations

from django.db import models

from delivery.backpressure.engine import NOT_MONITORED, Level, Resource


class ResourcePressure(models.Model):
    """One back-pressure resource on one ingress node, as of its last interval.

    Each SMTP ingress process (a node: MAILRELAY_NODE_NAME or hostname:pid)
    upserts one row per resource every monitoring interval, so the API and the
    ``backpressure`` command show every node. A node removes its rows when it
    stops; rows of a node that died show as stale.
    """

    node = models.CharField(max_length=255)
    resource = models.CharField(max_length=40, choices=[(r.value, r.label) for r in Resource])
    reading = models.FloatField(null=True, blank=True)  # None: not monitored
    level = models.CharField(
        max_length=16,
        choices=[(lv.value, lv.value) for lv in Level] + [(NOT_MONITORED, "not monitored")],
    )
    normal = models.FloatField(null=True, blank=True)
    medium = models.FloatField(null=True, blank=True)
    high = models.FloatField(null=True, blank=True)
    history_depth = models.PositiveIntegerField(null=True, blank=True)
    pressure_intervals = models.PositiveIntegerField(default=0)  # not normal, in a row
    history = models.TextField(blank=True)  # one letter per interval, oldest first: n m h -
    action = models.CharField(max_length=20, blank=True)  # tarpit / refuse untrusted / refuse all
    delay_seconds = models.FloatField(default=0)  # the tarpit delay of untrusted MAIL FROM
    note = models.CharField(max_length=500, blank=True)  # the path measured, why not monitored
    updated_at = models.DateTimeField()

    class Meta:
        constraints = [
            models.UniqueConstraint(fields=["node", "resource"], name="resourcepressure_unique")
        ]

    def __str__(self) -> str:
        return f"{self.node} {self.resource}: {self.level}"
