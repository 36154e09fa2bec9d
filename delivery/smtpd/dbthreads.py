"""Database threads: a fixed pool whose threads each own one Django connection.

``message_accept`` is synchronous Django ORM, so the inbound server (and the
pickup watcher) run it in these threads instead of on the event loop.
"""

from __future__ import annotations

import concurrent.futures
import queue
import threading
from collections.abc import Callable
from typing import Any

from django.db import connections


class DatabaseExecutor(concurrent.futures.Executor):
    """A fixed pool of threads, each owning one Django database connection.

    Unlike ThreadPoolExecutor, every thread closes its connection when the
    pool shuts down, so nothing holds a session (or locks) afterwards.
    """

    def __init__(self, workers: int, name: str = "smtp-db") -> None:
        self._jobs: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._closed = False
        self._threads = [
            threading.Thread(target=self._work, name=f"{name}-{i}", daemon=True)
            for i in range(workers)
        ]
        for thread in self._threads:
            thread.start()

    def submit(
        self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any
    ) -> concurrent.futures.Future:
        if self._closed:
            raise RuntimeError("the database executor is shut down")
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._jobs.put((future, fn, args, kwargs))
        return future

    def _work(self) -> None:
        try:
            while (job := self._jobs.get()) is not None:
                future, fn, args, kwargs = job
                if not future.set_running_or_notify_cancel():
                    continue
                try:
                    result = fn(*args, **kwargs)
                except BaseException as exc:  # noqa: BLE001 - handed to the waiter
                    future.set_exception(exc)
                else:
                    future.set_result(result)
                # Drop the job now: an idle thread would otherwise keep its last
                # message's body alive until its next job.
                del job, future, fn, args, kwargs
                result = None
        finally:
            connections.close_all()

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        if not self._closed:
            self._closed = True
            for _ in self._threads:
                self._jobs.put(None)  # after every job already queued
        if wait:
            for thread in self._threads:
                thread.join()
