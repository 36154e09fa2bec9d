"""The monitor of one ingress process, what it stores for every node, and how
operators see it: events, ``GET /api/v1/backpressure/`` and ``manage.py
backpressure``."""

from __future__ import annotations

import asyncio
import io
import json
import threading
from datetime import timedelta

import pytest
from django.core.management import call_command
from django.urls import path

from delivery.backpressure import store
from delivery.backpressure.api import BackPressureView
from delivery.backpressure.config import BackPressureConfig
from delivery.backpressure.engine import (
    GiB,
    PressureState,
    Resource,
    ResourceConfig,
    Sample,
    TarpitConfig,
)
from delivery.backpressure.monitor import Monitor
from delivery.backpressure.samplers import ManualSampler
from delivery.models import ResourcePressure
from queues.lib import clock
from queues.models import Event, EventLevel
from tests.support.operator_factories import api_client, make_user

urlpatterns = [path("api/v1/backpressure/", BackPressureView.as_view())]

RESOURCES = {
    Resource.DATABASE_DISK_SPACE: ResourceConfig(0, 0, 0),
    Resource.LOG_DISK_SPACE: ResourceConfig(0, 0, 0),
    Resource.VERSION_BUCKETS: ResourceConfig(80, 120, 200, 10),
    Resource.BATCH_POINTS: ResourceConfig(1000, 2000, 4000, 300),
    Resource.PRIVATE_BYTES: ResourceConfig(0, 0, 0, 30),
    Resource.PHYSICAL_MEMORY: ResourceConfig(0, 0, 94),
    Resource.SUBMISSION_QUEUE: ResourceConfig(2, 4, 10, 3),
}


def quiet_samplers() -> dict[Resource, ManualSampler]:
    """Every resource fed by hand, all normal: disks 50 % of 100 GB, memory 10 % of 8 GB."""
    samplers = {r: ManualSampler(0) for r in Resource}
    for resource in (Resource.DATABASE_DISK_SPACE, Resource.LOG_DISK_SPACE):
        samplers[resource].set(50, 100 * GiB, "/var/lib/postgresql")
    for resource in (Resource.PRIVATE_BYTES, Resource.PHYSICAL_MEMORY):
        samplers[resource].set(10, 8 * GiB)
    return samplers


def make_monitor(samplers, node="mx1:100", **config) -> Monitor:
    config.setdefault("interval", 3600.0)  # no ticks but the ones a test asks for
    return Monitor(
        BackPressureConfig(
            enabled=True, resources=RESOURCES, tarpit=TarpitConfig(10, 5, 55), node=node, **config
        ),
        samplers,
    )


