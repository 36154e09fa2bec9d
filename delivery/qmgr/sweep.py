"""The sweep: find due and orphaned work in the database and ring for it.

The broker is only a doorbell. A lost task, a killed worker or a flushed
broker leaves the work in PostgreSQL, and this periodic pass finds it.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from dataclasses import dataclass, field

from django.db import transaction
from django.db.models import Exists, OuterRef, Q

from delivery.qmgr.config import qmgr_settings
from queues.bounce import dsn
from queues.bounce.notify import notify
from queues.config import store_settings
from queues.lib import clock
from queues.models import (
    WAITING_RECIPIENT_STATES,
    DeliveryType,
    Event,
    EventLevel,
    Link,
    LinkState,
    Message,
    MessageState,
    Recipient,
    RecipientState,
)
from queues.placement import special_queue
from queues.services.counts import queues_recount
from queues.services.timed import end_due as end_timed_actions
from queues.signals import categorizer_work, link_work, messages_purging, recipients_expired

log = logging.getLogger(__name__)

PURGE_BATCH = 1000
EXPIRE_BATCH = 1000


@dataclass
class SweepReport:
    recipients_reclaimed: int = 0
    messages_reclaimed: int = 0
    links_reclaimed: int = 0
    unreachable_resubmitted: int = 0
    categorizer_rung: bool = False
    links_rung: list[int] = field(default_factory=list)
    purged: int = 0
    expired: int = 0
    delay_dsns: int = 0
    resubmitted: int = 0
    timed_ended: int = 0  # suspensions resumed and re-routes ended by their time


def _reclaim_expired_claims(report: SweepReport) -> None:
    """Take back what owners stopped renewing (queues.transitions: the leases of their claims)."""
    now = clock.now()
    # A delivery that died mid-round: its recipients wait again, due now.
    report.recipients_reclaimed = Recipient.objects.reclaim_expired(now)
    # A categorizer that died: its messages go back to Submission, tried alone next.
    report.messages_reclaimed = Message.objects.reclaim_expired(now)
    report.links_reclaimed = Link.objects.reclaim_expired(now)


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
        Recipient.objects.filter(id__in=ids).resubmit(now)
    report.unreachable_resubmitted = len(ids)


def _release_stranded() -> None:
    """A queued message with a recipient back in Submission (a resubmit that raced
    the categorizer) goes back to Submission too, instead of waiting for expiry."""
    # Driven from the small side: the partial index of submitted recipients.
    submitted = Recipient.objects.filter(state=RecipientState.SUBMITTED).values("message_id")
    Message.objects.filter(id__in=submitted).back_to_submission(clock.now())


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
        Link.objects.unowned(now)
        .filter(Q(next_retry_at__isnull=True) | Q(next_retry_at__lte=now))
        .filter(Exists(due))
        .values_list("id", flat=True)
    )


def _purge_completed(report: SweepReport) -> None:
    """Delete finished messages: delivered ones after MAILRELAY_COMPLETED_RETENTION,
    those holding dead letters after MAILRELAY_DEAD_LETTER_RETENTION."""
    now = clock.now()
    in_dead_letter = Recipient.objects.filter(
        message=OuterRef("pk"), queue__delivery_type=DeliveryType.DEAD_LETTER
    )
    done = Message.objects.filter(state=MessageState.DONE)
    ids = list(
        done.filter(completed_at__lt=now - qmgr_settings().completed_retention)
        .exclude(Exists(in_dead_letter))
        .values_list("id", flat=True)[:PURGE_BATCH]
    )
    ids += list(
        done.filter(completed_at__lt=now - qmgr_settings().dead_letter_retention).values_list(
            "id", flat=True
        )[:PURGE_BATCH]
    )
    if ids:
        with transaction.atomic():
            # What outlives them is kept first (tracking's history of their deliveries).
            messages_purging.send(None, message_ids=ids)
            # Only the ids: a plain delete() would first load every body it cascades from.
            Message.objects.filter(id__in=ids).only("id").delete()
    report.purged = len(ids)


def _expire(report: SweepReport) -> None:
    """Fail what is still waiting past its message's expiry, with an NDR (Exchange)."""
    now = clock.now()
    # Driven from the expired messages (a small partial index), not from every
    # waiting recipient: the sweep stays cheap with a large backlog.
    expired = Message.objects.filter(expires_at__lte=now).exclude(state=MessageState.DONE)
    with transaction.atomic():
        rows = list(
            Recipient.objects.select_for_update(skip_locked=True, of=("self",))
            .filter(
                message_id__in=expired.values("id")[:EXPIRE_BATCH],
                state__in=WAITING_RECIPIENT_STATES + (RecipientState.SUBMITTED,),
            )
            .order_by("message_id")[:EXPIRE_BATCH]
        )
        if not rows:
            return
        dead_letter = special_queue(DeliveryType.DEAD_LETTER, now)
        reason = (
            "message expired: not delivered within "
            f"{store_settings().message_expiration} of arrival"
        )
        Recipient.objects.expire(rows, now, dead_letter.pk, reason)
        recipients_expired.send(None, recipients=rows, now=now, reason=reason)
        by_message: dict[int, list[Recipient]] = defaultdict(list)
        for r in rows:
            by_message[r.message_id].append(r)
        # Without bodies: notify reads the one original it quotes, when it quotes it.
        for message in Message.objects.filter(id__in=list(by_message)).defer("data").iterator():
            notify(dsn.FAILURE, message, by_message[message.pk], now=now, expired=True)
        Message.objects.filter(id__in=list(by_message)).finish(now)
    report.expired = len(rows)


