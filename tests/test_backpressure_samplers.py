"""The real samplers: disks (with the database's own directories), memory, the
broker, the submission queue, the version buckets — and "not monitored" when a
reading cannot be taken."""

from __future__ import annotations

import os
import uuid
from pathlib import Path

import pytest
import redis
from django.conf import settings as django_settings
from django.db import connection

from delivery.backpressure.engine import Resource
from delivery.backpressure.samplers import (
    BatchPointsSampler,
    DatabaseDirectory,
    DiskSampler,
    InFlight,
    PhysicalMemorySampler,
    PrivateBytesSampler,
    SubmissionQueueSampler,
    VersionBucketsSampler,
    default_samplers,
    fixed_path,
    is_local_host,
)
from queues.accept import IncomingEnvelope, IncomingRecipient, message_accept
from queues.models import Message, MessageState


def test_disk_used_percent_counts_only_space_we_may_still_write(tmp_path):
    sample = DiskSampler(fixed_path(str(tmp_path))).read()
    st = os.statvfs(tmp_path)
    size = st.f_blocks * st.f_frsize
    assert sample.total == size
    assert sample.value == pytest.approx(100 * (size - st.f_bavail * st.f_frsize) / size, abs=0.5)
    assert sample.note == str(tmp_path)


def test_a_missing_disk_path_is_not_monitored(tmp_path):
    sample = DiskSampler(fixed_path(str(tmp_path / "gone"))).read()
    assert sample.value is None and "gone" in sample.note


@pytest.mark.django_db
def test_the_local_postgresql_data_directory_and_its_wal_are_found():
    if connection.vendor != "postgresql":
        pytest.skip("PostgreSQL only")
    with connection.cursor() as cursor:
        cursor.execute("SHOW data_directory")
        expected = cursor.fetchone()[0]
    where = DatabaseDirectory()
    assert where.data_directory() == (expected, "")
    assert where.log_directory() == (os.path.join(expected, "pg_wal"), "")


def test_a_remote_postgresql_is_not_monitored():
    db = {"ENGINE": "django.db.backends.postgresql", "HOST": "db.example"}
    path, why = DatabaseDirectory(db=db).data_directory()
    assert path is None and "db.example is not on this machine" in why
    assert DiskSampler(DatabaseDirectory(db=db).log_directory).read().value is None


def test_sqlite_is_measured_in_its_folder(tmp_path):
    db = {"ENGINE": "django.db.backends.sqlite3", "NAME": str(tmp_path / "mailrelay.sqlite3")}
    where = DatabaseDirectory(db=db)
    assert where.data_directory() == (str(tmp_path.resolve()), "")
    assert where.log_directory() == (str(tmp_path.resolve()), "")


@pytest.mark.parametrize(
    ("host", "local"),
    [
        ("", True),
        ("/var/run/postgresql", True),
        ("localhost", True),
        ("127.0.0.1", True),
        ("::1", True),
        ("10.0.0.5", False),
        ("db.example", False),
    ],
)
def test_which_postgresql_hosts_are_local(host, local):
    assert is_local_host(host) is local


def test_memory_readings_are_percentages_of_physical_memory():
    private = PrivateBytesSampler().read()
    physical = PhysicalMemorySampler().read()
    assert 0 < private.value < physical.value <= 100
    assert private.total == physical.total > 0


def test_version_buckets_are_the_messages_in_flight():
    in_flight = InFlight()
    sampler = VersionBucketsSampler(in_flight)
    in_flight.value += 1
    in_flight.value += 1
    in_flight.value -= 1
    assert sampler.read().value == 1


@pytest.fixture
def celery_queue():
    """A Celery queue name of its own in the test broker (Redis)."""
    url = django_settings.CELERY_BROKER_URL
    if not url.startswith("redis"):
        pytest.skip("needs CELERY_BROKER_URL=redis://...")
    name = f"bp-test-{uuid.uuid4().hex[:8]}"
    client = redis.Redis.from_url(url)
    keys = [name] + [f"{name}\x06\x16{step}" for step in (3, 6, 9)]
    yield client, name, keys
    client.delete(*keys)
    client.close()


def test_batch_points_are_the_tasks_waiting_in_redis_at_every_priority(celery_queue):
    client, name, keys = celery_queue
    client.rpush(keys[0], "a", "b", "c")
    client.rpush(keys[2], "d")
    sampler = BatchPointsSampler(queue=name)
    try:
        assert sampler.read().value == 4
    finally:
        sampler.close()


def test_batch_points_of_the_filesystem_broker_are_its_message_files(tmp_path):
    for i in range(3):
        (tmp_path / f"{i}_x.celery.msg").write_text("{}")
    (tmp_path / "0_y.other.msg").write_text("{}")
    sampler = BatchPointsSampler("filesystem://", "celery", {"data_folder_in": str(tmp_path)})
    assert sampler.read().value == 3


@pytest.mark.parametrize(
    "url", ["amqp://guest@localhost//", "redis://127.0.0.1:1/0", "filesystem://"]
)
def test_a_broker_we_cannot_read_is_not_monitored(url):
    sample = BatchPointsSampler(url, "celery", {}).read()
    assert sample.value is None and sample.note


def accept(address: str) -> Message:
    envelope = IncomingEnvelope(mail_from="a@example.org", recipients=[IncomingRecipient(address)])
    return message_accept(envelope, b"Subject: t\r\n\r\nbody\r\n")


@pytest.mark.django_db
def test_the_submission_queue_counts_messages_waiting_for_the_categorizer_up_to_a_cap():
    messages = [accept(f"u{i}@example.net") for i in range(5)]
    Message.objects.filter(pk__in=[m.pk for m in messages[:2]]).update(state=MessageState.QUEUED)
    assert SubmissionQueueSampler(cap=100).read().value == 3
    capped = SubmissionQueueSampler(cap=2).read()
    assert capped.value == 2 and capped.note == "at least 2"


def test_default_samplers_cover_every_resource(settings, tmp_path):
    from delivery.backpressure.config import BackPressureConfig

    settings.MAILRELAY_BP_DATABASE_PATH = settings.MAILRELAY_BP_LOG_PATH = str(tmp_path)
    config = BackPressureConfig.from_settings()
    samplers = default_samplers(config, InFlight())
    assert set(samplers) == set(Resource)
    assert samplers[Resource.DATABASE_DISK_SPACE].read().note == str(Path(tmp_path))
