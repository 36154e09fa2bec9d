"""Gauges of operator insight, read at scrape time (registered by delivery.metrics).

Per queue holding mail: its age alert level (0 ok, 1 warning, 2 critical) and
threshold; per queue whose link is in Retry: 1; the alerts in force; the
recipients kept in the dead-letter queue. Three small queries: the queues
with their links (rows the sweep keeps), the alert rows, and a count over the
dead-letter queue's recipients (by the recipient queue index).
"""

from __future__ import annotations

from collections.abc import Iterator

from django.db import DatabaseError
from django.db.models import Count
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from insight.alerts import LEVEL_VALUES, age_checks
from insight.models import AlertState
from queues.lib import clock
from queues.models import DeliveryType, LinkState, Queue, Recipient


class InsightCollector(Collector):
    def collect(self) -> Iterator[Metric]:
        try:
            metrics = list(self._metrics())
        except DatabaseError:  # mailrelay_database_up (StoreCollector) says so
            return
        yield from metrics

    def _metrics(self) -> Iterator[Metric]:
        now = clock.now()
        labels = ["queue", "delivery_type"]
        level = GaugeMetricFamily(
            "mailrelay_queue_age_alert",
            "A queue's age alert: 0 ok, 1 warning (oldest waiting message older than its "
            "threshold), 2 critical (twice the threshold).",
            labels=labels,
        )
        threshold = GaugeMetricFamily(
            "mailrelay_queue_age_alert_threshold_seconds",
            "A queue's age alert threshold (MAILRELAY_ALERT_OLDEST_AGE or its override).",
            labels=labels,
        )
        for check in sorted(age_checks(now), key=lambda c: (c.delivery_type, c.queue_name)):
            key = [check.queue_name, check.delivery_type]
            level.add_metric(key, LEVEL_VALUES.get(check.level or "", 0))
            if check.threshold is not None:
                threshold.add_metric(key, check.threshold.total_seconds())
        yield level
        yield threshold

        retry = GaugeMetricFamily(
            "mailrelay_queue_in_retry",
            "1 for each queue whose link is in Retry (connection failures); absent otherwise.",
            labels=labels,
        )
        rows = Queue.objects.filter(link__state=LinkState.RETRY).values_list(
            "name", "delivery_type"
        )
        for name, dtype in sorted(rows):
            retry.add_metric([name, dtype], 1)
        yield retry

        alerts = GaugeMetricFamily(
            "mailrelay_alerts_active",
            "Alerts in force (GET /api/v1/alerts/), by kind and level.",
            labels=["kind", "level"],
        )
        for row in AlertState.objects.values("kind", "level").annotate(n=Count("id")).order_by():
            alerts.add_metric([row["kind"], row["level"]], row["n"])
        yield alerts

        dead = GaugeMetricFamily(
            "mailrelay_dead_letter_recipients",
            "Recipients kept in the dead-letter queue (undeliverable and expired).",
        )
        dead.add_metric(
            [], Recipient.objects.filter(queue__delivery_type=DeliveryType.DEAD_LETTER).count()
        )
        yield dead
