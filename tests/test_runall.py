"""`make run` (manage.py runall) supervises its children: a child that dies is
started again with back-off, and the console says so."""

from __future__ import annotations

import os
import re
import signal
import smtplib
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from mailrelay.management.commands import runall as runall_module
from mailrelay.management.commands.runall import (
    BACKOFF_FIRST,
    BACKOFF_MAX,
    STABLE_AFTER,
    Supervisor,
    next_backoff,
)
from tests.support.sinks import find_free_port
from tests.test_system import body

ROOT = Path(__file__).resolve().parents[1]
STARTED = re.compile(r"^(?P<name>[\w-]+): started \(pid (?P<pid>\d+)\)$")


def test_backoff_doubles_to_a_minute_and_resets_after_a_stable_run():
    waits = [next_backoff(0, 0)]
    for _ in range(8):
        waits.append(next_backoff(waits[-1], ran_for=2))
    assert waits == [1, 2, 4, 8, 16, 32, 60, 60, 60]
    assert waits[0] == BACKOFF_FIRST and max(waits) == BACKOFF_MAX
    assert next_backoff(60, ran_for=STABLE_AFTER) == BACKOFF_FIRST


def _supervisor(commands: dict[str, list[str]], said: list[str]) -> Supervisor:
    return Supervisor(commands, ROOT, dict(os.environ), lambda text, error=False: said.append(text))


def _check_until(sup: Supervisor, said: list[str], pattern: str, count: int = 1) -> None:
    deadline = time.monotonic() + 10
    while sum(bool(re.search(pattern, line)) for line in said) < count:
        assert time.monotonic() < deadline, said
        sup.check()
        time.sleep(0.01)


def test_a_child_that_keeps_dying_waits_longer_each_time(monkeypatch):
    monkeypatch.setattr(runall_module, "BACKOFF_FIRST", 0.05)
    said: list[str] = []
    sup = _supervisor({"flaky": [sys.executable, "-c", "raise SystemExit(3)"]}, said)
    sup.start_all()
    try:
        _check_until(sup, said, r"^flaky \(pid \d+\) exited with code 3; restarting in", 3)
    finally:
        sup.stop_all()
    waits = [float(m[1]) for line in said if (m := re.search(r"restarting in ([\d.]+)s$", line))]
    assert waits[:3] == [0.05, 0.1, 0.2]
    assert sup.children[0].restarts >= 2


def test_what_a_killed_child_leaves_behind_is_killed_with_it(tmp_path):
    said: list[str] = []
    pidfile = tmp_path / "grandchild.pid"
    # A parent with a child of its own, as a prefork worker and its pool.
    script = f"sleep 300 & echo $! > {pidfile}; wait"
    sup = _supervisor({"parent": ["sh", "-c", script]}, said)
    sup.start_all()
    try:
        deadline = time.monotonic() + 10
        while not pidfile.exists() or not pidfile.read_text().strip():
            assert time.monotonic() < deadline
            time.sleep(0.01)
        grandchild = psutil.Process(int(pidfile.read_text()))
        parent = sup.children[0].proc
        assert parent is not None
        os.kill(parent.pid, signal.SIGKILL)
        _check_until(
            sup, said, r"^parent \(pid \d+\) exited with signal SIGKILL; restarting in 1s$"
        )
        grandchild.wait(5)  # gone with its parent's session, not left running
    finally:
        sup.stop_all()
    assert not any(c.proc.poll() is None for c in sup.children if c.proc)


