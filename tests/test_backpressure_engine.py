"""Back-pressure levels and actions as tables: thresholds and Exchange's formulas,
hysteresis, history depth, tarpit start/step/max, and who is refused."""

from __future__ import annotations

import os
import socket
from datetime import timedelta

import pytest
from django.core.exceptions import ImproperlyConfigured

from delivery.backpressure.config import BackPressureConfig
from delivery.backpressure.engine import (
    ACCEPT,
    GiB,
    Level,
    MiB,
    PressureState,
    Resource,
    ResourceConfig,
    ResourceTracker,
    Sample,
    TarpitConfig,
    Thresholds,
    decide,
    disk_high_percent,
    next_level,
    private_bytes_high_percent,
    resolve_thresholds,
)
from tests.support.environment import settings_from_environment

N, M, H = Level.NORMAL, Level.MEDIUM, Level.HIGH
TiB = 1024 * GiB


# Exchange's defaults (normal, medium, high, history depth; a percentage of 0 = the formula),
# written out here so that a changed default in mailrelay/settings.py fails a test.
EXCHANGE = {
    Resource.DATABASE_DISK_SPACE: ResourceConfig(0, 0, 0, None),
    Resource.LOG_DISK_SPACE: ResourceConfig(0, 0, 0, None),
    Resource.VERSION_BUCKETS: ResourceConfig(80, 120, 200, 10),
    Resource.BATCH_POINTS: ResourceConfig(1000, 2000, 4000, 300),
    Resource.PRIVATE_BYTES: ResourceConfig(0, 0, 0, 30),
    Resource.PHYSICAL_MEMORY: ResourceConfig(0, 0, 94, None),
    Resource.SUBMISSION_QUEUE: ResourceConfig(2000, 4000, 10000, 300),
}


def exchange(resource: Resource) -> ResourceConfig:
    return EXCHANGE[resource]


# ----------------------------------------------------------------- thresholds


@pytest.mark.parametrize(
    ("size", "high"),
    [
        (1 * TiB, 99),  # Exchange's own example: 100*(1048576-500)/1048576 = 99.95 -> 99
        (100 * GiB, 99),  # 99.51 -> 99
        (25 * GiB, 98),  # "98 % requires a drive of approximately 25 GB or less"
        (10 * GiB, 95),  # 95.11 -> 95
        (1 * GiB, 51),  # 51.17 -> 51
        (500 * MiB, 0),  # nothing left to use
        (100 * MiB, 0),  # smaller than the reserve: never below 0
    ],
)
def test_the_queue_database_disk_formula_keeps_500_mb_free_rounded_down(size, high):
    assert disk_high_percent(size, 500 * MiB) == high
    t = resolve_thresholds(
        Resource.DATABASE_DISK_SPACE, exchange(Resource.DATABASE_DISK_SPACE), size
    )
    assert t == Thresholds(max(0, high - 4), max(0, high - 2), high)


@pytest.mark.parametrize(
    ("size", "high"),
    [
        (1 * TiB, 99),  # min(5 GB, 3 * 384 MB) = 1152 MB reserved
        (100 * GiB, 98),  # 100 * (102400 - 1152) / 102400 = 98.875 -> 98
        (20 * GiB, 94),  # 94.375 -> 94
        (2 * GiB, 43),  # 43.75 -> 43
    ],
)
def test_the_transaction_log_disk_formula_keeps_min_5gb_or_3_checkpoint_depths_free(size, high):
    t = resolve_thresholds(Resource.LOG_DISK_SPACE, exchange(Resource.LOG_DISK_SPACE), size)
    assert t == Thresholds(high - 4, high - 2, high)


@pytest.mark.parametrize(
    ("ram", "high"),
    [
        (8 * GiB, 75),
        (1 * TiB, 75),
        (2 * TiB, 50),  # 1 TB is the smaller: 50 % of 2 TB
        (4 * TiB, 25),
    ],
)
def test_private_bytes_high_is_75_percent_of_memory_or_1_tb_whichever_is_less(ram, high):
    assert private_bytes_high_percent(ram) == high
    t = resolve_thresholds(Resource.PRIVATE_BYTES, exchange(Resource.PRIVATE_BYTES), ram)
    assert t == Thresholds(high - 4, high - 2, high)


