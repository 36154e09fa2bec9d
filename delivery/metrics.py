"""``GET /metrics``: Prometheus text format, for every process of the relay.

Two kinds of numbers:

- **counted events** (accepted, delivered, deferred, failed, attempts by
  reply class, SMTP accept latency, DSNs, pickup files) are incremented
  in whichever process sees them (``queues.counters``' instruments: the
  read side counts from the store's signals, ``tracking.record``; the
  ingress and the pickup watcher count their accepts). With
  ``PROMETHEUS_MULTIPROC_DIR`` set, every process writes them to files in
  that folder and this view sums the files of all of them; without it, the
  view can only show the counts of the process that serves it.
- **facts of the database** (messages by state, queue depth, oldest message,
  back-pressure readings and levels of every ingress node) are read here, at
  scrape time, by ``StoreCollector``: a few indexed queries whose cost
  follows the live queue — never one per message, never a scan of the
  finished messages kept for days.

Set ``MAILRELAY_METRICS_TOKEN`` to require ``Authorization: Bearer <token>``;
without it only ``MAILRELAY_METRICS_ALLOWED_NETWORKS`` may scrape.
"""

from __future__ import annotations

import hmac
import logging
import os
from collections.abc import Iterator
from datetime import datetime

from django.conf import settings
from django.db import DatabaseError, connection
from django.db.models import Count, Min, Q
from django.http import HttpRequest, HttpResponse
from django.views.decorators.http import require_GET
from prometheus_client import REGISTRY, CollectorRegistry
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.exposition import choose_encoder
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.registry import Collector

from queues.access import client_in_networks
from queues.lib import clock
from queues.models import (
    WAITING_RECIPIENT_STATES,
    DeliveryType,
    Message,
    MessageState,
    Queue,
    Recipient,
    RecipientState,
)

log = logging.getLogger(__name__)

# Messages the categorizer has not finished: the Submission queue.
SUBMISSION_STATES = (MessageState.SUBMISSION, MessageState.CATEGORIZING)
# Special queues shown even when empty (Submission is counted from the messages).
ALWAYS_SHOWN = (DeliveryType.SUBMISSION, DeliveryType.UNREACHABLE, DeliveryType.POISON)
LEVEL_VALUES = {"normal": 0, "medium": 1, "high": 2}
NOT_MONITORED_VALUE = -1


# --------------------------------------------------------------------------- the collector


def _age(now: datetime, then: datetime | None) -> float:
    return max((now - then).total_seconds(), 0.0) if then else 0.0


def _live_recipients_sql() -> tuple[str, list[str]]:
    """(queue_id, message_id) of the recipients waiting in a queue or in flight.

    Two branches, each matching one partial index exactly (recipient_waiting:
    queued/deferred, which holds both columns; recipient_active_lease:
    active), so the cost follows the live queue, never the delivered history.
    """
    table = connection.ops.quote_name(Recipient._meta.db_table)
    sql = (
        f"SELECT queue_id, message_id FROM {table} "
        "WHERE state IN (%s, %s) AND queue_id IS NOT NULL "
        "UNION ALL "
        f"SELECT queue_id, message_id FROM {table} "
        "WHERE state = %s AND queue_id IS NOT NULL"
    )
    return sql, [*WAITING_RECIPIENT_STATES, RecipientState.ACTIVE]


def _queue_tallies() -> tuple[dict[int, tuple[int, int | None]], tuple[int, int | None]]:
    """Per queue (messages, oldest message id), and the same over all queues."""
    live, params = _live_recipients_sql()
    with connection.cursor() as cursor:
        cursor.execute(
            f"SELECT queue_id, COUNT(DISTINCT message_id), MIN(message_id) FROM ({live}) r "
            "GROUP BY queue_id",
            params,
        )
        per_queue = {queue_id: (n, oldest) for queue_id, n, oldest in cursor.fetchall()}
        cursor.execute(
            f"SELECT COUNT(DISTINCT message_id), MIN(message_id) FROM ({live}) r", params
        )
        total, oldest = cursor.fetchone()
    return per_queue, (total or 0, oldest)


