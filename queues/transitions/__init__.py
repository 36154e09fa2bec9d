"""Every state transition of the queue store, written once.

The store owns every state word: a Message's state, suspension, problem and
poison counters and lease; a Recipient's state and lease; a Link's state and
lease; a Queue's suspension and re-route. Nothing outside this package writes
them (tests/test_state_writes.py scans the source). The categorizer,
delivery, the sweep and the operator actions (UI, API, CLI alike) change them
only through these QuerySet methods (``Message.objects``,
``Recipient.objects``, ``Link.objects``, ``Queue.objects``): one transition
each for back to Submission (``resubmit``), suspend and resume, revive,
poison, re-route. The engine hands over pure outcomes (``queues.outcomes``:
a round's ``record_round``), never a state word. The models are looked up
by name (``model_named``): they import this package for their managers.

Two modules: ``flow`` holds the transitions of a message's way through the
relay (the categorizer's claim and placement, a delivery round's claim,
record and release, finishing a message), ``operator`` extends its
QuerySets with the operator's and the sweep's (suspend, resume, revive,
poison, resubmit, fail, expire, re-route, reclaim).

The rules of ownership (a claim has an owner and a lease; an owner that
lost its claim writes nothing; a crash counts only against the message
being worked on) are written here; README "Ownership and crash recovery".

Every method here is one set-based statement (or a few, in the caller's
transaction); none loads message bodies.
"""

from queues.transitions.flow import (
    Claim,
    deliveries_heard,
    hear_deliveries,
    new_owner,
    poisoned,
    while_connected,
    while_renewing,
)
from queues.transitions.operator import (
    LinkQuerySet,
    MessageQuerySet,
    QueueQuerySet,
    RecipientQuerySet,
)

__all__ = [
    "Claim",
    "LinkQuerySet",
    "MessageQuerySet",
    "QueueQuerySet",
    "RecipientQuerySet",
    "deliveries_heard",
    "hear_deliveries",
    "new_owner",
    "poisoned",
    "while_connected",
    "while_renewing",
]
