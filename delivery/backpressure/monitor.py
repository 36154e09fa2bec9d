"""The resource monitor of one ingress process: an asyncio task.

Every interval it takes every reading in its own thread (disk, memory,
Redis and the database are blocking calls; the event loop never waits on
them), feeds the engine on the loop, then stores the node's rows and the
level-change events from the same thread. Decisions are read from the last
snapshot: ``mail_from_decision`` and ``allows_submission`` never block and
may be called from any thread.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import gc
import logging
import threading
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from typing import Literal

from django.db import connections

from delivery.backpressure import store
from delivery.backpressure.config import BackPressureConfig, default_node_name
from delivery.backpressure.engine import (
    GC_RESOURCES,
    Action,
    Decision,
    Level,
    PressureState,
    Resource,
    Sample,
    Snapshot,
    Transition,
)
from delivery.backpressure.samplers import (
    BatchPointsSampler,
    InFlight,
    Sampler,
    default_samplers,
)
from queues.database import OUTAGE, is_unavailable
from queues.models import EventLevel

log = logging.getLogger(__name__)

SubmissionKind = Literal["pickup", "replay"]


class Monitor:
    """Samples every resource each ``config.interval`` seconds while started.

    ``samplers`` replace the real ones per resource (tests feed readings with
    ``ManualSampler``). ``uncommitted`` is the version-bucket counter the
    ingress keeps. With ``persist=False`` nothing is written to the database.
    """

    def __init__(
        self,
        config: BackPressureConfig,
        samplers: Mapping[Resource, Sampler] | None = None,
        *,
        uncommitted: InFlight | None = None,
        persist: bool = True,
    ) -> None:
        self.config = config
        self.node = config.node or default_node_name()
        self.uncommitted = uncommitted or InFlight()
        self.samplers: dict[Resource, Sampler] = {
            **default_samplers(config, self.uncommitted),
            **(samplers or {}),
        }
        self.persist = persist
        self.state = PressureState(config.resources, config.tarpit)
        # The decisions in force; replaced (never mutated) once per interval.
        self.snapshot = Snapshot()
        # MAIL FROM decisions given: tarpitted, refused_untrusted, refused_trusted.
        self.counters: Counter[str] = Counter()
        self._settled = Snapshot()  # the snapshot whose rows and events are stored
        self._changed = threading.Condition()
        self._unreadable: dict[Resource, str | None] = {}
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None
        self._task: asyncio.Task | None = None

    @classmethod
    def from_settings(cls) -> Monitor:
        return cls(BackPressureConfig.from_settings())

    # --- the interface of the ingress, pickup and replay

    def mail_from_decision(self, trusted: bool) -> Decision:
        """Delay or refuse a MAIL FROM; trusted = in MAILRELAY_RELAY_NETWORKS (or authenticated)."""
        snapshot = self.snapshot
        decision = snapshot.trusted if trusted else snapshot.untrusted
        if decision.refuse_reply is not None:
            self.counters["refused_trusted" if trusted else "refused_untrusted"] += 1
        elif decision.delay_seconds > 0:
            self.counters["tarpitted"] += 1
        return decision

    def allows_submission(self, kind: SubmissionKind) -> bool:
        """May the pickup or replay folder submit now? No whenever an untrusted
        client would be refused (medium disk or memory, a tarpit resource past
        its history depth, anything high)."""
        if kind not in ("pickup", "replay"):
            raise ValueError(f"unknown submission kind {kind!r}")
        return self.snapshot.untrusted.refuse_reply is None

    def level(self, resource: Resource) -> Level | None:
        return self.snapshot.level(resource)

    # --- life cycle

    @property
    def running(self) -> bool:
        return self._task is not None and not self._task.done()

    async def start(self) -> None:
        """Take the first readings now (so the first session is judged), then
        keep sampling every interval in a task."""
        if self._task is not None:
            return
        self._executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="backpressure")
        if self.persist:
            await self._in_thread(self._prune)
        await self.tick()
        self._task = asyncio.get_running_loop().create_task(
            self._run(), name="back-pressure monitor"
        )
        log.info("back pressure: monitoring every %gs as node %s", self.config.interval, self.node)

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if self._executor is None:
            return
        if self.persist:
            await self._in_thread(self._forget)
        await self._in_thread(self._close)
        self._executor.shutdown(wait=False)
        self._executor = None

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        interval = self.config.interval
        next_at = loop.time() + interval
        while True:
            await asyncio.sleep(max(0.0, next_at - loop.time()))
            next_at += interval
            if next_at < loop.time():  # an interval overran: do not catch up in a burst
                next_at = loop.time() + interval
            try:
                await self.tick()
            except Exception:
                log.exception("back pressure: an interval failed")

    async def tick(self) -> Snapshot:
        """One interval: read, judge, store. Runs on the event loop."""
        samples = await self._in_thread(self._sample_all)
        previous = self.snapshot
        snapshot, transitions = self.state.observe(samples)
        self.snapshot = snapshot
        for transition in transitions:
            log.log(
                logging.WARNING if transition.rising else logging.INFO,
                "back pressure: %s %s -> %s (reading %s)",
                transition.resource.label,
                transition.old,
                transition.new,
                transition.reading,
            )
        notices = self._history_notices(previous, snapshot)
        if any(t.rising and t.resource in GC_RESOURCES for t in transitions):
            await self._in_thread(gc.collect)
        if self.persist:
            await self._in_thread(self._save, snapshot, transitions, notices)
        with self._changed:
            self._settled = snapshot
            self._changed.notify_all()
        return snapshot

    def wait_for(self, predicate: Callable[[Snapshot], bool], timeout: float = 10.0) -> Snapshot:
        """Block (another thread than the loop's) until an interval, stored,
        satisfies ``predicate``; returns that snapshot. For tests and tools."""
        deadline = time.monotonic() + timeout
        with self._changed:
            while not predicate(self._settled):
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise TimeoutError(f"back pressure: condition not met in {timeout} s")
                self._changed.wait(remaining)
            return self._settled

    # --- in the monitor's thread

    async def _in_thread(self, fn: Callable, *args: object) -> object:
        assert self._executor is not None, "the monitor is not started"
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    def _sample_all(self) -> dict[Resource, Sample]:
        samples = {}
        for resource, sampler in self.samplers.items():
            try:
                sample = sampler.read()
            except Exception as exc:  # noqa: BLE001 - one bad sampler must not stop the others
                log.debug("back pressure: reading %s failed", resource.label, exc_info=True)
                sample = Sample.unreadable(f"{type(exc).__name__}: {exc}")
            samples[resource] = sample
            why = sample.note if sample.value is None else None
            if why != self._unreadable.get(resource):
                if why is not None:
                    log.warning("back pressure: %s not monitored: %s", resource.label, why)
                elif resource in self._unreadable:
                    log.info("back pressure: %s monitored again", resource.label)
                self._unreadable[resource] = why
        return samples

    def _history_notices(self, previous: Snapshot, snapshot: Snapshot) -> list[tuple[str, dict]]:
        """A resource that reached its history depth without returning to normal."""
        notices = []
        for resource, status in snapshot.statuses.items():
            before = previous.statuses.get(resource)
            if (
                status.action is Action.REFUSE_UNTRUSTED
                and before is not None
                and before.action in (Action.NONE, Action.TARPIT)
                and before.level is status.level
            ):
                text = (
                    f"Back pressure: {resource.label} has not returned to normal within its "
                    f"history depth ({status.history_depth} intervals) on {self.node}: MAIL FROM "
                    "from untrusted clients is refused, pickup and replay stop"
                )
                notices.append(
                    (
                        text,
                        {
                            "resource": resource.value,
                            "level": status.level_name,
                            "reading": status.reading,
                            "history_depth": status.history_depth,
                        },
                    )
                )
                log.warning("%s", text)
        return notices

    def _save(
        self,
        snapshot: Snapshot,
        transitions: Sequence[Transition],
        notices: Sequence[tuple[str, dict]],
    ) -> None:
        try:
            store.pressure_save(self.node, snapshot, transitions)
            for text, data in notices:
                store.pressure_event(self.node, text, data, EventLevel.WARNING)
        except Exception as exc:
            # The next interval stores the state again; a lost event is logged above.
            _failed("storing the readings", exc)
            connections["default"].close()
        else:
            OUTAGE.recovered()

    def _prune(self) -> None:
        try:
            store.pressure_prune()
        except Exception as exc:
            _failed("pruning old nodes", exc)
            connections["default"].close()

    def _forget(self) -> None:
        for attempt in (1, 2):
            try:
                store.pressure_forget(self.node)
                return
            except Exception as exc:
                connections["default"].close()
                # A connection broken by an outage since the last interval: once more.
                if attempt == 2 or not is_unavailable(exc):
                    _failed("removing this node's rows", exc)
                    return

    def _close(self) -> None:
        for sampler in self.samplers.values():
            if isinstance(sampler, BatchPointsSampler):
                sampler.close()
        connections.close_all()


def _failed(what: str, exc: Exception) -> None:
    """A database that is away is one outage (logged once, queues.database.OUTAGE), not a
    traceback every interval; anything else is traced."""
    if is_unavailable(exc):
        OUTAGE.failed(exc)
        log.debug("back pressure: %s failed: %s", what, exc)
    else:
        log.warning("back pressure: %s failed", what, exc_info=exc)