def test_physical_memory_is_high_at_94_percent_and_medium_normal_2_and_4_below():
    t = resolve_thresholds(Resource.PHYSICAL_MEMORY, exchange(Resource.PHYSICAL_MEMORY), 8 * GiB)
    assert t == Thresholds(90, 92, 94)


@pytest.mark.parametrize(
    ("given", "expected"),
    [
        ((0, 0, 0), (95, 97, 99)),  # all from the formula
        ((0, 0, 90), (86, 88, 90)),  # high given: medium 2 below it, normal 2 below medium
        ((0, 80, 90), (78, 80, 90)),  # normal 0: 2 below the medium given
        ((50, 80, 90), (50, 80, 90)),  # all given
    ],
)
def test_a_percentage_of_zero_means_the_formula(given, expected):
    config = ResourceConfig(*given)
    assert resolve_thresholds(Resource.DATABASE_DISK_SPACE, config, 1 * TiB) == Thresholds(
        *expected
    )


def test_a_formula_without_the_size_it_needs_gives_no_thresholds():
    assert resolve_thresholds(Resource.DATABASE_DISK_SPACE, ResourceConfig(0, 0, 0), None) is None


@pytest.mark.parametrize(
    ("resource", "thresholds"),
    [
        (Resource.VERSION_BUCKETS, (80, 120, 200)),
        (Resource.BATCH_POINTS, (1000, 2000, 4000)),
        (Resource.SUBMISSION_QUEUE, (2000, 4000, 10000)),
    ],
)
def test_count_resources_have_exchanges_thresholds(resource, thresholds):
    assert resolve_thresholds(resource, exchange(resource)) == Thresholds(*thresholds)


# ----------------------------------------------------------------- hysteresis

SQ = Thresholds(2000, 4000, 10000)


@pytest.mark.parametrize(
    ("current", "reading", "level"),
    [
        (N, 1999, N),
        (N, 3999, N),  # above normal, below medium: still normal on the way up
        (N, 4000, M),  # reaching medium
        (N, 9999, M),
        (N, 10000, H),  # straight to high
        (M, 3999, M),  # on the way down medium holds until below normal
        (M, 2000, M),
        (M, 1999, N),
        (M, 10000, H),
        (H, 9999, H),  # high holds down to medium
        (H, 4000, H),
        (H, 3999, M),
        (H, 2000, M),
        (H, 1999, N),  # below normal: straight to normal
    ],
)
def test_levels_rise_at_a_threshold_and_fall_only_below_the_next_lower_one(current, reading, level):
    assert next_level(current, reading, SQ) is level


# ----------------------------------------------------------------- trackers and actions

TARPIT = TarpitConfig(start=10, step=5, max=55)


def run(tracker: ResourceTracker, readings: list[float | None]) -> list[tuple]:
    out = []
    for reading in readings:
        tracker.observe(Sample(reading, 1 * TiB))
        status = tracker.status()
        out.append((status.level_name, status.action.value, status.delay))
    return out


def test_version_buckets_tarpit_from_10s_by_5s_then_refuse_after_the_history_depth():
    tracker = ResourceTracker(Resource.VERSION_BUCKETS, exchange(Resource.VERSION_BUCKETS), TARPIT)
    steps = run(tracker, [10, 130] + [130] * 10)
    assert steps == [
        ("normal", "", 0),
        ("medium", "tarpit", 10),  # interval 1 under pressure
        ("medium", "tarpit", 15),
        ("medium", "tarpit", 20),
        ("medium", "tarpit", 25),
        ("medium", "tarpit", 30),
        ("medium", "tarpit", 35),
        ("medium", "tarpit", 40),
        ("medium", "tarpit", 45),
        ("medium", "tarpit", 50),  # interval 9
        ("medium", "refuse untrusted", 0),  # interval 10 = the history depth: refuse
        ("medium", "refuse untrusted", 0),
    ]
    assert tracker.pressure_intervals == 11


