"""Celery tasks: thin doorbell handlers around the engine's functions, and the
doorbells that start them. The only Celery module of the engine.

Routed by name (``CELERY_TASK_ROUTES`` in mailrelay/settings.py): categorize
and sweep to the queue ``control`` (a prefork worker), deliver_link to
``delivery`` (a worker with a pool of threads: each task runs in a thread of
its own, with its own database connection, and waits on peers there).

**Doorbells.** Every stage says there is work by the store's work signals
(``queues.signals.categorizer_work``, ``link_work``), never by importing the
module that starts the next stage; ``delivery.apps`` connects them to
``ring_categorizer`` and ``ring_link`` here, which send the task by name. The
database holds the work itself: a lost ring costs latency, never mail (the
periodic sweep finds the work). Tests replace ``current_app`` to record rings.

**Before every task** of a worker (``task_prerun``, connected here, for the
tracking and insight tasks too) a database connection that broke is dropped.
"""

from __future__ import annotations

import logging
import time

from celery import current_app, shared_task
from celery.signals import task_prerun
from django.conf import settings
from django.db import close_old_connections

from delivery.qmgr.categorize import categorize_pending, worker_id
from delivery.qmgr.ownership import waits_for_database
from delivery.qmgr.sweep import reclaim as reclaim_now
from delivery.qmgr.sweep import sweep as sweep_now
from delivery.smtp.deliver import deliver_link as deliver_link_now

log = logging.getLogger(__name__)

CATEGORIZE = "delivery.tasks.categorize"
DELIVER_LINK = "delivery.tasks.deliver_link"

# A categorize task hands over to a fresh task after this long, so one
# backlog cannot pin a worker process forever.
CATEGORIZE_SLICE_SECONDS = 30


@task_prerun.connect
def _drop_broken_connections(**kwargs: object) -> None:
    # Connections persist across tasks (CELERY_DB_REUSE_MAX); one that broke
    # (database restarted) is closed here so the task opens a fresh one.
    close_old_connections()


def ring_categorizer(sender: object = None, **kwargs: object) -> None:
    """Receiver of ``categorizer_work``: a categorize task."""
    try:
        current_app.send_task(CATEGORIZE)
    except Exception:  # noqa: BLE001 - the sweep will find the work
        log.warning(
            "could not ring the categorizer; the sweep will pick the work up", exc_info=True
        )


def ring_link(
    sender: object = None, *, link_id: int, countdown: float | None = None, **kwargs: object
) -> None:
    """Receiver of ``link_work``: a deliver_link task for ``link_id``. With
    ``countdown`` (seconds), a task that starts then; that one raises when the
    broker cannot take it (the sender says what the sweep will do instead)."""
    if countdown is not None:
        current_app.send_task(DELIVER_LINK, (link_id,), countdown=countdown)
        return
    try:
        current_app.send_task(DELIVER_LINK, (link_id,))
    except Exception:  # noqa: BLE001 - the sweep will find the work
        log.warning(
            "could not ring link %s; the sweep will pick the work up", link_id, exc_info=True
        )


@shared_task(name=CATEGORIZE)
def categorize() -> int | None:
    # One owner across the reruns an outage costs, as deliver_link below: a
    # rerun first finishes the batch an earlier run claimed (its reply lost).
    return waits_for_database(_categorize)(worker_id())


def _categorize(owner: str) -> int:
    started = time.monotonic()
    total = 0
    gather = settings.MAILRELAY_CATEGORIZER_BATCH_WAIT.total_seconds()
    full = settings.MAILRELAY_CATEGORIZER_BATCH
    held_first = True
    while True:
        taken = categorize_pending(owner, limit=full, held_first=held_first)
        held_first = False
        total += taken
        if not taken:
            return total
        if time.monotonic() - started > CATEGORIZE_SLICE_SECONDS:
            ring_categorizer()
            return total
        if taken < full and gather > 0:
            # The batch took all that was waiting and more is arriving: let the
            # next one gather it (a batch costs the same statements for 3
            # messages or 300). A full batch goes on at once.
            _batch_wait(gather)


_batch_wait = time.sleep  # MAILRELAY_CATEGORIZER_BATCH_WAIT between batches (tests watch it)


@shared_task(name=DELIVER_LINK)
def deliver_link(link_id: int) -> int | None:
    # One owner for the task, across the reruns an outage costs: the link's
    # lease an earlier run took (its reply lost with the connection) is still
    # its own, not a stranger's to wait out.
    return waits_for_database(deliver_link_now)(link_id, worker_id())


# The periodic tasks do not wait for the database: their next run comes anyway.
@shared_task(name="delivery.tasks.sweep")
@waits_for_database(wait=0)
def sweep() -> dict:
    report = sweep_now()
    return {"links_rung": len(report.links_rung), "purged": report.purged}


@shared_task(name="delivery.tasks.reclaim")
@waits_for_database(wait=0)
def reclaim() -> dict:
    """Take back the claims of dead owners and ring for their work (delivery.qmgr.ownership)."""
    report = reclaim_now()
    return {"recipients": report.recipients_reclaimed, "messages": report.messages_reclaimed}