class StoreCollector(Collector):
    """Gauges read from the database at scrape time.

    Queries per scrape, each answered by an index whose size follows the
    live queue (not the finished messages kept for days): the Submission
    and Categorizing messages (one per state, by their partial indexes);
    messages and oldest message per queue, and over all queues (a GROUP BY
    over the waiting and in-flight recipients, by their partial indexes);
    the names of those queues; the arrival time of each oldest message (by
    primary key); the back-pressure rows. Seven queries in all.
    """

    def collect(self) -> Iterator[Metric]:
        up = GaugeMetricFamily(
            "mailrelay_database_up", "1 if the last scrape could read the queue store, else 0."
        )
        try:
            metrics = list(self._store_metrics()) + list(self._pressure_metrics())
        except DatabaseError:
            log.warning("metrics: the database could not be read", exc_info=True)
            up.add_metric([], 0)
            yield up
            return
        up.add_metric([], 1)
        yield up
        yield from metrics

    def _store_metrics(self) -> Iterator[Metric]:
        now = clock.now()
        # Each state on its own: the partial index of that state answers it
        # (``state IN (...)`` would match neither index and scan the table).
        live: dict[str, tuple[int, int | None]] = {}
        for state in SUBMISSION_STATES:
            row = Message.objects.filter(state=state).aggregate(n=Count("id"), oldest=Min("id"))
            live[state] = (row["n"], row["oldest"])
        tallies, queued = _queue_tallies()
        live[MessageState.QUEUED] = queued

        oldest_ids = [oldest for _, oldest in (*live.values(), *tallies.values()) if oldest]
        received = dict(Message.objects.filter(id__in=oldest_ids).values_list("id", "received_at"))

        def age_of(oldest_id: int | None) -> float:
            return _age(now, received.get(oldest_id)) if oldest_id else 0.0

        messages = GaugeMetricFamily(
            "mailrelay_messages",
            "Messages not yet finished, by state: submission and categorizing "
            "(the Submission queue), queued (a recipient waiting or in flight in a "
            "delivery queue).",
            labels=["state"],
        )
        for state, (count, _) in live.items():
            messages.add_metric([state], count)
        yield messages

        oldest = GaugeMetricFamily(
            "mailrelay_oldest_message_age_seconds",
            "Age of the oldest message not yet finished (0 when there is none).",
        )
        all_oldest = [o for _, o in live.values() if o]
        oldest.add_metric([], age_of(min(all_oldest)) if all_oldest else 0.0)
        yield oldest

        # Queues with messages, and the special queues always (a steady series for
        # Unreachable and Poison even when empty); empty destination queues are left
        # out, or every domain ever seen would be a series. Dead-letter holds final
        # recipients only: failures are mailrelay_recipients_failed_total.
        queues = list(
            Queue.objects.filter(
                Q(id__in=list(tallies)) | Q(delivery_type__in=ALWAYS_SHOWN)
            ).values_list("id", "name", "delivery_type")
        )
        depth = GaugeMetricFamily(
            "mailrelay_queue_depth",
            "Messages in a queue with a recipient waiting or in flight there; "
            "Submission: messages not yet categorized.",
            labels=["queue", "delivery_type"],
        )
        age = GaugeMetricFamily(
            "mailrelay_queue_oldest_message_age_seconds",
            "Age of the oldest message in a queue (0 when empty).",
            labels=["queue", "delivery_type"],
        )
        submission = [live[s] for s in SUBMISSION_STATES]
        submission_oldest = min((o for _, o in submission if o), default=None)
        label = [DeliveryType.SUBMISSION.label, DeliveryType.SUBMISSION.value]
        depth.add_metric(label, sum(n for n, _ in submission))
        age.add_metric(label, age_of(submission_oldest))
        for queue_id, name, delivery_type in sorted(queues, key=lambda q: (q[2], q[1])):
            if delivery_type == DeliveryType.SUBMISSION:
                continue  # counted above, from the messages
            count, oldest_id = tallies.get(queue_id, (0, None))
            depth.add_metric([name, delivery_type], count)
            age.add_metric([name, delivery_type], age_of(oldest_id))
        yield depth
        yield age

    def _pressure_metrics(self) -> Iterator[Metric]:
        from delivery.models import ResourcePressure

        labels = ["node", "resource"]
        reading = GaugeMetricFamily(
            "mailrelay_backpressure_reading",
            "A back-pressure resource's last reading on an ingress node "
            "(% for disk and memory, a count for the others; absent when not monitored).",
            labels=labels,
        )
        level = GaugeMetricFamily(
            "mailrelay_backpressure_level",
            "A back-pressure resource's level: 0 normal, 1 medium, 2 high, -1 not monitored.",
            labels=labels,
        )
        threshold = GaugeMetricFamily(
            "mailrelay_backpressure_threshold",
            "A back-pressure resource's thresholds in force (the reading's unit).",
            labels=[*labels, "level"],
        )
        delay = GaugeMetricFamily(
            "mailrelay_backpressure_tarpit_delay_seconds",
            "The delay this resource puts on untrusted MAIL FROM now (0: none).",
            labels=labels,
        )
        updated = GaugeMetricFamily(
            "mailrelay_backpressure_updated_timestamp_seconds",
            "When an ingress node last saved its readings (Unix time); a stale node stopped.",
            labels=["node"],
        )
        last_update: dict[str, datetime] = {}
        fields = ("node", "resource", "reading", "level", "normal", "medium", "high")
        rows = ResourcePressure.objects.order_by("node", "resource").values_list(
            *fields, "delay_seconds", "updated_at"
        )
        for node, resource, value, lvl, normal, medium, high, delay_s, at in rows:
            key = [node, resource]
            if value is not None:
                reading.add_metric(key, value)
            level.add_metric(key, LEVEL_VALUES.get(lvl, NOT_MONITORED_VALUE))
            for name, t in (("normal", normal), ("medium", medium), ("high", high)):
                if t is not None:
                    threshold.add_metric([*key, name], t)
            delay.add_metric(key, delay_s or 0.0)
            if node not in last_update or at > last_update[node]:
                last_update[node] = at
        for node, at in sorted(last_update.items()):
            updated.add_metric([node], at.timestamp())
        yield from (reading, level, threshold, delay, updated)


