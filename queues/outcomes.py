"""What a delivery round decided, as data: the engine returns it, the store writes it.

The engine (``delivery.smtp.deliver``) decides a round's meaning without the
database and hands a ``RoundOutcome`` to the store's transitions
(``queues.transitions``), which alone turn it into state words: a
recipient's DELIVERED/FAILED/DEFERRED, a link's READY/RETRY. Pure
dataclasses: no Django, no SMTP.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime
from enum import StrEnum


class Verdict(StrEnum):
    """What became of a recipient in a round."""

    DELIVERED = "delivered"
    FAILED = "failed"  # for good: owed an NDR, kept in the Dead-letter queue
    DEFERRED = "deferred"  # tried again at ``RecipientOutcome.until``


@dataclass
class RecipientOutcome:
    """One recipient's try: the verdict and what the peer said."""

    verdict: Verdict
    tried_at: datetime
    code: int | None
    enhanced: str
    text: str
    host: str  # "mx.example.com [192.0.2.1]"
    first_failure_at: datetime | None  # the start of its run of failures
    until: datetime | None = None  # DEFERRED: its next try (None: keep the one it had)


@dataclass
class LinkOutcome:
    """The link's verdict after a round, and its queues' bookkeeping."""

    failed: bool  # every host failed: the link waits in Retry
    failure_count: int
    first_failure_at: datetime | None
    next_retry_at: datetime | None
    error: str = ""  # the connection error, when failed
    tls: str = ""  # the TLS of the round's last session ("" when none)
    delivered_queues: set[int] = field(default_factory=set)
    errors_by_queue: dict[int, str] = field(default_factory=dict)


@dataclass
class RoundOutcome:
    """A round's outcome: per recipient its verdict, per link its verdict, and the
    messages that had a message-level 4xx (towards a problem message)."""

    now: datetime
    recipients: dict[int, RecipientOutcome] = field(default_factory=dict)
    link: LinkOutcome | None = None
    message_failures: set[int] = field(default_factory=set)


@dataclass(slots=True)
class Delivered:
    """A recipient written DELIVERED by an early record
    (``Recipient.objects.record_delivered``)."""

    id: int
    message_id: int
    queue_id: int | None
    address: str
    state: str = "delivered"
    # Whether the record finished its message (False: another recipient of it
    # was not final in the record's snapshot).
    message_done: bool = True
