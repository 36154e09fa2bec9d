"""Drive the engine in-process, as the workers would, without a broker."""

from __future__ import annotations

from delivery.qmgr.sweep import _links_with_due_work
from delivery.qmgr.tasks import categorize_pending
from delivery.smtp.deliver import deliver_link


def drain(max_rounds: int = 50) -> int:
    """Categorize and deliver until nothing is due now. Returns work done."""
    total = 0
    for _ in range(max_rounds):
        progressed = 0
        while taken := categorize_pending():
            progressed += taken
        for link_id in _links_with_due_work():
            progressed += deliver_link(link_id)
        total += progressed
        if not progressed:
            return total
    raise AssertionError("the pipeline did not settle")
