"""Prometheus instruments: the counters and histograms every process increments.

A leaf module (prometheus_client, django.db.transaction and the leaf
``queues.lib`` only, for the DSN kinds), so the queue store, the engine and
the SMTP ingress can all import it without an import cycle — as they import
settings. What is a fact of the database (messages by state, queue depth,
back-pressure readings) is not counted here: ``delivery.metrics`` reads it
at scrape time (this module is ``counters``, not ``metrics``, so the two
never shadow each other).

Who counts: what a message went through (delivery attempts by reply class,
recipients delivered, deferred and failed, DSNs queued, recipients expired)
is counted by the read side from the store's signals, beside the tracking
rows of the same facts (``tracking.record``); the SMTP ingress counts and
times its own accepts (``delivery.smtpd.server``), the pickup watcher its
files and messages (the helpers below).

Several processes (ingress, workers, web) each count their own events. With
``PROMETHEUS_MULTIPROC_DIR`` set in the environment of every process
*before it starts* (prometheus_client reads it on import), each process
writes its values to files in that folder and ``GET /metrics`` sums them;
see docs/metrics.md.

Everything counts only what was committed: inside a transaction the count
waits for the commit (``transaction.on_commit``), outside one it counts at
once.
"""

from __future__ import annotations

from django.db import transaction
from prometheus_client import Counter, Histogram, disable_created_metrics

from queues.lib import DSN_KINDS

# The *_created series (when a counter was created) exist only in single-process
# mode and double the output; the same series in both modes.
disable_created_metrics()

SOURCES = ("smtp", "pickup", "replay")
REPLY_CLASSES = ("2xx", "3xx", "4xx", "5xx", "none")
FAILURE_REASONS = ("permanent", "retry_timeout", "expired")
PICKUP_OUTCOMES = ("submitted", "bad")

MESSAGES_ACCEPTED = Counter(
    "mailrelay_messages_accepted",
    "Messages committed to the queue store, by how they arrived (DSNs: mailrelay_dsns_sent).",
    ["source"],
)
RECIPIENTS_DELIVERED = Counter(
    "mailrelay_recipients_delivered",
    "Recipients the next hop accepted (final).",
)
RECIPIENTS_DEFERRED = Counter(
    "mailrelay_recipients_deferred",
    "Delivery or routing tries that left the recipient waiting for a retry.",
)
RECIPIENTS_FAILED = Counter(
    "mailrelay_recipients_failed",
    "Recipients that failed for good: permanent reply, retry timeout, or message expiry.",
    ["reason"],
)
DELIVERY_ATTEMPTS = Counter(
    "mailrelay_delivery_attempts",
    "Delivery attempts (one per recipient per try), by the class of the reply; "
    "'none' is no SMTP reply (connection failure, timeout, routing failure).",
    ["reply_class"],
)
SMTP_ACCEPT_SECONDS = Histogram(
    "mailrelay_smtp_accept_seconds",
    "Time from the end of a message's DATA to its commit (what the client waits for its 250).",
    buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0),
)
DSNS_SENT = Counter(
    "mailrelay_dsns_sent",
    "Delivery status notifications queued to senders, by kind (failure = NDR).",
    ["kind"],
)
PICKUP_FILES = Counter(
    "mailrelay_pickup_files",
    "Files taken from the pickup and replay folders: submitted, or renamed .bad.",
    ["folder", "outcome"],
)

# Every series exists from the start (at 0), so rate() and absent() behave.
for _source in SOURCES:
    MESSAGES_ACCEPTED.labels(source=_source)
for _reason in FAILURE_REASONS:
    RECIPIENTS_FAILED.labels(reason=_reason)
for _class in REPLY_CLASSES:
    DELIVERY_ATTEMPTS.labels(reply_class=_class)
for _kind in DSN_KINDS:
    DSNS_SENT.labels(kind=_kind)
for _folder in ("pickup", "replay"):
    for _outcome in PICKUP_OUTCOMES:
        PICKUP_FILES.labels(folder=_folder, outcome=_outcome)


# --------------------------------------------------------------------------- helpers


def count_accepted(source: str) -> None:
    """One message committed (pickup and replay; the SMTP ingress counts its own)."""
    transaction.on_commit(lambda: MESSAGES_ACCEPTED.labels(source=source).inc())


def count_pickup_file(folder: str, outcome: str) -> None:
    PICKUP_FILES.labels(folder=folder, outcome=outcome).inc()
