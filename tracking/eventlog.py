"""The JSON-lines event log (``MAILRELAY_EVENT_LOG``): one line per tracking event.

Lines are handed over (by ``tracking.record``) after the commit of their
transaction (``transaction.on_commit``) to a writer thread through a bounded
queue, so a slow disk or a stalled pipe never holds a delivery: when the
queue is full the lines are dropped and counted (a warning says how many).
Best effort: lines still queued when the process is killed (kill -9,
os._exit) are lost; a normal exit writes them first (atexit, up to 5 s). Each
line is one ``os.write`` on a file opened ``O_APPEND``, so several processes
may append to one file without their lines interleaving. The schema is
documented in docs/tracking.md.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import logging
import os
import queue
import sys
import threading
from collections.abc import Iterable
from typing import Any

from django.conf import settings

from queues.config import once_per_process

log = logging.getLogger(__name__)

QUEUE_LINES = 100_000
SCHEMA_VERSION = 1
FIELDS = (
    "qid",
    "message_id",
    "sender",
    "recipient",
    "client",
    "account",
    "size",
    "queue",
    "next_hop",
    "host",
    "ip",
    "tls",
    "code",
    "enhanced",
    "reply",
    "remote_id",
    "actor",
    "detail",
)


def as_dict(row: Any) -> dict[str, Any]:
    """One tracking row as the event log (and the API) writes it."""
    data = {
        "v": SCHEMA_VERSION,
        "event_id": str(row.event_id),
        "at": row.at.isoformat().replace("+00:00", "Z"),
        "event": row.event,
    }
    for name in FIELDS:
        data[name] = getattr(row, name)
    return data


class _Writer:
    def __init__(self, target: str) -> None:
        self.target = target
        self.lines: queue.Queue[bytes] = queue.Queue(QUEUE_LINES)
        self.dropped = 0
        self.fd: int | None = None
        self.thread = threading.Thread(target=self._run, name="event-log", daemon=True)
        self.thread.start()

    def put(self, lines: list[str]) -> None:
        for line in lines:
            try:
                self.lines.put_nowait(line.encode())
            except queue.Full:
                self.dropped += 1
        if self.dropped and self.dropped % 1000 == 1:
            log.warning("event log %s is behind: %d lines dropped", self.target, self.dropped)

    def _open(self) -> int:
        if self.fd is None:
            if self.target == "-":
                # The process's real stdout: a Celery worker replaces sys.stdout
                # with a logger, which would wrap each line in a log record.
                stream = sys.__stdout__ or sys.stdout
                stream.flush()
                self.fd = stream.fileno()
            else:
                # O_APPEND: each write lands at the end of the file, whatever other
                # processes appended (and after a copytruncate).
                self.fd = os.open(
                    self.target, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o666
                )
        return self.fd

    def _write_line(self, fd: int, line: bytes) -> None:
        """One os.write per line: lines of several processes appending to one file
        never interleave (a short write, which a full disk can cause, goes on)."""
        view = memoryview(line)
        while view:
            view = view[os.write(fd, view) :]

    def _run(self) -> None:
        while True:
            line = self.lines.get()
            batch = [line]
            try:
                while True:  # write what is waiting in one go
                    try:
                        batch.append(self.lines.get_nowait())
                    except queue.Empty:
                        break
                fd = self._open()
                for item in batch:
                    self._write_line(fd, item)
            except OSError:
                log.exception("could not write the event log %s", self.target)
                if self.fd is not None and self.target != "-":
                    with contextlib.suppress(OSError):
                        os.close(self.fd)
                self.fd = None
            finally:
                for _ in batch:
                    self.lines.task_done()

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every line handed over is written (at most ``timeout`` s)."""
        with self.lines.all_tasks_done:
            return self.lines.all_tasks_done.wait_for(
                lambda: not self.lines.unfinished_tasks, timeout
            )


_writer: _Writer | None = None
_lock = threading.Lock()
EXIT_FLUSH_SECONDS = 5.0


@once_per_process
def target() -> str:
    """``MAILRELAY_EVENT_LOG`` (a path, "-" for stdout, "" for off), read once per
    process: the event log stands alone (a process may configure it and nothing
    else), so it reads its one setting itself."""
    return settings.MAILRELAY_EVENT_LOG


def _get_writer() -> _Writer | None:
    global _writer
    target_now = target()
    if not target_now:
        return None
    with _lock:
        if _writer is None or _writer.target != target_now:
            if _writer is not None:
                _writer.flush()
            _writer = _Writer(target_now)
        return _writer


@atexit.register
def _flush_at_exit() -> None:
    """A process that exits normally writes what waits (for up to 5 s); kill -9 or
    os._exit lose the lines still queued (best effort, docs/tracking.md)."""
    if _writer is not None and not _writer.flush(EXIT_FLUSH_SECONDS):
        log.warning("event log %s: lines still queued at exit are lost", _writer.target)


def _forget_in_child() -> None:
    """A forked child has no writer thread: it starts its own."""
    global _writer, _lock
    _writer = None
    _lock = threading.Lock()


os.register_at_fork(after_in_child=_forget_in_child)


def lines_of(rows: Iterable[Any]) -> list[str]:
    """The rows' lines, as ``emit`` takes them (tracking.record hands them over
    once their transaction commits)."""
    return [json.dumps(as_dict(r), default=str, ensure_ascii=False) + "\n" for r in rows]


def emit(lines: list[str]) -> None:
    """Queue ``lines`` for the writer thread (dropped and counted when it is full)."""
    writer = _get_writer()
    if writer is not None:
        writer.put(lines)


def flush() -> None:
    """Wait until every line handed over so far is written (tests, shutdown)."""
    if _writer is not None:
        _writer.flush()