def test_the_tarpit_delay_stops_at_its_maximum():
    config = ResourceConfig(2000, 4000, 10000, 300)
    tracker = ResourceTracker(Resource.SUBMISSION_QUEUE, config, TARPIT)
    delays = [d for _, _, d in run(tracker, [5000] * 14)]
    assert delays == [10, 15, 20, 25, 30, 35, 40, 45, 50, 55, 55, 55, 55, 55]


def test_as_pressure_eases_the_delay_comes_down_step_by_step():
    config = ResourceConfig(2000, 4000, 10000, 300)
    tracker = ResourceTracker(Resource.SUBMISSION_QUEUE, config, TARPIT)
    run(tracker, [5000] * 5)  # delay 30
    steps = run(tracker, [3000, 1000, 1000, 1000, 1000, 1000, 1000, 1000, 5000])
    assert steps == [
        ("medium", "tarpit", 35),  # above normal: still medium (hysteresis), still rising
        ("normal", "tarpit", 30),  # back to normal: down one step per interval
        ("normal", "tarpit", 25),
        ("normal", "tarpit", 20),
        ("normal", "tarpit", 15),
        ("normal", "tarpit", 10),
        ("normal", "tarpit", 5),
        ("normal", "", 0),
        ("medium", "tarpit", 10),  # a new episode starts again at the start delay
    ]


def test_a_refusal_after_the_history_depth_lasts_until_the_resource_is_normal_again():
    config = ResourceConfig(2, 4, 10, 3)
    tracker = ResourceTracker(Resource.BATCH_POINTS, config, TARPIT)
    steps = [action for _, action, _ in run(tracker, [5, 5, 5, 3, 3, 1, 5])]
    # 3 intervals medium -> refuse; 3 is above normal: still medium, still refused;
    # 1: normal, the left-over delay tarpits; 5: a new episode tarpits first.
    assert steps == [
        "tarpit",
        "tarpit",
        "refuse untrusted",
        "refuse untrusted",
        "refuse untrusted",
        "tarpit",
        "tarpit",
    ]


@pytest.mark.parametrize(
    ("resource", "total"),
    [
        (Resource.DATABASE_DISK_SPACE, 100 * GiB),
        (Resource.LOG_DISK_SPACE, 100 * GiB),
        (Resource.PHYSICAL_MEMORY, 8 * GiB),
    ],
)
def test_medium_disk_and_memory_refuse_untrusted_at_once_and_high_refuses_everyone(resource, total):
    tracker = ResourceTracker(resource, exchange(resource), TARPIT)
    t = resolve_thresholds(resource, exchange(resource), total)
    assert t is not None
    actions = []
    for reading in (t.normal - 1, t.medium, t.high, t.medium, t.normal - 1):
        tracker.observe(Sample(reading, total))
        actions.append((tracker.level_name, tracker.action.value))
    assert actions == [
        ("normal", ""),
        ("medium", "refuse untrusted"),
        ("high", "refuse all"),
        ("high", "refuse all"),  # hysteresis: high holds down to medium
        ("normal", ""),
    ]


def test_private_bytes_refuse_untrusted_only_after_their_history_depth():
    config = ResourceConfig(0, 0, 0, 3)
    tracker = ResourceTracker(Resource.PRIVATE_BYTES, config, TARPIT)
    actions = []
    for reading in (50, 74, 74, 74, 80, 60):
        tracker.observe(Sample(reading, 8 * GiB))
        actions.append((tracker.level_name, tracker.action.value))
    assert actions == [
        ("normal", ""),
        ("medium", ""),  # a spike is not acted upon...
        ("medium", ""),
        ("medium", "refuse untrusted"),  # ...but 3 intervals (the history depth) are
        ("high", "refuse all"),  # high: everyone, at once
        ("normal", ""),
    ]