class _Mode(Collector):
    def __init__(self, multiprocess: bool) -> None:
        self.multiprocess = multiprocess

    def collect(self) -> Iterator[Metric]:
        mode = GaugeMetricFamily(
            "mailrelay_metrics_multiprocess",
            "1 if counters are summed over every process (PROMETHEUS_MULTIPROC_DIR), "
            "0 if they are this web process's only.",
        )
        mode.add_metric([], 1 if self.multiprocess else 0)
        yield mode


class _Default(Collector):
    """This process's own instruments (single-process mode)."""

    def collect(self) -> Iterator[Metric]:
        return REGISTRY.collect()


def scrape_registry(multiproc_dir: str | None = None) -> CollectorRegistry:
    """The registry one scrape reads: counters (summed over processes) + database facts.

    ``PROMETHEUS_MULTIPROC_DIR`` is prometheus_client's own variable, not a
    mailrelay setting: the counters of every process write where the library
    reads it from the environment, so the scrape reads the same variable.
    """
    path = (
        multiproc_dir if multiproc_dir is not None else os.environ.get("PROMETHEUS_MULTIPROC_DIR")
    )
    registry = CollectorRegistry(auto_describe=False)
    if path:
        MultiProcessCollector(registry, path=path)
    else:
        registry.register(_Default())
    registry.register(_Mode(bool(path)))
    registry.register(StoreCollector())
    from insight.metrics import InsightCollector  # age alerts, Retry queues, dead letters

    registry.register(InsightCollector())
    return registry


# --------------------------------------------------------------------------- the view


@require_GET
def metrics_view(request: HttpRequest) -> HttpResponse:
    token = settings.MAILRELAY_METRICS_TOKEN
    if token:
        given = request.headers.get("Authorization", "")
        scheme, _, credentials = given.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(
            credentials.strip().encode(), token.encode()
        ):
            response = HttpResponse("authorization required\n", status=401)
            response["WWW-Authenticate"] = 'Bearer realm="metrics"'
            return response
    elif not client_in_networks(request, settings.MAILRELAY_METRICS_ALLOWED_NETWORKS):
        # No token: only the scrapers' networks (loopback and private ranges by
        # default) may read what it shows (every destination domain).
        return HttpResponse("forbidden\n", status=403)
    # Prometheus text 0.0.4 unless the scraper asks for OpenMetrics or a newer text.
    encoder, content_type = choose_encoder(request.headers.get("Accept", ""))
    return HttpResponse(encoder(scrape_registry()), content_type=content_type)
