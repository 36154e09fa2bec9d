"""Doorbells: tell the workers there is work. The database holds the work itself.

A lost ring costs latency, never mail: the periodic sweep finds the work
from the database. Tests replace these functions to drive work themselves.

The bells send by task name (``delivery.tasks.*``, routed to their queue by
CELERY_TASK_ROUTES): a stage never imports the module of the stage it
starts, so nothing that rings imports the Celery tasks.
"""

from __future__ import annotations

import logging

from celery import current_app

log = logging.getLogger(__name__)

CATEGORIZE = "delivery.tasks.categorize"
DELIVER_LINK = "delivery.tasks.deliver_link"


def ring_categorizer() -> None:
    try:
        current_app.send_task(CATEGORIZE)
    except Exception:  # noqa: BLE001 - the sweep will find the work
        log.warning(
            "could not ring the categorizer; the sweep will pick the work up", exc_info=True
        )


def ring_link(link_id: int) -> None:
    try:
        current_app.send_task(DELIVER_LINK, (link_id,))
    except Exception:  # noqa: BLE001 - the sweep will find the work
        log.warning(
            "could not ring link %s; the sweep will pick the work up", link_id, exc_info=True
        )


def ring_link_in(link_id: int, seconds: float) -> None:
    """``ring_link`` after ``seconds`` (a countdown task); raises when the broker
    cannot take it (the caller says what the sweep will do instead)."""
    current_app.send_task(DELIVER_LINK, (link_id,), countdown=seconds)
