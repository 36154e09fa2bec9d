"""Timed operator actions: a suspension or a re-route that ends by itself.

An operator may suspend a queue or a message, or re-route a queue, *until* a
time (``Queue.suspended_until``, ``Message.suspended_until``,
``Queue.reroute_until``; None: until undone by hand). ``end_due`` is run by the
sweep and by the quicker reclaim beat (``delivery.qmgr.sweep``): it resumes what is
due and ends due re-routes with the same cores the operator's resume and
unroute run, each in its own transaction, and rings the engine (the cores
send ``queues.signals`` after commit). Each automatic end is an ``Event`` on
the queue or message, naming who started it, and an ``AuditEntry`` by actor
"system" via "system" (one per queue; one per batch of messages), in the same
transaction as the change.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime

from django.db import transaction

from queues.models import Event, EventLevel, Message, MessageState, Queue

# The "until" of a timed action, parsed and shown (queues.services.until); kept
# importable from here.
from queues.services.until import parse_until, until_text  # noqa: F401

log = logging.getLogger(__name__)

# Messages whose suspension ends in one pass (the rest in the next one).
RESUME_BATCH = 1000
SYSTEM = "system"  # the audit's actor for what ends by itself


@dataclass
class TimedReport:
    queues_resumed: int = 0
    messages_resumed: int = 0
    reroutes_ended: int = 0

    @property
    def total(self) -> int:
        return self.queues_resumed + self.messages_resumed + self.reroutes_ended


def _event(now: datetime, kind: str, text: str, **refs: object) -> Event:
    return Event(created_at=now, level=EventLevel.INFO, kind=kind, text=text, **refs)


def _audit(action: str, target_type: str, ids: list[int], detail: str) -> None:
    from queues.services.actions import Via, _audit

    _audit(SYSTEM, Via.SYSTEM, action, target_type, ids=ids, count=len(ids), detail=detail)


def _resume_queues(now: datetime, report: TimedReport) -> None:
    from queues.services.actions import QueueAction, queue_core

    due = Queue.objects.filter(suspended=True, suspended_until__lte=now)
    for queue_id in list(due.values_list("id", flat=True)):
        with _each("resuming queue", queue_id), transaction.atomic():
            queue = (
                due.select_for_update(skip_locked=True, of=("self",))
                .select_related("link")
                .filter(pk=queue_id)
                .first()
            )
            if queue is None:  # resumed by hand meanwhile, or locked by an operator
                continue
            by = queue.suspended_by
            queue_core(QueueAction.RESUME)(queue, now)
            text = (
                f"queue {queue.name}: suspension by {by or 'an operator'} ended "
                f"({until_text(queue.suspended_until)}); delivering again"
            )
            _event(now, "suspend_ended", text, queue=queue).save()
            _audit("queue_resume", "queue", [queue.pk], text)
            report.queues_resumed += 1


def _resume_messages(now: datetime, report: TimedReport) -> None:
    from queues.services.actions import resume_messages

    # The partial index message_suspended_until: cheap however large the store.
    due = Message.objects.filter(suspended_until__lte=now, suspended=True).exclude(
        state=MessageState.DONE
    )
    # One query when nothing is due; the rows are locked (and checked again) after.
    ids = list(due.order_by("suspended_until", "id").values_list("id", flat=True)[:RESUME_BATCH])
    if not ids:
        return
    with transaction.atomic():
        rows = list(
            due.filter(id__in=ids)
            .select_for_update(skip_locked=True, of=("self",))
            .order_by("suspended_until", "id")
            .values_list("id", "qid", "suspended_by", "suspended_until")
        )
        if not rows:
            return
        resume_messages([mid for mid, *_ in rows], now)
        Event.objects.bulk_create(
            _event(
                now,
                "suspend_ended",
                f"message {qid}: suspension by {by or 'an operator'} ended "
                f"({until_text(until)}); released",
                message_id=mid,
            )
            for mid, qid, by, until in rows
        )
        shown = [f"{qid} (suspended by {by or 'an operator'})" for _, qid, by, _ in rows[:50]]
        more = [f"… and {len(rows) - len(shown)} more"] if len(rows) > len(shown) else []
        _audit(
            "message_resume",
            "message",
            [mid for mid, *_ in rows],
            "\n".join([f"{len(rows)} suspensions ended (their time came)", *shown, *more]),
        )
    report.messages_resumed += len(rows)


def _end_reroutes(now: datetime, report: TimedReport) -> None:
    from queues.services import reroute

    due = Queue.objects.filter(reroute_until__lte=now).exclude(reroute_to="")
    for queue_id in list(due.values_list("id", flat=True)):
        with _each("ending the re-route of queue", queue_id), transaction.atomic():
            queue = (
                due.select_for_update(skip_locked=True, of=("self",))
                .select_related("link")
                .filter(pk=queue_id)
                .first()
            )
            if queue is None:
                continue
            text = (
                f"queue {queue.name}: re-route by {queue.reroute_by or 'an operator'} to "
                f"{queue.reroute_to} ended ({until_text(queue.reroute_until)})"
            )
            reroute.end(queue, now, reason="its end time came")
            _audit("queue_unroute", "queue", [queue.pk], text)
            report.reroutes_ended += 1


@contextlib.contextmanager
def _each(what: str, pk: int) -> Iterator[None]:
    """One queue's timed action: its failure is logged (and its transaction
    rolled back); the other queues are still resumed."""
    try:
        yield
    except Exception:
        log.exception("timed actions: %s %s failed", what, pk)


def end_due(now: datetime) -> TimedReport:
    """Resume the suspensions and end the re-routes whose time came (the sweep
    and the reclaim beat run this). Three small indexed queries when nothing
    is due."""
    report = TimedReport()
    for step in (_resume_queues, _resume_messages, _end_reroutes):
        # A row that keeps failing is logged each pass, never a stop to the
        # sweep that calls this (expiry, purge and the rings come after it).
        try:
            step(now, report)
        except Exception:
            log.exception("timed actions: %s failed", step.__name__.strip("_"))
    return report