class LoopThread:
    """An event loop in a thread, as in an ingress process; the test thread stays
    synchronous (so it may use the ORM) and runs coroutines there."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def run(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(10)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()


@pytest.fixture
def loop():
    running = LoopThread()
    yield running
    running.close()


# ----------------------------------------------------------------- the monitor


@pytest.mark.django_db(transaction=True)
def test_each_interval_stores_the_nodes_readings_and_every_level_change_as_an_event(loop):
    samplers = quiet_samplers()
    monitor = make_monitor(samplers)
    queue = samplers[Resource.SUBMISSION_QUEUE]
    loop.run(monitor.start())  # the first interval is taken at once
    try:
        rows = {r.resource: r for r in ResourcePressure.objects.filter(node="mx1:100")}
        assert set(rows) == {r.value for r in Resource}
        disk = rows["database_disk_space"]
        assert (disk.reading, disk.level, disk.normal, disk.medium, disk.high) == (
            50,
            "normal",
            95,
            97,
            99,
        )
        assert disk.note == "/var/lib/postgresql"

        queue.set(5)
        loop.run(monitor.tick())
        assert monitor.mail_from_decision(trusted=False).delay_seconds == 10
        loop.run(monitor.tick())
        assert monitor.mail_from_decision(trusted=False).delay_seconds == 15
        loop.run(monitor.tick())  # 3 intervals = the history depth
        assert monitor.mail_from_decision(trusted=False).refuse_reply.startswith("452 4.3.1")
        assert monitor.mail_from_decision(trusted=True).refuse_reply is None
        row = ResourcePressure.objects.get(node="mx1:100", resource="submission_queue")
        assert (row.level, row.pressure_intervals, row.history[-4:], row.action) == (
            "medium",
            3,
            "nmmm",
            "refuse untrusted",
        )

        queue.set(12)
        loop.run(monitor.tick())
        assert monitor.mail_from_decision(trusted=True).refuse_reply.startswith("452 4.3.1")
        queue.set(1)
        loop.run(monitor.tick())
        assert monitor.mail_from_decision(trusted=True).refuse_reply is None
    finally:
        loop.run(monitor.stop())

    events = list(Event.objects.filter(kind="backpressure").order_by("id"))
    assert [(e.level, e.data.get("old"), e.data.get("new")) for e in events] == [
        (EventLevel.ERROR, "normal", "medium"),
        (EventLevel.WARNING, None, None),  # the history depth ran out: refusing
        (EventLevel.ERROR, "medium", "high"),
        (EventLevel.INFO, "high", "normal"),
    ]
    up, depth, high, down = events
    assert up.data == {
        "node": "mx1:100",
        "resource": "submission_queue",
        "old": "normal",
        "new": "medium",
        "reading": 5.0,
        "thresholds": {"normal": 2, "medium": 4, "high": 10},
        "event_id": 15004,
    }
    assert up.text == (
        "Back pressure: submission queue rose from normal to medium on mx1:100 (reading 5 messages)"
    )
    assert "history depth (3 intervals)" in depth.text
    assert down.data["event_id"] == 15005 and down.data["reading"] == 1
    # A node that stops takes its rows away.
    assert not ResourcePressure.objects.filter(node="mx1:100").exists()
    assert monitor.counters == {"tarpitted": 2, "refused_untrusted": 1, "refused_trusted": 1}


@pytest.mark.django_db(transaction=True)
def test_a_reading_that_fails_is_not_monitored_and_the_others_still_count(loop):
    class Broken:
        def read(self):
            raise OSError("no route to broker")

    samplers = quiet_samplers()
    samplers[Resource.BATCH_POINTS] = Broken()
    samplers[Resource.PHYSICAL_MEMORY].set(95, 8 * GiB)
    monitor = make_monitor(samplers)
    loop.run(monitor.start())
    loop.run(monitor.stop())
    snapshot = monitor.snapshot
    batch = snapshot.status(Resource.BATCH_POINTS)
    assert batch.level is None and batch.note == "OSError: no route to broker"
    assert snapshot.trusted.refuse_reply.endswith("(physical memory); try again later")


def test_pickup_and_replay_stop_whenever_an_untrusted_client_would_be_refused():
    samplers = quiet_samplers()
    monitor = make_monitor(samplers)
    state = PressureState(RESOURCES, TarpitConfig(10, 5, 55))

    def judge(resource, value, total=None):
        readings = {r: s.read() for r, s in samplers.items()}
        readings[resource] = Sample(value, total or readings[resource].total)
        monitor.snapshot, _ = state.observe(readings)
        return monitor.allows_submission("pickup"), monitor.allows_submission("replay")

    assert judge(Resource.SUBMISSION_QUEUE, 0) == (True, True)
    assert judge(Resource.SUBMISSION_QUEUE, 5) == (True, True)  # tarpit: SMTP only
    assert judge(Resource.DATABASE_DISK_SPACE, 98) == (False, False)  # medium disk
    assert judge(Resource.DATABASE_DISK_SPACE, 50) == (True, True)
    assert judge(Resource.VERSION_BUCKETS, 250) == (False, False)  # high
    with pytest.raises(ValueError, match="unknown submission kind"):
        monitor.allows_submission("smtp")


def test_a_monitor_that_never_ran_accepts_everything():
    monitor = make_monitor(quiet_samplers())
    assert monitor.mail_from_decision(trusted=False).delay_seconds == 0
    assert monitor.allows_submission("pickup")


# ----------------------------------------------------------------- API and CLI


def save(node: str, **readings: float) -> None:
    samplers = quiet_samplers()
    for name, value in readings.items():
        samplers[Resource(name)].set(value)
    state = PressureState(RESOURCES, TarpitConfig(10, 5, 55))
    for _ in range(2):
        snapshot, transitions = state.observe({r: s.read() for r, s in samplers.items()})
    store.pressure_save(node, snapshot, transitions)


@pytest.mark.django_db
@pytest.mark.urls(__name__)
def test_the_api_shows_every_resource_of_every_node():
    save("mx1:100", submission_queue=5)
    save("mx2:200")
    ResourcePressure.objects.filter(node="mx2:200").update(
        updated_at=clock.now() - timedelta(minutes=5)
    )
    assert api_client(None).get("/api/v1/backpressure/").status_code == 401
    data = api_client(make_user("viewer")).get("/api/v1/backpressure/").json()
    assert [(n["node"], n["stale"]) for n in data["nodes"]] == [
        ("mx1:100", False),
        ("mx2:200", True),
    ]
    resources = data["nodes"][0]["resources"]
    assert [r["resource"] for r in resources] == [r.value for r in Resource]
    queue = resources[-1]
    assert {k: queue[k] for k in queue if k != "updated_at"} == {
        "resource": "submission_queue",
        "name": "submission queue",
        "exchange_name": "QueueLength[SubmissionQueue]",
        "reading": 5.0,
        "unit": "messages",
        "level": "medium",
        "thresholds": {"normal": 2.0, "medium": 4.0, "high": 10.0},
        "history_depth": 3,
        "pressure_intervals": 2,
        "history": ["medium", "medium"],
        "action": "tarpit",
        "delay_seconds": 15.0,
        "note": "",
    }


@pytest.mark.django_db
def test_the_command_prints_each_nodes_resources():
    save("mx1:100", submission_queue=5, physical_memory=93)
    out = io.StringIO()
    call_command("backpressure", stdout=out)
    lines = out.getvalue().splitlines()
    assert lines[0].startswith("node mx1:100 (updated ")
    assert lines[1].split() == [
        "RESOURCE",
        "READING",
        "LEVEL",
        "NORMAL",
        "MEDIUM",
        "HIGH",
        "HISTORY",
        "ACTION",
    ]
    table = {line[:28].strip(): line[28:].split() for line in lines[2:9]}
    assert table["submission queue"] == [
        "5",
        "medium",
        "2",
        "4",
        "10",
        "2/3",
        "mm",
        "tarpit",
        "15s",
    ]
    assert table["physical memory"] == [
        "93",
        "%",
        "medium",
        "90",
        "92",
        "94",
        "mm",
        "refuse",
        "untrusted",
    ]
    assert table["queue database disk space"][:6] == ["50", "%", "normal", "95", "97", "99"]
    assert "  queue database disk space: /var/lib/postgresql" in lines

    out = io.StringIO()
    call_command("backpressure", "--json", stdout=out)
    node = json.loads(out.getvalue())
    assert node["node"] == "mx1:100" and len(node["resources"]) == len(Resource)


@pytest.mark.django_db
def test_the_command_says_when_no_node_reports():
    out = io.StringIO()
    call_command("backpressure", stdout=out)
    assert "no ingress node" in out.getvalue()
