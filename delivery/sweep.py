"""The sweep: find due and orphaned work in the database and ring for it.

The broker is only a doorbell. A lost task, a killed worker or a flushed
broker leaves the work in PostgreSQL, and this periodic pass finds it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from django.conf import settings
from django.db import transaction
from django.db.models import Exists, OuterRef, Q

from delivery import bell
from queues import clock
from queues.models import (
    WAITING_RECIPIENT_STATES,
    DeliveryType,
    Link,
    Message,
    MessageState,
    Recipient,
    RecipientState,
)

log = logging.getLogger(__name__)

PURGE_BATCH = 1000


@dataclass
class SweepReport:
    recipients_reclaimed: int = 0
    messages_reclaimed: int = 0
    unreachable_resubmitted: int = 0
    categorizer_rung: bool = False
    links_rung: list[int] = field(default_factory=list)
    purged: int = 0


def _reclaim_expired_claims(report: SweepReport) -> None:
    now = clock.now()
    # A delivery that died mid-round: its recipients wait again, due now.
    report.recipients_reclaimed = Recipient.objects.filter(
        state=RecipientState.ACTIVE, lease_until__lt=now
    ).update(state=RecipientState.QUEUED, lease_until=None, next_attempt_at=now)
    # A categorizer that died: its messages go back to Submission (crash_count kept).
    report.messages_reclaimed = Message.objects.filter(
        state=MessageState.CATEGORIZING, lease_until__lt=now
    ).update(state=MessageState.SUBMISSION, lease_owner="", lease_until=None, next_attempt_at=now)
    Link.objects.filter(lease_until__lt=now).update(lease_owner="", lease_until=None)


def _resubmit_due_unreachable(report: SweepReport) -> None:
    now = clock.now()
    with transaction.atomic():
        rows = Recipient.objects.select_for_update(skip_locked=True).filter(
            queue__delivery_type=DeliveryType.UNREACHABLE,
            state__in=WAITING_RECIPIENT_STATES,
            next_attempt_at__lte=now,
            message__suspended=False,
        )
        ids = list(rows.values_list("id", flat=True)[:10000])
        if not ids:
            return
        message_ids = set(Recipient.objects.filter(id__in=ids).values_list("message_id", flat=True))
        Recipient.objects.filter(id__in=ids).update(
            queue=None, state=RecipientState.SUBMITTED, next_attempt_at=now
        )
        Message.objects.filter(id__in=message_ids, state=MessageState.QUEUED).update(
            state=MessageState.SUBMISSION, next_attempt_at=now
        )
    report.unreachable_resubmitted = len(ids)


def _links_with_due_work() -> list[int]:
    now = clock.now()
    due = Recipient.objects.filter(
        queue__link=OuterRef("pk"),
        queue__suspended=False,
        state__in=WAITING_RECIPIENT_STATES,
        next_attempt_at__lte=now,
        message__suspended=False,
    )
    return list(
        Link.objects.filter(Q(next_retry_at__isnull=True) | Q(next_retry_at__lte=now))
        .filter(Q(lease_until__isnull=True) | Q(lease_until__lt=now))
        .filter(Exists(due))
        .values_list("id", flat=True)
    )


def _purge_completed(report: SweepReport) -> None:
    cutoff = clock.now() - settings.MAILRELAY_COMPLETED_RETENTION
    ids = list(
        Message.objects.filter(state=MessageState.DONE, completed_at__lt=cutoff).values_list(
            "id", flat=True
        )[:PURGE_BATCH]
    )
    if ids:
        Message.objects.filter(id__in=ids).delete()
    report.purged = len(ids)


def sweep() -> SweepReport:
    """One pass over the queue store.

    Steps:
    1. take back claims whose lease expired (dead deliveries, dead categorizers, links);
    2. send Unreachable recipients whose retry time came back to the categorizer;
    3. ring the categorizer when Submission holds due messages;
    4. ring every link with due recipients that no live task owns;
    5. purge messages completed longer ago than MAILRELAY_COMPLETED_RETENTION.
    """
    report = SweepReport()
    _reclaim_expired_claims(report)
    _resubmit_due_unreachable(report)
    if Message.objects.filter(
        state=MessageState.SUBMISSION, next_attempt_at__lte=clock.now(), suspended=False
    ).exists():
        report.categorizer_rung = True
        bell.ring_categorizer()
    report.links_rung = _links_with_due_work()
    for link_id in report.links_rung:
        bell.ring_link(link_id)
    _purge_completed(report)
    return report
