"""The categorizer doorbell of an ingress process, rung after commits and coalesced."""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import math
from collections.abc import Callable

from delivery.qmgr import bell

log = logging.getLogger(__name__)

RING_INTERVAL = 0.1  # seconds; one categorizer task per ring: batches, not a task per message


def _ring() -> None:
    # Looked up at call time: tests replace bell.ring_categorizer.
    bell.ring_categorizer()


class CoalescedBell:
    """Rings the categorizer at most once per ``interval``, never blocking a reply.

    A request while a ring is waiting to start is covered by that ring; a
    request while one is in flight gets one more ring after it. So every
    commit is followed by a ring that started after the commit.
    """

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        executor: concurrent.futures.Executor,
        interval: float = RING_INTERVAL,
        ring: Callable[[], None] = _ring,
    ) -> None:
        self._loop = loop
        self._executor = executor
        self._interval = interval
        self._ring = ring
        self._timer: asyncio.TimerHandle | None = None
        self._inflight: asyncio.Future | None = None
        self._again = False
        self._last = -math.inf

    def request(self) -> None:
        if self._timer is not None:
            return
        if self._inflight is not None:
            self._again = True
            return
        self._schedule()

    def _schedule(self) -> None:
        delay = max(0.0, self._last + self._interval - self._loop.time())
        self._timer = self._loop.call_later(delay, self._fire)

    def _fire(self) -> None:
        self._timer = None
        self._last = self._loop.time()
        self._inflight = self._loop.run_in_executor(self._executor, self._ring)
        self._inflight.add_done_callback(self._rung)

    def _rung(self, future: asyncio.Future) -> None:
        self._inflight = None
        if not future.cancelled() and future.exception() is not None:
            log.warning("ringing the categorizer failed", exc_info=future.exception())
        if self._again:
            self._again = False
            self._schedule()

    async def flush(self) -> None:
        """Ring now what is pending, and wait until no ring is in flight."""
        while self._timer is not None or self._inflight is not None:
            if self._timer is not None:
                self._timer.cancel()
                self._fire()
            assert self._inflight is not None
            await asyncio.wait({self._inflight})
