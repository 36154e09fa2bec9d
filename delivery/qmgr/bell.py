"""Doorbells: tell the workers there is work. The database holds the work itself.

A lost ring costs latency, never mail: the periodic sweep finds the work
from the database. Tests replace these functions to drive work themselves.
"""

from __future__ import annotations

import logging

log = logging.getLogger(__name__)


def ring_categorizer() -> None:
    from delivery.qmgr.tasks import categorize

    try:
        categorize.delay()
    except Exception:  # noqa: BLE001 - the sweep will find the work
        log.warning(
            "could not ring the categorizer; the sweep will pick the work up", exc_info=True
        )


def ring_link(link_id: int) -> None:
    from delivery.qmgr.tasks import deliver_link

    try:
        deliver_link.delay(link_id)
    except Exception:  # noqa: BLE001 - the sweep will find the work
        log.warning(
            "could not ring link %s; the sweep will pick the work up", link_id, exc_info=True
        )