class Runall:
    """A real `manage.py runall` whose console lines can be awaited."""

    def __init__(self, env: dict[str, str]) -> None:
        self.lines: list[str] = []
        self._cond = threading.Condition()
        self.proc = subprocess.Popen(
            [sys.executable, "manage.py", "runall"],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            with self._cond:
                self.lines.append(line.rstrip())
                self._cond.notify_all()

    def wait_for(self, pattern: str, timeout: float = 60, after: int = 0) -> re.Match:
        """The first line from index ``after`` matching ``pattern``."""
        found: list[re.Match] = []

        def seen() -> bool:
            for line in self.lines[after:]:
                match = re.search(pattern, line)
                if match:
                    found.append(match)
                    return True
            return self.proc.poll() is not None

        with self._cond:
            self._cond.wait_for(seen, timeout)
        assert found, f"runall did not print {pattern!r}:\n" + self.output()
        return found[0]

    def children(self) -> dict[str, int]:
        """The current pid of each child, from the console."""
        pids: dict[str, int] = {}
        for line in list(self.lines):
            match = STARTED.match(line)
            if match:
                pids[match["name"]] = int(match["pid"])
        return pids

    def output(self) -> str:
        return "\n".join(self.lines[-80:])


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.fixture
def runall(tmp_path, sink_factory, smtp_port) -> Iterator[tuple[Runall, int]]:
    """runall on the embedded default (SQLite, filesystem broker), mail to a sink."""
    smtp, web = find_free_port(["127.0.0.1"]), find_free_port(["127.0.0.1"])
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("DATABASE_URL", "CELERY_BROKER_URL", "MAILRELAY_TEST_DATABASE")
        and not k.startswith("PYTEST")
    }
    env.update(
        PYTHONUNBUFFERED="1",
        MAILRELAY_DATA_DIR=str(tmp_path / "var"),
        MAILRELAY_SMTP_LISTEN=f"127.0.0.1:{smtp}",
        MAILRELAY_WEB_LISTEN=f"127.0.0.1:{web}",
        MAILRELAY_SMART_HOST=f"[127.0.0.2]:{smtp_port}",
        MAILRELAY_WORKER_CONCURRENCY="1",
        MAILRELAY_DELIVERY_CONCURRENCY="4",
    )
    run = Runall(env)
    try:
        yield run, smtp
    finally:
        if run.proc.poll() is None:
            os.killpg(run.proc.pid, signal.SIGTERM)
            try:
                run.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(run.proc.pid, signal.SIGKILL)
                raise


def _send(port: int, n: int, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            with smtplib.SMTP("127.0.0.1", port, timeout=10) as client:
                client.sendmail("sender@example.org", ["u@example.net"], body(n))
            return
        except OSError:
            assert time.monotonic() < deadline, "the ingress never answered"
            time.sleep(0.2)


def test_a_killed_child_is_started_again_and_the_relay_keeps_working(runall, sink_factory):
    run, smtp = runall
    sink = sink_factory("127.0.0.2")
    run.wait_for(r"^beat: started")
    first = run.children()
    assert set(first) == {
        "smtp",
        "web",
        "worker-control",
        "worker-delivery",
        "worker-webhooks",
        "beat",
    }
    _send(smtp, 1)
    assert sink.wait_for(1, timeout=60), run.output()
    # Killed between tasks: a kill in the middle of one is the ownership tests' subject.
    run.wait_for(r"Task delivery\.tasks\.deliver_link\[.*\] succeeded", timeout=30)

    mark = len(run.lines)
    os.kill(first["worker-delivery"], signal.SIGKILL)
    run.wait_for(
        rf"^worker-delivery \(pid {first['worker-delivery']}\) exited with signal SIGKILL; "
        r"restarting in 1s$",
        timeout=10,
        after=mark,
    )
    run.wait_for(r"^worker-delivery: started", timeout=10, after=mark)
    again = run.children()
    assert again["worker-delivery"] != first["worker-delivery"]
    assert {k: v for k, v in again.items() if k != "worker-delivery"} == {
        k: v for k, v in first.items() if k != "worker-delivery"
    }, run.output()
    assert run.proc.poll() is None  # the rest of the relay never stopped

    # The new delivery worker delivers. (The first message may come again: the
    # kill may have come before its delivery was recorded; that is at-least-once.)
    _send(smtp, 2)
    assert sink.wait_until(
        lambda: any(m.data.endswith(body(2)) for m in sink.messages), timeout=60
    ), run.output()

    os.killpg(run.proc.pid, signal.SIGTERM)
    assert run.proc.wait(30) == 0
    run.wait_for(r"^stopped$", timeout=5)
    deadline = time.monotonic() + 5
    while any(_alive(pid) for pid in again.values()) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not [name for name, pid in again.items() if _alive(pid)]
