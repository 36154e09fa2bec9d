"""Process bookkeeping for the benchmark: start, wait for, and always stop what we start."""

from __future__ import annotations

import contextlib
import os
import pty
import select
import signal
import socket
import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import psutil


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def port_open(port: int, host: str = "127.0.0.1") -> bool:
    try:
        with socket.create_connection((host, port), timeout=0.5):
            return True
    except OSError:
        return False


def wait_port(port: int, timeout: float, proc: subprocess.Popen[Any] | None = None) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"{proc.args[0]} exited with {proc.returncode} before listening")
        if port_open(port):
            return
        time.sleep(0.05)
    raise RuntimeError(f"nothing listens on 127.0.0.1:{port} after {timeout:.0f} s")


def run_with_tty(
    cmd: Sequence[str], timeout: float = 120.0, env: dict[str, str] | None = None
) -> tuple[int, str]:
    """Run ``cmd`` with stdout/stderr on a pseudo-terminal and return (status, output).

    Postfix commands print their diagnostics only when stderr is a terminal
    (otherwise they go to syslog, which a bench machine may not have).
    """
    master, slave = pty.openpty()
    try:
        proc = subprocess.Popen(
            list(cmd), stdin=subprocess.DEVNULL, stdout=slave, stderr=slave, env=env, close_fds=True
        )
    finally:
        os.close(slave)
    chunks: list[bytes] = []
    deadline = time.monotonic() + timeout
    try:
        while True:
            r, _, _ = select.select([master], [], [], 0.2)
            if r:
                try:
                    data = os.read(master, 4096)
                except OSError:  # EIO: the other side closed
                    data = b""
                if not data:
                    break
                chunks.append(data)
            elif proc.poll() is not None:
                break
            if time.monotonic() > deadline:
                proc.kill()
                break
        status = proc.wait(timeout=10)
    finally:
        os.close(master)
    return status, b"".join(chunks).decode("utf-8", "replace").replace("\r\n", "\n").strip()


@dataclass
class Started:
    name: str
    proc: subprocess.Popen[Any]
    stop_signal: int
    grace: float


class Procs:
    """Every process the benchmark starts, each in its own session (process group).

    ``stop_all`` stops them newest first: the stop signal to the process we
    started, then after the grace period SIGKILL to whatever is left of it and
    of its children (as found when stopping began). Processes are addressed by
    the ids we started, never by name; each runs in its own session so a
    Ctrl-C at the terminal reaches only the bench, which then stops them in order.
    """

    def __init__(self) -> None:
        self.started: list[Started] = []

    def spawn(
        self,
        name: str,
        cmd: Sequence[str],
        *,
        stop_signal: int = signal.SIGTERM,
        grace: float = 10.0,
        stdout: int | Path | None = None,
        stderr: int | Path | None = None,
        env: dict[str, str] | None = None,
        cwd: str | os.PathLike[str] | None = None,
    ) -> subprocess.Popen[Any]:
        """Start ``cmd``; a Path for stdout/stderr is a log file, appended to."""
        with contextlib.ExitStack() as files:

            def target(t: int | Path | None) -> int | IO[Any] | None:
                return files.enter_context(open(t, "ab")) if isinstance(t, Path) else t

            proc = subprocess.Popen(
                list(cmd),
                stdin=subprocess.DEVNULL,
                stdout=target(stdout),
                stderr=target(stderr),
                env=env,
                cwd=cwd,
                start_new_session=True,
            )
        self.started.append(Started(name, proc, stop_signal, grace))
        return proc

    def stop(self, proc: subprocess.Popen[Any]) -> None:
        for item in list(self.started):
            if item.proc is proc:
                self._stop(item)
                self.started.remove(item)

    def stop_all(self) -> None:
        while self.started:
            item = self.started.pop()
            try:
                self._stop(item)
            except Exception as exc:  # noqa: BLE001 - keep stopping the others
                print(f"  warning: stopping {item.name} (pid {item.proc.pid}): {exc}")

    @staticmethod
    def _stop(item: Started) -> None:
        proc = item.proc
        members: list[psutil.Process] = []
        if proc.poll() is None:
            with contextlib.suppress(psutil.Error):
                leader = psutil.Process(proc.pid)
                members = [leader, *leader.children(recursive=True)]
            # The leader only: a Celery worker's warm shutdown lets its pool
            # children finish; signalling the whole group would kill them mid-task.
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc.pid, item.stop_signal)
            try:
                proc.wait(item.grace)
            except subprocess.TimeoutExpired:
                print(
                    f"  {item.name} (pid {proc.pid}) did not stop in {item.grace:.0f} s; "
                    "killing it and its children"
                )
        # Whatever of it is left (e.g. prefork children) goes too; is_running()
        # also checks the creation time, so a recycled pid is never hit.
        for member in members:
            with contextlib.suppress(psutil.Error):
                if member.is_running():
                    member.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(5)
        for stream in (proc.stdout, proc.stderr):
            if stream is not None:
                with contextlib.suppress(OSError):
                    stream.close()


def percentile(values: Sequence[float], p: float) -> float | None:
    """The p-th percentile (0..100), nearest-rank method."""
    if not values:
        return None
    ordered = sorted(values)
    rank = max(1, int(-(-p * len(ordered) // 100)))  # ceil(p/100 * n)
    return ordered[min(rank, len(ordered)) - 1]
