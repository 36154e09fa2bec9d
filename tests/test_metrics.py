"""GET /metrics: Prometheus text that parses, counters that count where things
happen, gauges read from the database, and sums over several processes.

Counters are process-wide and keep counting across tests, so each test
compares two scrapes. The tests commit for real (``transaction=True``):
counters count only what was committed.
"""

from __future__ import annotations

import os
import subprocess
import sys
from datetime import timedelta

import pytest
from django.conf import settings as django_settings
from django.db import DatabaseError
from prometheus_client.parser import text_string_to_metric_families

from delivery.metrics import StoreCollector
from delivery.models import ResourcePressure
from delivery.pickup import FolderConfig, FolderWatcher, Outcome
from delivery.qmgr.sweep import sweep
from queues.accept import IncomingEnvelope, IncomingRecipient, message_accept
from queues.lib import clock
from queues.models import DeliveryType, Message, Queue
from tests.support.pipeline import drain

pytestmark = pytest.mark.django_db(transaction=True)

BODY = b"From: s@example.org\r\nTo: x\r\nSubject: m\r\n\r\nbody\r\n"

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


@pytest.fixture(autouse=True)
def _single_process(monkeypatch):
    monkeypatch.delenv("PROMETHEUS_MULTIPROC_DIR", raising=False)


def scrape(client, **headers) -> Samples:
    response = client.get("/metrics", **headers)
    assert response.status_code == 200, response.content
    assert response["Content-Type"].startswith("text/plain; version=0.0.4")
    samples: Samples = {}
    for family in text_string_to_metric_families(response.content.decode()):
        for s in family.samples:
            samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return samples


def value(samples: Samples, name: str, **labels: str) -> float | None:
    return samples.get((name, tuple(sorted(labels.items()))))


def delta(after: Samples, before: Samples, name: str, **labels: str) -> float:
    return (value(after, name, **labels) or 0.0) - (value(before, name, **labels) or 0.0)


def accept(*rcpts: str, sender: str = "s@example.org") -> Message:
    return message_accept(
        IncomingEnvelope(
            mail_from=sender,
            recipients=[IncomingRecipient(r) for r in rcpts],
            client_address="127.0.0.1",
            client_helo="client.test",
        ),
        BODY,
    )


@pytest.fixture
def relay(dns_settings, settings, smtp_port):
    settings.MAILRELAY_REMOTE_SMTP_PORT = smtp_port
    settings.MAILRELAY_SMTP_CONNECT_TIMEOUT = timedelta(seconds=2)
    settings.MAILRELAY_SMTP_CLIENT_TIMEOUT = timedelta(seconds=5)
    return dns_settings


# --------------------------------------------------------------------------- the format


def test_it_serves_prometheus_text_with_every_metric_documented(client):
    samples = scrape(client)
    names = {name for name, _ in samples}
    for name in (
        "mailrelay_database_up",
        "mailrelay_messages",
        "mailrelay_queue_depth",
        "mailrelay_queue_oldest_message_age_seconds",
        "mailrelay_oldest_message_age_seconds",
        "mailrelay_messages_accepted_total",
        "mailrelay_recipients_delivered_total",
        "mailrelay_recipients_deferred_total",
        "mailrelay_recipients_failed_total",
        "mailrelay_delivery_attempts_total",
        "mailrelay_smtp_accept_seconds_bucket",
        "mailrelay_dsns_sent_total",
        "mailrelay_pickup_files_total",
        "mailrelay_metrics_multiprocess",
    ):
        assert name in names, name
    assert value(samples, "mailrelay_database_up") == 1
    assert value(samples, "mailrelay_metrics_multiprocess") == 0
    assert value(samples, "mailrelay_messages", state="submission") == 0
    assert value(samples, "mailrelay_oldest_message_age_seconds") == 0
    with open(os.path.join(django_settings.BASE_DIR, "docs", "metrics.md")) as fh:
        documented = fh.read()
    text = client.get("/metrics").content.decode()
    for family in text_string_to_metric_families(text):
        if family.name.startswith("mailrelay_"):
            assert f"`{family.name}" in documented, f"{family.name} is not in docs/metrics.md"


def test_it_refuses_a_scrape_without_the_token_when_one_is_set(client, settings):
    settings.MAILRELAY_METRICS_TOKEN = "s3cret"
    response = client.get("/metrics")
    assert response.status_code == 401
    assert response["WWW-Authenticate"].startswith("Bearer")
    assert client.get("/metrics", HTTP_AUTHORIZATION="Bearer wrong").status_code == 401
    samples = scrape(client, HTTP_AUTHORIZATION="Bearer s3cret")
    assert value(samples, "mailrelay_database_up") == 1


