"""The periodic insight task (beat, every MAILRELAY_INSIGHT_REFRESH_INTERVAL)."""

from __future__ import annotations

from celery import shared_task

from insight import alerts, deferrals
from queues.lib import clock


@shared_task(name="insight.tasks.refresh", ignore_result=True)
def refresh() -> None:
    """Evaluate the age alerts and refresh the deferral summary."""
    now = clock.now()
    alerts.evaluate(now)
    if deferrals.refresh_due(now):
        deferrals.refresh(now)
