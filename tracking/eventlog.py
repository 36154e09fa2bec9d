"""The JSON-lines event log (``MAILRELAY_EVENT_LOG``): one line per tracking event.

Lines are handed over after the commit of their transaction
(``transaction.on_commit``) to a writer thread through a bounded queue, so a
slow disk or a stalled pipe never holds a delivery: when the queue is full
the lines are dropped and counted (a warning says how many). The schema is
documented in docs/tracking.md.
"""

from __future__ import annotations

import json
import logging
import queue
import sys
import threading
from collections.abc import Iterable
from typing import IO, Any

from django.conf import settings
from django.db import transaction

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
        self.lines: queue.Queue[str | None] = queue.Queue(QUEUE_LINES)
        self.dropped = 0
        self.stream: IO[str] | None = None
        self.thread = threading.Thread(target=self._run, name="event-log", daemon=True)
        self.thread.start()

    def put(self, lines: list[str]) -> None:
        for line in lines:
            try:
                self.lines.put_nowait(line)
            except queue.Full:
                self.dropped += 1
        if self.dropped and self.dropped % 1000 == 1:
            log.warning("event log %s is behind: %d lines dropped", self.target, self.dropped)

    def _open(self) -> IO[str]:
        if self.stream is None:
            if self.target == "-":
                # The process's real stdout: a Celery worker replaces sys.stdout
                # with a logger, which would wrap each line in a log record.
                self.stream = sys.__stdout__ or sys.stdout
            else:
                self.stream = open(self.target, "a", encoding="utf-8")  # noqa: SIM115
        return self.stream

    def _run(self) -> None:
        while True:
            line = self.lines.get()
            try:
                batch = [line]
                while True:  # write what is waiting in one go
                    try:
                        batch.append(self.lines.get_nowait())
                    except queue.Empty:
                        break
                stream = self._open()
                stream.write("".join(x for x in batch if x is not None))
                stream.flush()
            except OSError:
                log.exception("could not write the event log %s", self.target)
                self.stream = None
            finally:
                for _ in batch:
                    self.lines.task_done()

    def flush(self) -> None:
        self.lines.join()


_writer: _Writer | None = None
_lock = threading.Lock()


def _get_writer() -> _Writer | None:
    global _writer
    target = settings.MAILRELAY_EVENT_LOG
    if not target:
        return None
    with _lock:
        if _writer is None or _writer.target != target:
            if _writer is not None:
                _writer.flush()
            _writer = _Writer(target)
        return _writer


def after_commit(rows: Iterable[Any]) -> None:
    """Write these rows' lines once their transaction commits (nothing if it rolls back)."""
    if not settings.MAILRELAY_EVENT_LOG:
        return
    lines = [json.dumps(as_dict(r), default=str, ensure_ascii=False) + "\n" for r in rows]
    transaction.on_commit(lambda: _emit(lines))


def _emit(lines: list[str]) -> None:
    writer = _get_writer()
    if writer is not None:
        writer.put(lines)


def flush() -> None:
    """Wait until every line handed over so far is written (tests, shutdown)."""
    if _writer is not None:
        _writer.flush()