def test_without_a_token_only_the_allowed_networks_may_scrape(client, settings):
    """Without MAILRELAY_METRICS_TOKEN the metrics (which name every destination
    domain) go only to MAILRELAY_METRICS_ALLOWED_NETWORKS: loopback and private
    ranges by default."""
    settings.MAILRELAY_METRICS_TOKEN = ""
    assert client.get("/metrics", REMOTE_ADDR="192.0.2.1").status_code == 403
    assert client.get("/metrics", REMOTE_ADDR="127.0.0.1").status_code == 200
    assert client.get("/metrics", REMOTE_ADDR="10.1.2.3").status_code == 200
    settings.MAILRELAY_METRICS_TOKEN = "s3cret"  # a token: any network, with the token
    ok = client.get("/metrics", REMOTE_ADDR="192.0.2.1", HTTP_AUTHORIZATION="Bearer s3cret")
    assert ok.status_code == 200


def test_it_still_serves_the_counters_when_the_database_cannot_be_read(client, monkeypatch):
    def broken(self):
        raise DatabaseError("server closed the connection")
        yield  # pragma: no cover - a generator, as the real one

    monkeypatch.setattr(StoreCollector, "_store_metrics", broken)
    samples = scrape(client)
    assert value(samples, "mailrelay_database_up") == 0
    assert value(samples, "mailrelay_messages_accepted_total", source="smtp") is not None
    assert value(samples, "mailrelay_messages", state="queued") is None


# --------------------------------------------------------------------------- counters


def test_it_counts_smtp_accepts_and_their_latency(client, ingress):
    before = scrape(client)
    for i in range(2):
        code, _ = ingress.send(BODY, rcpt_to=[f"u{i}@example.net"])
        assert code == 250
    after = scrape(client)
    assert delta(after, before, "mailrelay_messages_accepted_total", source="smtp") == 2
    assert delta(after, before, "mailrelay_smtp_accept_seconds_count") == 2
    assert delta(after, before, "mailrelay_smtp_accept_seconds_bucket", le="+Inf") == 2
    assert 0 < delta(after, before, "mailrelay_smtp_accept_seconds_sum") < 20
    assert value(after, "mailrelay_messages", state="submission") == 2
    submission = {"queue": "Submission", "delivery_type": "submission"}
    assert value(after, "mailrelay_queue_depth", **submission) == 2


def test_it_counts_deliveries_by_outcome_reply_class_and_dsn(client, relay, sink_factory):
    relay.a("example.net", "127.0.0.2")
    relay.a("example.org", "127.0.0.2")  # where the NDR goes
    sink_factory(
        "127.0.0.2",
        rcpt_replies={"bad@example.net": "550 5.1.1 no such user"},
        rcpt_tempfail={"later@example.net": 1},
    )
    before = scrape(client)
    accept("good@example.net", "bad@example.net", "later@example.net")
    drain()
    clock.advance(timedelta(seconds=90))
    after = scrape(client)

    assert delta(after, before, "mailrelay_recipients_delivered_total") == 2  # good, and the NDR
    assert delta(after, before, "mailrelay_recipients_failed_total", reason="permanent") == 1
    assert delta(after, before, "mailrelay_recipients_deferred_total") == 1
    assert delta(after, before, "mailrelay_delivery_attempts_total", reply_class="2xx") == 2
    assert delta(after, before, "mailrelay_delivery_attempts_total", reply_class="4xx") == 1
    assert delta(after, before, "mailrelay_delivery_attempts_total", reply_class="5xx") == 1
    assert delta(after, before, "mailrelay_dsns_sent_total", kind="failure") == 1

    assert value(after, "mailrelay_messages", state="queued") == 1  # "later" waits
    assert value(after, "mailrelay_messages", state="submission") == 0  # the NDR went out
    queue = Queue.objects.get(delivery_type=DeliveryType.DNS_MX, name="example.net")
    labels = {"queue": queue.name, "delivery_type": "dns_mx"}
    assert value(after, "mailrelay_queue_depth", **labels) == 1
    assert value(after, "mailrelay_queue_oldest_message_age_seconds", **labels) >= 90
    assert value(after, "mailrelay_oldest_message_age_seconds") >= 90


def test_it_counts_routing_failures_of_the_categorizer(client, relay):
    relay.null_mx("nomail.example")
    before = scrape(client)
    accept("u@nomail.example", sender="")
    drain()
    after = scrape(client)
    assert delta(after, before, "mailrelay_recipients_failed_total", reason="permanent") == 1
    assert delta(after, before, "mailrelay_delivery_attempts_total", reply_class="none") == 1


