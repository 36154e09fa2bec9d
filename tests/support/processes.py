"""Real Celery worker and beat processes for system tests.

They run the project's own code against the test database and a Redis
database reserved for tests, configured through the environment exactly as
in production.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
from django.conf import settings
from django.db import connection

ROOT = Path(__file__).resolve().parents[2]
CELERY = str(Path(sys.executable).parent / "celery")
STOP_GRACE = 15.0  # seconds a stopped process has to exit before it is killed


def test_env(**overrides: str) -> dict[str, str]:
    """Environment for a child process: the test database, the test broker, overrides."""
    db = connection.settings_dict
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST")}
    env["DATABASE_URL"] = (
        f"postgres://{db['USER'] or 'postgres'}@{db['HOST'] or '127.0.0.1'}:"
        f"{db['PORT'] or 5432}/{db['NAME']}"
    )
    env["CELERY_BROKER_URL"] = settings.CELERY_BROKER_URL
    env["DJANGO_SETTINGS_MODULE"] = "mailrelay.settings"
    env.update(overrides)
    return env


class Proc:
    """A child process whose output is collected; ``wait_for`` awaits a line."""

    def __init__(self, name: str, cmd: list[str], env: dict[str, str]) -> None:
        self.name = name
        self.lines: list[str] = []
        self._cond = threading.Condition()
        self.popen = subprocess.Popen(
            cmd,
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.popen.stdout is not None
        for line in self.popen.stdout:
            with self._cond:
                self.lines.append(line.rstrip())
                self._cond.notify_all()
        with self._cond:
            self._cond.notify_all()

    def wait_for(self, text: str, timeout: float = 30) -> None:
        def seen() -> bool:
            return any(text in line for line in self.lines) or self.popen.poll() is not None

        with self._cond:
            self._cond.wait_for(seen, timeout)
            if not any(text in line for line in self.lines):
                raise AssertionError(
                    f"{self.name} did not print {text!r}; output:\n" + "\n".join(self.lines[-40:])
                )

    def wait_for_count(self, text: str, count: int, timeout: float = 30) -> None:
        """Await the ``count``-th line containing ``text`` (e.g. a reconnection)."""

        def seen() -> int:
            return sum(text in line for line in self.lines)

        with self._cond:
            self._cond.wait_for(lambda: seen() >= count or self.popen.poll() is not None, timeout)
            if seen() < count:
                raise AssertionError(
                    f"{self.name} printed {text!r} {seen()} times, not {count}; output:\n"
                    + "\n".join(self.lines[-40:])
                )

    def kill(self) -> None:
        """SIGKILL the whole process group: no cleanup, as a crash would be."""
        if self.popen.poll() is None:
            os.killpg(self.popen.pid, signal.SIGKILL)
        self.popen.wait(10)

    def stop(self) -> None:
        self.terminate()
        self.finish(time.monotonic() + STOP_GRACE)

    def terminate(self) -> None:
        """SIGTERM to the whole process group: a graceful stop."""
        if self.popen.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.popen.pid, signal.SIGTERM)

    def finish(self, deadline: float) -> None:
        """Wait for a terminated process until ``deadline``; then SIGKILL it."""
        try:
            self.popen.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            self.kill()


class ProcessRunner:
    def __init__(self) -> None:
        self.procs: list[Proc] = []

    def worker(
        self,
        name: str = "w1",
        concurrency: int = 2,
        queues: str = "control,delivery",
        pool: str = "prefork",
        **env: str,
    ) -> Proc:
        """A worker; by default one prefork worker for both queues (routing,
        sweep and delivery in one pool, as a bare `celery worker` runs)."""
        proc = Proc(
            name,
            [
                CELERY,
                "-A",
                "mailrelay",
                "worker",
                "-n",
                f"{name}@%h",
                "-Q",
                queues,
                "--pool",
                pool,
                "--loglevel",
                "INFO",
                "--concurrency",
                str(concurrency),
                "--without-gossip",
                "--without-mingle",
                "--without-heartbeat",
            ],
            test_env(**env),
        )
        self.procs.append(proc)
        proc.wait_for("ready.")
        return proc

    def control_worker(self, name: str = "control", concurrency: int = 2, **env: str) -> Proc:
        """The worker for routing and the sweep, as `make run` starts it."""
        return self.worker(name, concurrency, queues="control", **env)

    def delivery_worker(self, name: str = "delivery", concurrency: int = 32, **env: str) -> Proc:
        """The worker for deliveries: a pool of threads, as `make run` starts it."""
        return self.worker(name, concurrency, queues="delivery", pool="threads", **env)

    def beat(self, tmp_path: Path, **env: str) -> Proc:
        proc = Proc(
            "beat",
            [
                CELERY,
                "-A",
                "mailrelay",
                "beat",
                "--loglevel",
                "INFO",
                "--schedule",
                str(tmp_path / "beat-schedule"),
            ],
            test_env(**env),
        )
        self.procs.append(proc)
        proc.wait_for("beat: Starting")
        return proc

    def stop_all(self) -> None:
        """Every process sent SIGTERM at once, then each awaited (STOP_GRACE in all)."""
        for proc in self.procs:
            proc.terminate()
        deadline = time.monotonic() + STOP_GRACE
        for proc in self.procs:
            proc.finish(deadline)


@pytest.fixture
def broker() -> Iterator[redis.Redis]:
    """The test broker's Redis database, empty at the start and end of the test."""
    client = redis.Redis.from_url(settings.CELERY_BROKER_URL)
    client.flushdb()
    yield client
    client.flushdb()


@pytest.fixture
def processes(transactional_db, broker: redis.Redis) -> Iterator[ProcessRunner]:
    """Child processes, stopped before pytest-django flushes the database."""
    runner = ProcessRunner()
    yield runner
    runner.stop_all()
