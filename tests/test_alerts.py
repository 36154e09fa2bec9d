"""Age alerts: raised and cleared (Events), per-queue overrides, the API, the top
bar, the gauge; the Prometheus rules file names only exported metrics."""

from __future__ import annotations

import re
from datetime import timedelta
from pathlib import Path

import pytest
import yaml
from django.test import Client

from delivery.metrics import scrape_registry
from insight import alerts
from insight.models import AlertState
from insight.tasks import refresh
from queues.lib import clock
from queues.models import Event, Message, Queue
from tests.support.operator_factories import api_client, make_message, make_queue, make_user

pytestmark = pytest.mark.django_db

RULES = Path(__file__).resolve().parent.parent / "docs" / "prometheus-alerts.yml"


def _age(queue: Queue, age: timedelta) -> None:
    """The queue holds a message that old (a page read recounts the queues, so the
    age on the queue row must be true of what it holds)."""
    held = Message.objects.filter(recipients__queue=queue).first()
    if held is None:
        held = make_message(f"u@{queue.name}", queue=queue)
    Message.objects.filter(pk=held.pk).update(received_at=clock.now() - age)
    Queue.objects.filter(pk=queue.pk).update(oldest_received_at=clock.now() - age)


def _scrape() -> str:
    from prometheus_client.exposition import generate_latest

    return generate_latest(scrape_registry("")).decode()


def test_an_age_alert_is_raised_escalated_and_cleared(settings):
    settings.MAILRELAY_ALERT_OLDEST_AGE = timedelta(hours=1)
    q = make_queue("slow.example")
    _age(q, timedelta(minutes=30))
    assert alerts.evaluate(clock.now()) == []
    _age(q, timedelta(minutes=70))
    raised = alerts.evaluate(clock.now())
    assert [(a.queue_id, a.level) for a in raised] == [(q.pk, "warning")]
    ev = Event.objects.filter(kind="alert").order_by("id")
    assert [e.level for e in ev] == ["warning"] and "raised" in ev[0].text
    # Evaluating again changes nothing and records nothing.
    alerts.evaluate(clock.now())
    assert Event.objects.filter(kind="alert").count() == 1
    _age(q, timedelta(hours=3))
    assert alerts.evaluate(clock.now())[0].level == "critical"
    assert Event.objects.filter(kind="alert").order_by("-id")[0].level == "error"
    _age(q, timedelta(minutes=1))
    refresh()  # the periodic task evaluates too
    assert AlertState.objects.count() == 0
    last = Event.objects.filter(kind="alert").order_by("-id")[0]
    assert last.level == "info" and "cleared" in last.text and last.queue_id == q.pk


def test_per_queue_overrides_and_the_api_top_bar_and_gauge(settings, client: Client):
    settings.MAILRELAY_ALERT_OLDEST_AGE = timedelta(hours=1)
    settings.MAILRELAY_ALERT_OLDEST_AGE_QUEUES = {
        "patient.example": timedelta(hours=6),
        "off.example": timedelta(0),
    }
    strict = make_queue("strict.example")
    patient = make_queue("patient.example")
    off = make_queue("off.example")
    for q in (strict, patient, off):
        _age(q, timedelta(minutes=90))
    api = api_client(make_user("viewer"))
    # The GET reads what the periodic task stored: before it runs, nothing.
    assert api.get("/api/v1/alerts/").json() == {"alerts": []}
    assert AlertState.objects.count() == 0 and not Event.objects.filter(kind="alert").exists()
    refresh()  # beat
    body = api.get("/api/v1/alerts/").json()
    assert [(a["queue"]["name"], a["level"]) for a in body["alerts"]] == [
        ("strict.example", "warning")
    ]
    assert body["alerts"][0]["threshold_seconds"] == 3600
    # The GET never writes: an aged queue is not raised, nor a recovered one cleared,
    # until the task runs again.
    _age(strict, timedelta(minutes=1))
    _age(patient, timedelta(hours=13))
    for _ in range(2):
        again = api.get("/api/v1/alerts/").json()["alerts"]
        assert [(a["queue"]["name"], a["level"]) for a in again] == [("strict.example", "warning")]
    assert Event.objects.filter(kind="alert").count() == 1
    refresh()
    body = api.get("/api/v1/alerts/").json()
    assert [(a["queue"]["name"], a["level"]) for a in body["alerts"]] == [
        ("patient.example", "critical")
    ]
    assert Event.objects.filter(kind="alert").count() == 3  # raised, raised, cleared
    _age(patient, timedelta(minutes=90))
    _age(strict, timedelta(minutes=90))
    refresh()
    client.force_login(make_user("viewer", "v2"))
    page = client.get("/queues/").content.decode()
    assert 'data-alert-level="warning"' in page and "1 age alert (warning)" in page
    text = _scrape()
    assert 'mailrelay_queue_age_alert{delivery_type="dns_mx",queue="strict.example"} 1.0' in text
    assert 'mailrelay_queue_age_alert{delivery_type="dns_mx",queue="patient.example"} 0.0' in text
    assert (
        'mailrelay_queue_age_alert_threshold_seconds{delivery_type="dns_mx",'
        'queue="patient.example"} 21600.0' in text
    )
    assert 'mailrelay_alerts_active{kind="oldest_age",level="warning"} 1.0' in text


def test_the_prometheus_rules_file_names_only_exported_metrics():
    doc = yaml.safe_load(RULES.read_text())
    exprs = [r["expr"] for g in doc["groups"] for r in g["rules"]]
    names = {r["alert"] for g in doc["groups"] for r in g["rules"]}
    assert {"MailrelayQueueOldMail", "MailrelayQueuesInRetry", "MailrelayPoisonMessages"} <= names
    assert {"MailrelayDeadLetterGrowing", "MailrelayBackPressure"} <= names
    used = {m for e in exprs for m in re.findall(r"\bmailrelay_[a-z_]+", str(e))}
    assert used
    # Make every gauge appear: a queue in Retry, an alert, a back-pressure row.
    q = make_queue("down.example")
    q.link.state = "retry"
    q.link.save()
    _age(q, timedelta(hours=5))
    alerts.evaluate(clock.now())
    from delivery.models import ResourcePressure

    ResourcePressure.objects.create(
        node="n1", resource="submission_queue", reading=1, level="normal", updated_at=clock.now()
    )
    text = _scrape()
    exported = set(re.findall(r"^# TYPE (\S+) ", text, re.M))
    # Counters are exported as <name> with samples <name>_total.
    exported |= {f"{n}_total" for n in exported}
    missing = sorted(m for m in used if m not in exported)
    assert not missing, f"not exported: {missing}"