def test_it_counts_delay_notices_and_expiry(client, relay, settings, sink_factory):
    relay.servfail("flaky.example")
    relay.a("example.org", "127.0.0.2")  # where the notices go
    sink = sink_factory("127.0.0.2")
    before = scrape(client)
    accept("u@flaky.example")
    drain()
    parked = scrape(client)
    unreachable = {"queue": "Unreachable", "delivery_type": "unreachable"}
    assert value(parked, "mailrelay_queue_depth", **unreachable) == 1
    assert value(parked, "mailrelay_messages", state="queued") == 1
    clock.advance(settings.MAILRELAY_DELAY_NOTIFICATION_TIMEOUT + timedelta(minutes=1))
    sweep()
    middle = scrape(client)
    assert delta(middle, before, "mailrelay_dsns_sent_total", kind="delay") == 1
    assert delta(middle, before, "mailrelay_recipients_deferred_total") == 1  # Unreachable
    drain()
    assert len(sink.messages) == 1  # the delay notice
    clock.advance(settings.MAILRELAY_MESSAGE_EXPIRATION_TIMEOUT)
    sweep()
    after = scrape(client)
    assert delta(after, before, "mailrelay_recipients_failed_total", reason="expired") == 1
    assert delta(after, before, "mailrelay_dsns_sent_total", kind="failure") == 1


def test_it_counts_files_of_the_pickup_folder(client, tmp_path, settings):
    settings.MAILRELAY_PICKUP_DIR = str(tmp_path)
    (tmp_path / "good.eml").write_bytes(b"From: s@example.org\r\nTo: x@example.net\r\n\r\nb\r\n")
    (tmp_path / "bad.eml").write_bytes(b"no header\r\n")
    watcher = FolderWatcher(FolderConfig.from_settings("pickup"))
    before = scrape(client)
    watcher.poll()
    statuses = sorted(o.status for o in watcher.poll())
    assert statuses == [Outcome.BAD, Outcome.SUBMITTED]
    after = scrape(client)
    assert delta(after, before, "mailrelay_messages_accepted_total", source="pickup") == 1
    assert delta(after, before, "mailrelay_pickup_files_total", folder="pickup", outcome="bad") == 1
    submitted = {"folder": "pickup", "outcome": "submitted"}
    assert delta(after, before, "mailrelay_pickup_files_total", **submitted) == 1


# --------------------------------------------------------------------------- back pressure


def test_it_shows_every_back_pressure_resource_of_every_node(client):
    now = clock.now()
    common = {"updated_at": now, "history": "nm", "action": ""}
    ResourcePressure.objects.create(
        node="ingress-1",
        resource="submission_queue",
        reading=2500,
        level="medium",
        normal=2000,
        medium=4000,
        high=10000,
        history_depth=300,
        delay_seconds=15,
        **common,
    )
    ResourcePressure.objects.create(
        node="ingress-1", resource="log_disk_space", reading=None, level="not_monitored", **common
    )
    ResourcePressure.objects.create(
        node="ingress-2", resource="physical_memory", reading=95.5, level="high", high=94, **common
    )
    samples = scrape(client)
    one = {"node": "ingress-1", "resource": "submission_queue"}
    assert value(samples, "mailrelay_backpressure_reading", **one) == 2500
    assert value(samples, "mailrelay_backpressure_level", **one) == 1
    assert value(samples, "mailrelay_backpressure_threshold", level="high", **one) == 10000
    assert value(samples, "mailrelay_backpressure_tarpit_delay_seconds", **one) == 15
    off = {"node": "ingress-1", "resource": "log_disk_space"}
    assert value(samples, "mailrelay_backpressure_level", **off) == -1
    assert value(samples, "mailrelay_backpressure_reading", **off) is None
    two = {"node": "ingress-2", "resource": "physical_memory"}
    assert value(samples, "mailrelay_backpressure_level", **two) == 2
    assert value(samples, "mailrelay_backpressure_reading", **two) == 95.5
    stamp = value(samples, "mailrelay_backpressure_updated_timestamp_seconds", node="ingress-2")
    assert stamp == pytest.approx(now.timestamp())


# --------------------------------------------------------------------------- processes


COUNT_IN_ANOTHER_PROCESS = """
from queues import counters
counters.MESSAGES_ACCEPTED.labels(source="smtp").inc(3)
counters.SMTP_ACCEPT_SECONDS.observe(0.02)
counters.DSNS_SENT.labels(kind="delay").inc()
"""


def test_it_sums_the_counters_of_every_process(client, tmp_path, monkeypatch):
    """Ingress and workers count in their own processes; the web process sums the files."""
    env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(tmp_path)}
    for _ in range(2):
        subprocess.run(
            [sys.executable, "-c", COUNT_IN_ANOTHER_PROCESS],
            env=env,
            cwd=django_settings.BASE_DIR,
            check=True,
            timeout=60,
        )
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(tmp_path))
    accept("u@example.net")
    samples = scrape(client)
    assert value(samples, "mailrelay_metrics_multiprocess") == 1
    assert value(samples, "mailrelay_messages_accepted_total", source="smtp") == 6
    assert value(samples, "mailrelay_smtp_accept_seconds_count") == 2
    assert value(samples, "mailrelay_smtp_accept_seconds_bucket", le="0.025") == 2
    assert value(samples, "mailrelay_dsns_sent_total", kind="delay") == 2
    assert value(samples, "mailrelay_dsns_sent_total", kind="failure") == 0
    # the database facts come along, read once, not per process
    assert value(samples, "mailrelay_messages", state="submission") == 1