def test_high_refuses_everyone_at_once_even_for_a_tarpit_resource():
    tracker = ResourceTracker(
        Resource.SUBMISSION_QUEUE, EXCHANGE[Resource.SUBMISSION_QUEUE], TARPIT
    )
    tracker.observe(Sample(10000))
    assert tracker.action.value == "refuse all"


def test_an_unreadable_resource_is_not_monitored_and_takes_no_action():
    tracker = ResourceTracker(Resource.VERSION_BUCKETS, ResourceConfig(1, 2, 3, 5), TARPIT)
    assert tracker.observe(Sample.unreadable("no idea")) is None  # first interval: no event
    assert tracker.status().level is None
    assert tracker.status().level_name == "not_monitored"
    assert tracker.observe(Sample(3)).new == "high"
    went = tracker.observe(Sample.unreadable("gone"))
    assert (went.old, went.new) == ("high", "not_monitored")
    assert tracker.action.value == "" and tracker.pressure_intervals == 0
    assert tracker.status().history == "-h-"


def test_level_changes_are_reported_once_each():
    tracker = ResourceTracker(
        Resource.SUBMISSION_QUEUE, EXCHANGE[Resource.SUBMISSION_QUEUE], TARPIT
    )
    changes = []
    for reading in (0, 4000, 5000, 10000, 3000, 1000, 1000):
        transition = tracker.observe(Sample(reading))
        if transition is not None:
            changes.append((transition.old, transition.new, transition.rising))
    assert changes == [
        ("normal", "medium", True),
        ("medium", "high", True),
        ("high", "medium", False),
        ("medium", "normal", False),
    ]


# ----------------------------------------------------------------- decisions


def statuses(**readings: float):
    state = PressureState(
        {
            Resource.SUBMISSION_QUEUE: ResourceConfig(2, 4, 10, 300),
            Resource.VERSION_BUCKETS: ResourceConfig(2, 4, 10, 300),
            Resource.PHYSICAL_MEMORY: ResourceConfig(0, 0, 94),
        },
        TarpitConfig(start=10, step=5, max=55),
    )
    snapshot, _ = state.observe(
        {Resource(name): Sample(value, 8 * GiB) for name, value in readings.items()}
    )
    return snapshot


def test_trusted_clients_pass_medium_while_untrusted_are_tarpitted_by_the_longest_delay():
    snapshot = statuses(submission_queue=5, version_buckets=0, physical_memory=10)
    assert snapshot.trusted == ACCEPT
    assert snapshot.untrusted.delay_seconds == 10 and snapshot.untrusted.refuse_reply is None


def test_medium_memory_refuses_untrusted_only_naming_the_resource():
    snapshot = statuses(submission_queue=0, version_buckets=0, physical_memory=92.5)
    assert snapshot.trusted == ACCEPT
    assert snapshot.untrusted.refuse_reply.startswith("452 4.3.1 Insufficient system resources")
    assert "physical memory" in snapshot.untrusted.refuse_reply


def test_high_anything_refuses_trusted_clients_too():
    snapshot = statuses(submission_queue=0, version_buckets=11, physical_memory=10)
    assert snapshot.trusted.refuse_reply.startswith("452 4.3.1")
    assert "version buckets" in snapshot.trusted.refuse_reply
    assert decide(snapshot.statuses.values(), trusted=False).refuse_reply is not None


def test_nothing_under_pressure_accepts_everyone():
    snapshot = statuses(submission_queue=1, version_buckets=1, physical_memory=10)
    assert snapshot.trusted == ACCEPT and snapshot.untrusted == ACCEPT


# ----------------------------------------------------------------- settings


