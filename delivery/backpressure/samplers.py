"""Samplers: one blocking read per resource per interval.

A sampler is anything with ``read() -> Sample``. The monitor calls every
sampler in its own thread (never on the event loop), one after the other.
A reading that cannot be taken is ``Sample(None, note=why)``: "not
monitored", never a guess. Tests use ``ManualSampler`` to feed readings.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import threading
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Protocol
from urllib.parse import urlsplit

from django.conf import settings
from django.db import DatabaseError, connections

from delivery.backpressure.config import BackPressureConfig
from delivery.backpressure.engine import Resource, Sample

log = logging.getLogger(__name__)


class Sampler(Protocol):
    def read(self) -> Sample: ...


class ManualSampler:
    """A reading set by hand (tests; resources measured elsewhere)."""

    def __init__(self, value: float | None = 0.0, total: int | None = None, note: str = "") -> None:
        self.value = value
        self.total = total
        self.note = note

    def set(self, value: float | None, total: int | None = None, note: str = "") -> None:
        self.value = value
        self.total = total if total is not None else self.total
        self.note = note

    def read(self) -> Sample:
        return Sample(self.value, self.total, self.note)


# ----------------------------------------------------------------- version buckets


class InFlight:
    """Messages received by this process and not yet committed: the version buckets.

    The ingress counts ``value`` up when a message's data has been received
    and down when its commit has finished (committed or failed). Both happen
    on the ingress's event loop, its only writer; the sampler's thread reads
    it. A plain attribute: the hot path calls nothing here.
    """

    def __init__(self) -> None:
        self.value = 0


class VersionBucketsSampler:
    def __init__(self, in_flight: InFlight) -> None:
        self.in_flight = in_flight

    def read(self) -> Sample:
        return Sample(float(self.in_flight.value))


# ----------------------------------------------------------------- disks


def is_local_host(host: str) -> bool:
    """A PostgreSQL HOST on this machine: a socket directory, localhost, a loopback IP."""
    if not host or host.startswith("/") or host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


class DatabaseDirectory:
    """Where the default database keeps its files (and its WAL), found once.

    PostgreSQL: ``SHOW data_directory`` when the server is local (it needs a
    superuser or the pg_read_all_settings role); SQLite: the file's folder.
    """

    def __init__(self, alias: str = "default", db: Mapping[str, object] | None = None) -> None:
        self.alias = alias
        self._db = db  # the connection's settings (tests pass others)
        self._found: tuple[str | None, str] | None = None
        self._lock = threading.Lock()

    def data_directory(self) -> tuple[str | None, str]:
        """(path, "") or (None, why not)."""
        with self._lock:
            if self._found is None:
                found, final = self._find()
                if not final:
                    return found
                self._found = found
            return self._found

    def log_directory(self) -> tuple[str | None, str]:
        path, why = self.data_directory()
        if path is None:
            return None, why
        if self._engine() == "postgresql":
            return os.path.join(path, "pg_wal"), ""
        return path, ""  # SQLite's -wal file lives beside the database

    @property
    def db(self) -> Mapping[str, object]:
        return self._db if self._db is not None else connections[self.alias].settings_dict

    def _engine(self) -> str:
        engine = str(self.db["ENGINE"])
        if "postgresql" in engine:
            return "postgresql"
        if "sqlite3" in engine:
            return "sqlite"
        return engine

    def _find(self) -> tuple[tuple[str | None, str], bool]:
        """The answer and whether it is final (a lost connection is worth a retry)."""
        db = self.db
        engine = self._engine()
        if engine == "sqlite":
            name = str(db["NAME"])
            if name == ":memory:" or "mode=memory" in name:
                return (None, "in-memory SQLite database"), True
            return (str(Path(name).resolve().parent), ""), True
        if engine != "postgresql":
            return (None, f"{engine}: database location unknown"), True
        host = str(db.get("HOST") or "")
        if not is_local_host(host):
            return (None, f"PostgreSQL on {host} is not on this machine"), True
        try:
            with connections[self.alias].cursor() as cursor:
                cursor.execute("SHOW data_directory")
                row = cursor.fetchone()
        except DatabaseError as exc:
            text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            final = "permission denied" in text.lower() or "must be" in text.lower()
            return (None, f"SHOW data_directory: {text}"), final
        return (str(row[0]), ""), True


class DiskSampler:
    """Used % of the volume holding a path: 100 * (size - available) / size.

    "Available" is what an unprivileged process may still write (df's Avail),
    so Exchange's "size - 500 MB" formula means "500 MB left for us".
    """

    def __init__(self, where: Callable[[], tuple[str | None, str]]) -> None:
        self.where = where

    def read(self) -> Sample:
        path, why = self.where()
        if path is None:
            return Sample.unreadable(why)
        try:
            st = os.statvfs(path)
        except OSError as exc:
            return Sample.unreadable(f"{path}: {exc.strerror or exc}")
        size = st.f_blocks * st.f_frsize
        if size <= 0:
            return Sample.unreadable(f"{path}: the volume reports no size")
        available = st.f_bavail * st.f_frsize
        return Sample(round(100 * (size - available) / size, 2), size, path)


def fixed_path(path: str) -> Callable[[], tuple[str | None, str]]:
    return lambda: (path, "")


# ----------------------------------------------------------------- memory


def _meminfo() -> dict[str, int]:
    values = {}
    with open("/proc/meminfo") as fh:
        for line in fh:
            key, _, rest = line.partition(":")
            parts = rest.split()
            if parts and parts[0].isdigit():
                values[key] = int(parts[0]) * (1024 if parts[1:] == ["kB"] else 1)
    return values


def physical_memory() -> tuple[int, int]:
    """(total, available) bytes of physical memory."""
    try:
        info = _meminfo()
        return info["MemTotal"], info["MemAvailable"]
    except (OSError, KeyError):
        import psutil  # not on Linux: psutil, if installed

        vm = psutil.virtual_memory()
        return int(vm.total), int(vm.available)


def process_rss() -> int:
    """This process's resident memory in bytes."""
    try:
        with open("/proc/self/statm") as fh:
            return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        import psutil

        return int(psutil.Process().memory_info().rss)


class PrivateBytesSampler:
    """This process's resident memory as a % of physical memory."""

    def read(self) -> Sample:
        try:
            total, _ = physical_memory()
            rss = process_rss()
        except Exception as exc:  # noqa: BLE001 - no /proc and no psutil
            return Sample.unreadable(f"memory: {exc}")
        return Sample(round(100 * rss / total, 2), total, f"{rss // 2**20} MiB resident")


class PhysicalMemorySampler:
    """Memory used by all processes: 100 * (total - available) / total."""

    def read(self) -> Sample:
        try:
            total, available = physical_memory()
        except Exception as exc:  # noqa: BLE001 - no /proc and no psutil
            return Sample.unreadable(f"memory: {exc}")
        used = total - available
        return Sample(round(100 * used / total, 2), total, f"{used // 2**20} MiB used")


# ----------------------------------------------------------------- queues


class SubmissionQueueSampler:
    """Messages in state submission on every node: one bounded, indexed count.

    The count stops at ``cap`` (twice the high threshold by default): beyond
    that the level is high anyway, and the cost stays flat however long the
    backlog grows.
    """

    def __init__(self, cap: int) -> None:
        self.cap = max(1, cap)

    def read(self) -> Sample:
        from queues.models import Message, MessageState

        try:
            # Uses the partial index message_submission_due (state = submission).
            count = Message.objects.filter(state=MessageState.SUBMISSION)[: self.cap].count()
        except DatabaseError as exc:
            connections["default"].close()  # reconnect next interval
            return Sample.unreadable(f"database: {str(exc).strip() or type(exc).__name__}")
        return Sample(float(count), None, f"at least {count}" if count >= self.cap else "")


class BatchPointsSampler:
    """Tasks waiting in the broker for the workers.

    Redis: LLEN of the Celery queue's lists (one per priority step, as kombu
    keeps them); filesystem transport: message files in its folder; any other
    broker: not monitored.
    """

    PRIORITY_STEPS = (0, 3, 6, 9)  # kombu's Redis defaults
    SEPARATOR = "\x06\x16"

    def __init__(
        self,
        broker_url: str | None = None,
        queue: str | None = None,
        transport_options: Mapping[str, object] | None = None,
    ) -> None:
        self.broker_url = broker_url if broker_url is not None else settings.CELERY_BROKER_URL
        self.queue = queue or getattr(settings, "CELERY_TASK_DEFAULT_QUEUE", "celery")
        if transport_options is None:
            transport_options = getattr(settings, "CELERY_BROKER_TRANSPORT_OPTIONS", {})
        self.options = dict(transport_options)
        self.scheme = urlsplit(self.broker_url).scheme.lower()
        self._redis = None

    def read(self) -> Sample:
        if self.scheme in ("redis", "rediss"):
            return self._read_redis()
        if self.scheme == "filesystem":
            return self._read_folder()
        return Sample.unreadable(f"{self.scheme or 'unknown'} broker: not monitored")

    def _keys(self) -> list[str]:
        steps = self.options.get("priority_steps", self.PRIORITY_STEPS)
        sep = str(self.options.get("sep", self.SEPARATOR))
        assert isinstance(steps, list | tuple)
        return [self.queue if step == 0 else f"{self.queue}{sep}{step}" for step in steps]

    def _read_redis(self) -> Sample:
        import redis

        try:
            if self._redis is None:
                self._redis = redis.Redis.from_url(
                    self.broker_url, socket_timeout=1, socket_connect_timeout=1
                )
            pipe = self._redis.pipeline(transaction=False)
            for key in self._keys():
                pipe.llen(key)
            waiting = sum(int(n) for n in pipe.execute())
        except (redis.RedisError, OSError) as exc:
            return Sample.unreadable(f"redis: {exc}")
        return Sample(float(waiting), None, f"queue {self.queue}")

    def _read_folder(self) -> Sample:
        folder = self.options.get("data_folder_in")
        if not folder:
            return Sample.unreadable("filesystem broker without data_folder_in")
        suffix = f".{self.queue}.msg"
        try:
            with os.scandir(str(folder)) as entries:
                waiting = sum(1 for e in entries if e.name.endswith(suffix))
        except OSError as exc:
            return Sample.unreadable(f"{folder}: {exc.strerror or exc}")
        return Sample(float(waiting), None, str(folder))

    def close(self) -> None:
        if self._redis is not None:
            self._redis.close()
            self._redis = None


# ----------------------------------------------------------------- the default set


def default_samplers(
    config: BackPressureConfig, in_flight: InFlight, database: DatabaseDirectory | None = None
) -> dict[Resource, Sampler]:
    """Real samplers for every resource, following ``config``."""
    database = database or DatabaseDirectory()
    submission_high = config.resources[Resource.SUBMISSION_QUEUE].high
    return {
        Resource.DATABASE_DISK_SPACE: DiskSampler(
            fixed_path(config.database_path) if config.database_path else database.data_directory
        ),
        Resource.LOG_DISK_SPACE: DiskSampler(
            fixed_path(config.log_path) if config.log_path else database.log_directory
        ),
        Resource.VERSION_BUCKETS: VersionBucketsSampler(in_flight),
        Resource.BATCH_POINTS: BatchPointsSampler(),
        Resource.PRIVATE_BYTES: PrivateBytesSampler(),
        Resource.PHYSICAL_MEMORY: PhysicalMemorySampler(),
        Resource.SUBMISSION_QUEUE: SubmissionQueueSampler(cap=2 * max(submission_high, 1)),
    }
