"""Group commit on ingress: the messages of several sessions in one transaction.

A commit costs the database a WAL flush and a round trip whatever it holds;
under load, sessions wait for their commits at the same time. The
``GroupCommitter`` has a few committer threads (each owning one Django
connection); a thread takes the first waiting message and every other one
waiting at that moment (up to ``max_batch`` messages, ``max_bytes``), stores
them with one statement (``queues.accept.messages_accept``) and
then answers each message's future: its Message once committed, or the
exception that kept it out. Nothing waits for a batch to fill: with no load a
batch is one message, under load batches grow by themselves (Postgres's own
``commit_delay`` idea, without the delay).

A failed batch commits nothing; ``messages_accept`` then stores its messages
one by one, so one bad message gets its 451 alone. Each session replies 250
only after its own future holds a Message.
"""

from __future__ import annotations

import concurrent.futures
import logging
import queue
import threading
from collections.abc import Callable, Sequence
from typing import Any

from django.db import InterfaceError, OperationalError, connection, connections

log = logging.getLogger(__name__)

DEFAULT_COMMIT_THREADS = 2
DEFAULT_MAX_BATCH = 64
DEFAULT_MAX_BYTES = 4 * 1024 * 1024  # a batch holds at most this much message data
# A committer thread reconnects after a batch this large: libpq's send buffer
# grows to the statement's size and is only freed with the connection.
RELEASE_CONNECTION_ABOVE = 8 * 1024 * 1024

Job = tuple[concurrent.futures.Future, Any, Any]  # (future, envelope, data)

# PostgreSQL takes at most 65535 parameters in one statement; a batch's INSERT
# (queues.bulk.insert_many_with_children) sends one per column of each message
# and of each recipient. Kept under that with room: a batch of four messages of
# 1000 recipients each is two statements, not a failed one and four retries.
MAX_STATEMENT_PARAMS = 60_000
PARAMS_PER_MESSAGE = 40  # message columns (31 today) with room
PARAMS_PER_RECIPIENT = 24  # recipient columns (19 today) with room


def _params(job: Job) -> int:
    recipients = getattr(job[1], "recipients", ())
    return PARAMS_PER_MESSAGE + PARAMS_PER_RECIPIENT * len(recipients)


StoreBatch = Callable[[Sequence[tuple[Any, Any]]], list[Any]]


def _default_store_batch(batch: Sequence[tuple[Any, Any]]) -> list[Any]:
    from queues.accept import messages_accept

    return messages_accept(batch)


class GroupCommitter:
    """Committer threads that store waiting messages in batches."""

    def __init__(
        self,
        threads: int = DEFAULT_COMMIT_THREADS,
        *,
        max_batch: int = DEFAULT_MAX_BATCH,
        max_bytes: int = DEFAULT_MAX_BYTES,
        store_batch: StoreBatch = _default_store_batch,
        name: str = "smtp-commit",
    ) -> None:
        self.max_batch = max(1, max_batch)
        self.max_bytes = max_bytes
        self._store_batch = store_batch
        self._jobs: queue.SimpleQueue[Job | None] = queue.SimpleQueue()
        self._closed = False
        self.batches = 0  # batches stored (for tests and the log)
        self.messages = 0
        self._count_lock = threading.Lock()
        self._threads = [
            threading.Thread(target=self._work, name=f"{name}-{i}", daemon=True)
            for i in range(max(1, threads))
        ]
        for thread in self._threads:
            thread.start()

    def submit(self, envelope: Any, data: bytes | bytearray) -> concurrent.futures.Future:
        """Queue one message; the future gets its stored Message (committed) or an exception."""
        if self._closed:
            raise RuntimeError("the group committer is shut down")
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._jobs.put((future, envelope, data))
        return future

    def _take_batch(self, first: Job) -> tuple[list[Job], Job | None]:
        """The batch that starts with ``first``, and the job taken that did not
        fit in its statement (it starts this thread's next batch)."""
        batch = [first]
        size = len(first[2])
        params = _params(first)
        while len(batch) < self.max_batch and size < self.max_bytes:
            try:
                job = self._jobs.get_nowait()
            except queue.Empty:
                break
            if job is None:
                self._jobs.put(None)  # shutting down: this thread stops after the batch
                break
            if params + _params(job) > MAX_STATEMENT_PARAMS:
                return batch, job
            batch.append(job)
            size += len(job[2])
            params += _params(job)
        return batch, None

    def _work(self) -> None:
        try:
            carried: Job | None = None
            while (first := carried or self._jobs.get()) is not None:
                taken, carried = self._take_batch(first)
                batch = [job for job in taken if job[0].set_running_or_notify_cancel()]
                if batch:
                    self._commit(batch)
                del first, taken, batch  # an idle thread keeps no message body alive
        finally:
            connections.close_all()

    def _commit(self, batch: list[Job]) -> None:
        size = sum(len(data) for _f, _e, data in batch)
        try:
            results = self._store_batch([(envelope, data) for _f, envelope, data in batch])
            if len(results) != len(batch):
                raise RuntimeError(f"{len(results)} results for a batch of {len(batch)}")
        except BaseException as exc:  # noqa: BLE001 - every message of the batch fails (451)
            # A database that is away is logged by each session's 451, not traced here.
            away = isinstance(exc, (OperationalError, InterfaceError))
            log.log(
                logging.DEBUG if away else logging.ERROR,
                "storing a batch of %d messages failed",
                len(batch),
                exc_info=not away,
            )
            self._close_connection()
            for future, _e, _d in batch:
                future.set_exception(exc)
            return
        with self._count_lock:
            self.batches += 1
            self.messages += len(batch)
        failed = False
        for (future, _e, _d), result in zip(batch, results, strict=True):
            if isinstance(result, BaseException):
                failed = True
                future.set_exception(result)
            else:
                future.set_result(result)
        if failed or size >= RELEASE_CONNECTION_ABOVE:
            self._close_connection()

    @staticmethod
    def _close_connection() -> None:
        try:
            connection.close()
        except Exception:  # noqa: BLE001 - closing a broken connection may fail too
            log.debug("closing the committer's database connection failed", exc_info=True)

    def shutdown(self, wait: bool = True) -> None:
        """Stop after every message already queued is stored."""
        if not self._closed:
            self._closed = True
            for _ in self._threads:
                self._jobs.put(None)
        if wait:
            for thread in self._threads:
                thread.join()