def _delay_notifications(report: SweepReport) -> None:
    """One "delayed" DSN per message still waiting DelayNotificationTimeOut after arrival."""
    now = clock.now()
    with transaction.atomic():
        rows = list(
            Recipient.objects.select_for_update(skip_locked=True, of=("self",))
            .filter(
                state__in=WAITING_RECIPIENT_STATES,
                delay_dsn_sent=False,
                message__received_at__lte=now - qmgr_settings().delay_notification_timeout,
            )
            .order_by("message_id")[:EXPIRE_BATCH]
        )
        if not rows:
            return
        by_message: dict[int, list[Recipient]] = defaultdict(list)
        for r in rows:
            by_message[r.message_id].append(r)
        Recipient.objects.filter(id__in=[r.id for r in rows]).update(delay_dsn_sent=True)
        for message in Message.objects.filter(id__in=list(by_message)).defer("data").iterator():
            if notify(dsn.DELAY, message, by_message[message.pk], now=now):
                report.delay_dsns += 1


def _auto_resubmit(report: SweepReport) -> None:
    """A link in Retry that has delivered nothing for MaxIdleTimeBeforeResubmit sends
    its messages back to the categorizer: the route may have changed (Exchange)."""
    now = clock.now()
    idle_time = qmgr_settings().max_idle_time_before_resubmit
    idle = now - idle_time
    links = list(
        Link.objects.filter(state=LinkState.RETRY, first_failure_at__lte=idle).filter(
            Q(last_success_at__isnull=True) | Q(last_success_at__lte=idle)
        )
    )
    for link in links:
        with transaction.atomic():
            # Set-based, re-checked by the UPDATE itself: rows claimed by a delivery
            # meanwhile (ACTIVE) are left alone.
            waiting = Recipient.objects.filter(queue__link=link).waiting()
            moved = waiting.resubmit(now)
            # The idle window starts again, so this happens once per window.
            Link.objects.filter(pk=link.pk).update(first_failure_at=now)
            Event.objects.create(
                created_at=now,
                level=EventLevel.WARNING,
                kind="auto_resubmit",
                text=f"link {link.name} delivered nothing for "
                f"{idle_time}; "
                f"{moved} recipients resubmitted to the categorizer",
                data={"link": link.pk, "recipients": moved},
            )
        report.resubmitted += moved


def reclaim() -> SweepReport:
    """The quick part of the sweep, run more often than the rest (every third of
    MAILRELAY_DELIVERY_LEASE, at most MAILRELAY_SWEEP_INTERVAL): take back the
    claims of dead owners and ring for the work they held, so a killed worker's
    mail moves on within a lease and a third, not a lease and a sweep interval."""
    report = SweepReport()
    _reclaim_expired_claims(report)
    # Timed suspensions and re-routes end here too (they ring after commit).
    report.timed_ended = end_timed_actions(clock.now()).total
    if report.messages_reclaimed:
        report.categorizer_rung = True
        categorizer_work.send(sender=None)
    if report.recipients_reclaimed or report.links_reclaimed:
        report.links_rung = _links_with_due_work()
        for link_id in report.links_rung:
            link_work.send(sender=None, link_id=link_id)
    return report


def sweep() -> SweepReport:
    """One pass over the queue store.

    Steps:
    1. take back claims whose lease expired (dead deliveries, dead categorizers, links);
       resume timed suspensions and end re-routes whose time came (queues.services.timed);
    2. expire what waited past its message's expiry (NDR), send the delay DSNs
       owed, resubmit the messages of links idle in Retry for too long;
    3. send Unreachable recipients whose retry time came back to the categorizer;
    4. ring the categorizer when Submission holds due messages;
    5. ring every link with due recipients that no live task owns;
    6. purge finished messages past their retention (completed, dead-letter);
    7. refresh the queues' counts and history for the Queue Viewer.
    """
    report = SweepReport()
    _reclaim_expired_claims(report)
    report.timed_ended = end_timed_actions(clock.now()).total
    _expire(report)
    _delay_notifications(report)
    _auto_resubmit(report)
    _resubmit_due_unreachable(report)
    _release_stranded()
    if Message.objects.filter(
        state=MessageState.SUBMISSION, next_attempt_at__lte=clock.now(), suspended=False
    ).exists():
        report.categorizer_rung = True
        categorizer_work.send(sender=None)
    report.links_rung = _links_with_due_work()
    for link_id in report.links_rung:
        link_work.send(sender=None, link_id=link_id)
    _purge_completed(report)
    # The Queue Viewer's counts, rates and last-hour history come from here,
    # never from counting messages on a page view.
    queues_recount(clock.now())
    return report
