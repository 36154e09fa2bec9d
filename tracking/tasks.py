"""Celery tasks of tracking and webhooks (doorbells; the database holds the work).

``send_webhooks`` runs in the queue ``webhooks`` (its own thread-pool worker),
``webhook_sweep`` and ``maintain`` in ``control`` from beat.
"""

from __future__ import annotations

import time

from celery import shared_task

from queues.database import waits_for_database
from queues.lib import clock
from tracking import partitions, sender
from tracking.config import tracking_settings

SLICE_SECONDS = 60


@shared_task(name="tracking.tasks.send_webhooks")
def send_webhooks() -> int:
    """Send due webhooks until none is due (or a minute passed: then ring again).

    The sender's owner token is drawn once: when the database goes away, the
    task waits for it and runs again as the same owner, first sending what it
    still holds (a claim committed while its reply was lost), not leaving those
    rows to wait out their lease."""
    return waits_for_database(_send_all)(sender.owner_id(), time.monotonic()) or 0


def _send_all(owner: str, started: float) -> int:
    total = 0
    held = True  # each run (a rerun after an outage too) first takes what it holds
    while taken := sender.send_due(owner, held=held):
        total += taken
        held = False
        if time.monotonic() - started > SLICE_SECONDS:
            send_webhooks.delay()
            break
    return total


@shared_task(name="tracking.tasks.webhook_sweep")
def webhook_sweep() -> bool:
    """Beat's safety net: ring the sender when due webhooks wait (a ring was lost);
    fail the pending ones older than MAILRELAY_WEBHOOK_RETRY_FOR (one UPDATE)."""
    sender.fail_expired(clock.now())
    if sender.has_due():
        send_webhooks.delay()
        return True
    return False


@shared_task(name="tracking.tasks.maintain")
def maintain() -> dict:
    """Partitions of the coming days, tracking rows past retention, old webhook rows."""
    now = clock.now()
    try:
        report = partitions.maintain(now, tracking_settings().retention)
    finally:  # webhook rows are failed and pruned whatever became of the partitions
        failed_webhooks = sender.fail_expired(now)
        pruned_webhooks = sender.prune(now)
    return {
        "created": report.created,
        "not_made": report.not_made,
        "today_missing": report.today_missing,
        "dropped": report.dropped,
        "pruned": report.pruned,
        "webhooks_failed": failed_webhooks,
        "webhooks_pruned": pruned_webhooks,
    }