def test_settings_shrink_intervals_and_override_thresholds(settings):
    settings.MAILRELAY_BP_MONITORING_INTERVAL = timedelta(milliseconds=50)
    settings.MAILRELAY_BP_TARPIT_START = timedelta(milliseconds=200)
    settings.MAILRELAY_BP_TARPIT_STEP = timedelta(milliseconds=50)
    settings.MAILRELAY_BP_TARPIT_MAX = timedelta(milliseconds=400)
    settings.MAILRELAY_BP_SUBMISSION_QUEUE_NORMAL = 3
    settings.MAILRELAY_BP_SUBMISSION_QUEUE_MEDIUM = 6
    settings.MAILRELAY_BP_SUBMISSION_QUEUE_HIGH = 12
    settings.MAILRELAY_BP_SUBMISSION_QUEUE_HISTORY_DEPTH = 20
    settings.MAILRELAY_BP_DATABASE_DISK_SPACE_HIGH = 90
    settings.MAILRELAY_NODE_NAME = "mx1"
    config = BackPressureConfig.from_settings()
    assert config.interval == 0.05
    assert config.tarpit == TarpitConfig(0.2, 0.05, 0.4)
    assert config.resources[Resource.SUBMISSION_QUEUE] == ResourceConfig(3, 6, 12, 20)
    assert config.resources[Resource.DATABASE_DISK_SPACE] == ResourceConfig(0, 0, 90, None)
    assert config.resources[Resource.VERSION_BUCKETS] == ResourceConfig(80, 120, 200, 10)
    assert config.node == "mx1"


def test_settings_default_to_exchange(settings, monkeypatch):
    settings_from_environment(settings, monkeypatch)  # settings.py with no MAILRELAY_* set
    config = BackPressureConfig.from_settings()
    assert config.enabled is True
    assert config.interval == 2.0
    assert config.tarpit == TarpitConfig(10, 5, 55)
    assert config.resources == EXCHANGE
    assert (config.database_path, config.log_path) == ("", "")
    assert config.node == f"{socket.gethostname()}:{os.getpid()}"


def test_settings_come_from_the_environment_through_settings_py(settings, monkeypatch):
    settings_from_environment(
        settings,
        monkeypatch,
        MAILRELAY_BP_BATCH_POINTS_HIGH="5000",
        MAILRELAY_BP_TARPIT_MAX="00:01:00",
        MAILRELAY_BP_ENABLED="false",
        MAILRELAY_NODE_NAME="mx2",
    )
    config = BackPressureConfig.from_settings()
    assert config.interval == 2.0
    assert config.tarpit == TarpitConfig(10, 5, 60)
    assert config.resources[Resource.BATCH_POINTS] == ResourceConfig(1000, 2000, 5000, 300)
    assert config.resources[Resource.PRIVATE_BYTES] == ResourceConfig(0, 0, 0, 30)
    assert config.resources[Resource.PHYSICAL_MEMORY] == ResourceConfig(0, 0, 94, None)
    assert config.enabled is False and config.node == "mx2"


def test_a_bad_environment_value_stops_start_up_naming_the_variable(settings, monkeypatch):
    with pytest.raises(ImproperlyConfigured, match="MAILRELAY_BP_BATCH_POINTS_HIGH"):
        settings_from_environment(settings, monkeypatch, MAILRELAY_BP_BATCH_POINTS_HIGH="many")


@pytest.mark.parametrize(
    ("name", "value", "message"),
    [
        ("MAILRELAY_BP_SUBMISSION_QUEUE_MEDIUM", 1, "must not decrease"),
        ("MAILRELAY_BP_VERSION_BUCKETS_HISTORY_DEPTH", 0, "at least 1"),
        ("MAILRELAY_BP_PRIVATE_BYTES_HIGH", 101, "a percentage"),
        ("MAILRELAY_BP_BATCH_POINTS_HIGH", -1, "negative"),
        ("MAILRELAY_BP_TARPIT_START", timedelta(seconds=90), "START at most MAX"),
        ("MAILRELAY_BP_MONITORING_INTERVAL", timedelta(0), "positive"),
    ],
)
def test_bad_settings_stop_start_up_naming_the_setting(settings, name, value, message):
    setattr(settings, name, value)
    with pytest.raises(ImproperlyConfigured, match=message):
        BackPressureConfig.from_settings()
