"""Prometheus instruments: the counters and histograms every process increments.

A leaf module (prometheus_client, django.db.transaction and the leaf
``queues.lib`` only, for the DSN kinds), so the queue store, the engine and
the SMTP ingress can all import it without an import cycle — as they import
settings. What is a fact of the database (messages by state, queue depth,
back-pressure readings) is not counted here: ``delivery.metrics`` reads it
at scrape time (this module is ``counters``, not ``metrics``, so the two
never shadow each other).

Several processes (ingress, workers, web) each count their own events. With
``PROMETHEUS_MULTIPROC_DIR`` set in the environment of every process
*before it starts* (prometheus_client reads it on import), each process
writes its values to files in that folder and ``GET /metrics`` sums them;
see docs/metrics.md.

The ``record_*``/``count_*`` helpers count only what was committed: called
inside a transaction they wait for the commit (``transaction.on_commit``),
outside one they count at once.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Iterable
from typing import Any, TypeVar

from django.db import transaction
from prometheus_client import Counter, Histogram, disable_created_metrics

from queues.lib import DSN_KINDS

T = TypeVar("T")

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


def reply_class(code: int | None) -> str:
    """``250`` → "2xx"; None (no reply at all) → "none"."""
    if code is None or not 200 <= code < 600:
        return "none"
    return f"{code // 100}xx"


def _failure_reason(code: int | None, enhanced: str) -> str:
    # A recipient made final while its last answer was temporary ran out of retries.
    if (code is not None and 400 <= code < 500) or enhanced.startswith("4."):
        return "retry_timeout"
    return "permanent"


# --------------------------------------------------------------------------- helpers


async def timed_accept(awaitable: Awaitable[T], source: str = "smtp") -> T:
    """Await a message's commit, timing it; count it accepted when it succeeded.

    The ingress wraps its store call: ``qid = await metrics.timed_accept(server.store(...))``.
    """
    started = time.perf_counter()
    result = await awaitable
    SMTP_ACCEPT_SECONDS.observe(time.perf_counter() - started)
    MESSAGES_ACCEPTED.labels(source=source).inc()
    return result


def count_accepted(source: str) -> None:
    """One message committed (pickup and replay; the ingress uses timed_accept)."""
    transaction.on_commit(lambda: MESSAGES_ACCEPTED.labels(source=source).inc())


def record_delivery(attempts: Iterable[Any], recipients: Iterable[Any] | None = None) -> None:
    """Count one round's attempts by reply class, and its recipients' outcomes.

    ``attempts``: Attempt-like objects (``code``, ``enhanced``, ``outcome``).
    ``recipients``: the rows as the round left them (``state``, ``last_code``,
    ``last_enhanced``); without them the outcomes are the attempts' own (the
    categorizer's routing failures, where the two are the same).
    """
    classes: dict[str, int] = {}
    for a in attempts:
        key = reply_class(a.code)
        classes[key] = classes.get(key, 0) + 1
    delivered = deferred = 0
    failed: dict[str, int] = {}
    if recipients is None:
        rows = [(a.outcome, a.code, a.enhanced) for a in attempts]
    else:
        rows = [(r.state, r.last_code, r.last_enhanced) for r in recipients]
    for state, code, enhanced in rows:
        if state == "delivered":
            delivered += 1
        elif state == "deferred":
            deferred += 1
        elif state == "failed":
            reason = _failure_reason(code, enhanced or "")
            failed[reason] = failed.get(reason, 0) + 1

    def count() -> None:
        for key, n in classes.items():
            DELIVERY_ATTEMPTS.labels(reply_class=key).inc(n)
        if delivered:
            RECIPIENTS_DELIVERED.inc(delivered)
        if deferred:
            RECIPIENTS_DEFERRED.inc(deferred)
        for reason, n in failed.items():
            RECIPIENTS_FAILED.labels(reason=reason).inc(n)

    transaction.on_commit(count)


def count_expired(recipients: int) -> None:
    """Recipients failed because their message expired (the sweep)."""
    if recipients:
        transaction.on_commit(lambda: RECIPIENTS_FAILED.labels(reason="expired").inc(recipients))


def count_dsn(kind: str) -> None:
    """One DSN of ``kind`` (queues.bounce.dsn.FAILURE / DELAY / SUCCESS) queued."""
    transaction.on_commit(lambda: DSNS_SENT.labels(kind=kind).inc())


def count_pickup_file(folder: str, outcome: str) -> None:
    PICKUP_FILES.labels(folder=folder, outcome=outcome).inc()
