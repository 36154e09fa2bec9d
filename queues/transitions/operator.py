"""The operator's and the sweep's transitions: suspend and resume, revive, poison,
back to Submission (``resubmit``), fail, expire, re-route, and taking back the
claims of owners that stopped renewing. Each store QuerySet here extends the
message flow's (``queues.transitions.flow``) with them; ``queues.transitions``
hands the models these classes."""

from __future__ import annotations

from datetime import datetime

from django.db import models, transaction
from django.db.models import F, Q

from queues.config import store_settings
from queues.states import (
    FINAL_RECIPIENT_STATES,
    WAITING_RECIPIENT_STATES,
    DeliveryType,
    MessageState,
    RecipientState,
)
from queues.transitions.flow import LinkFlow, MessageFlow, RecipientFlow, model_named, poisoned


def not_locked(expired: models.QuerySet) -> models.QuerySet:
    """The expired claims whose rows no transaction holds (FOR UPDATE SKIP LOCKED):
    a cut-off owner's session may still hold its rows, idle in a transaction,
    until PostgreSQL ends it (MAILRELAY_DB_IDLE_IN_TRANSACTION_TIMEOUT); the
    reclaim must not wait for it — it takes those rows at a later run, and
    everything else at once."""
    return expired.model.objects.filter(
        pk__in=expired.select_for_update(skip_locked=True).values("pk")
    )


class MessageQuerySet(MessageFlow):
    def crashed(self, retry_at: datetime, *, count: bool) -> int:
        """Messages whose categorization raised go back to Submission, to be tried
        alone; ``count`` adds the crash to their count (False when their claim,
        a claim of one, counted the try already)."""
        return self.filter(state=MessageState.CATEGORIZING).update(
            state=MessageState.SUBMISSION,
            lease_owner="",
            lease_until=None,
            next_attempt_at=retry_at,
            crash_count=F("crash_count") + 1 if count else F("crash_count"),
            isolate=True,
        )

    def park_in_poison(self, poison_queue_id: int) -> int:
        """Messages that crashed their workers too often: suspended, their
        unfinished recipients parked in the Poison queue (an operator releases
        them with resume or resubmit)."""
        Recipient = model_named("Recipient")
        ids = list(self.values_list("id", flat=True))
        Recipient.objects.filter(message_id__in=ids).exclude(
            state__in=FINAL_RECIPIENT_STATES
        ).update(
            queue_id=poison_queue_id,
            state=RecipientState.DEFERRED,
            lease_owner="",
            lease_until=None,
        )
        return self.model.objects.filter(id__in=ids).update(
            state=MessageState.QUEUED, suspended=True, lease_owner="", lease_until=None
        )

    def suspend(self, until: datetime | None, by: str) -> int:
        """Hold messages (not finished ones, not held already): nothing of theirs
        is categorized or delivered until resumed (by hand, or at ``until``)."""
        return (
            self.filter(suspended=False)
            .exclude(state=MessageState.DONE)
            .update(suspended=True, suspended_until=until, suspended_by=by[:150])
        )

    def resume(self) -> int:
        """Release held messages (a timed suspension's end runs this too)."""
        return (
            self.filter(suspended=True)
            .exclude(state=MessageState.DONE)
            .update(suspended=False, suspended_until=None, suspended_by="")
        )

    def unpoison(self) -> int:
        """An operator tries again: the poison suspension and crash count cleared."""
        return self.update(suspended=False, crash_count=0, isolate=False)

    def count_crash(self) -> list[int]:
        """A crash while these messages were worked on (a delivery round whose
        recording raised): counted; returns the ids now poisoned (``poisoned``)."""
        self.update(crash_count=F("crash_count") + 1)
        return [
            mid
            for mid, crashes in self.model.objects.filter(pk__in=self.values("pk")).values_list(
                "id", "crash_count"
            )
            if poisoned(crashes)
        ]

    def revive(self, now: datetime, expires_at: datetime) -> int:
        """Finished messages whose dead letters were revived: to Submission, with
        a fresh expiry and their problem counters cleared (MSMQ)."""
        return self.update(
            state=MessageState.SUBMISSION,
            next_attempt_at=now,
            completed_at=None,
            expires_at=expires_at,
            per_message_failures=0,
            problem=False,
        )

    def reclaim_expired(self, now: datetime) -> int:
        """Categorizer claims whose owner stopped renewing: back to Submission, due
        now, each message tried alone next (its batch may have crashed on any one)."""
        expired = self.filter(state=MessageState.CATEGORIZING, lease_until__lt=now)
        with transaction.atomic():  # FOR UPDATE needs one, even in a subquery
            return not_locked(expired).update(
                state=MessageState.SUBMISSION,
                lease_owner="",
                lease_until=None,
                next_attempt_at=now,
                isolate=True,
            )


class RecipientQuerySet(RecipientFlow):
    def park_unreachable(
        self, queue_id: int, now: datetime, retry_at: datetime, *, enhanced: str, text: str
    ) -> int:
        """Submitted recipients with no route for now: in Unreachable until ``retry_at``."""
        return self.filter(state=RecipientState.SUBMITTED).update(
            queue_id=queue_id,
            state=RecipientState.DEFERRED,
            next_attempt_at=retry_at,
            first_failure_at=now,
            last_attempt_at=now,
            last_enhanced=enhanced,
            last_text=text,
            attempt_count=F("attempt_count") + 1,
        )

    def fail(
        self,
        now: datetime,
        *,
        enhanced: str,
        text: str,
        queue_id: int | None = None,
        attempted: bool = False,
    ) -> int:
        """Recipients failed for good (a permanent routing failure, an operator's
        removal): final, moved to ``queue_id`` (the Dead-letter queue) when given;
        ``attempted`` counts it as an attempt."""
        changes: dict = {
            "state": RecipientState.FAILED,
            "final_at": now,
            "lease_owner": "",
            "lease_until": None,
            "last_code": None,
            "last_enhanced": enhanced,
            "last_text": text,
        }
        if queue_id is not None:
            changes["queue_id"] = queue_id
        if attempted:
            changes["last_attempt_at"] = now
            changes["attempt_count"] = F("attempt_count") + 1
        return self.update(**changes)

    def expire(self, rows: list, now: datetime, queue_id: int, reason: str) -> None:
        """Recipients past their message's expiry: EXPIRED in the Dead-letter queue,
        ``reason`` before their last error. ``rows`` are loaded (their NDR quotes
        them) and updated in place."""
        for r in rows:
            r.state, r.final_at, r.queue_id = RecipientState.EXPIRED, now, queue_id
            r.last_enhanced = "4.4.7"
            r.last_text = reason + (f"; last error: {r.last_text}" if r.last_text else "")
        self.bulk_update(rows, ["state", "final_at", "queue_id", "last_enhanced", "last_text"])

    def release_after_crash(self, owner: str, retry_at: datetime, text: str) -> int:
        """A round whose recording raised: its rows wait again, for a while."""
        return self.owned_by(owner).update(
            state=RecipientState.DEFERRED,
            lease_owner="",
            lease_until=None,
            next_attempt_at=retry_at,
            last_text=text,
        )

    def back_to_submission(self, now: datetime) -> int:
        """Waiting recipients go back to the categorizer (resubmit, Unreachable retry)."""
        return self.waiting().update(
            queue=None,
            state=RecipientState.SUBMITTED,
            next_attempt_at=now,
            lease_owner="",
            lease_until=None,
        )

    def resubmit(self, now: datetime) -> int:
        """ "Back to Submission", the one transition: these recipients, those waiting
        (not of a message the categorizer holds), go back to the categorizer,
        and their messages to Submission. Recipients parked in Poison come back
        too: their message loses its poison suspension and crash count (someone
        decided to try again). Returns how many recipients moved. Used by the
        operator's resubmit, resume and retry, the end of a re-route, the sweep
        (Unreachable due again, a link idle too long)."""
        Message = model_named("Message")
        waiting = self.filter(state__in=WAITING_RECIPIENT_STATES).exclude(
            message__state=MessageState.CATEGORIZING
        )
        parked = waiting.filter(queue__delivery_type=DeliveryType.POISON).values("message_id")
        Message.objects.filter(id__in=parked).unpoison()
        Message.objects.filter(id__in=waiting.values("message_id")).back_to_submission(now)
        return waiting.back_to_submission(now)

    def revive(self, now: datetime) -> set[int]:
        """Dead letters (failed or expired recipients of finished messages) get a
        new life: back to the categorizer, their tries forgotten, their messages
        with a fresh expiry (MSMQ). Returns the revived messages' ids."""
        Message = model_named("Message")
        revived = set(self.values_list("message_id", flat=True))
        if not revived:
            return revived
        self.update(
            queue=None,
            state=RecipientState.SUBMITTED,
            next_attempt_at=now,
            final_at=None,
            attempt_count=0,
            first_failure_at=None,
            delay_dsn_sent=False,
            lease_until=None,
        )
        expires_at = now + store_settings().message_expiration
        Message.objects.filter(id__in=revived).revive(now, expires_at)
        return revived

    def reclaim_expired(self, now: datetime) -> int:
        """Rounds whose owner stopped renewing (killed, cut off from the database):
        their recipients wait again, due now."""
        expired = self.filter(state=RecipientState.ACTIVE, lease_until__lt=now)
        with transaction.atomic():  # FOR UPDATE needs one, even in a subquery
            return not_locked(expired).update(
                state=RecipientState.QUEUED, lease_owner="", lease_until=None, next_attempt_at=now
            )


class QueueQuerySet(models.QuerySet):
    """A queue's suspension and re-route (queues.services.actions, .reroute, the
    categorizer's placement)."""

    def suspend(self, until: datetime | None, by: str) -> int:
        return self.update(suspended=True, suspended_until=until, suspended_by=by[:150])

    def resume(self) -> int:
        return self.update(suspended=False, suspended_until=None, suspended_by="")

    def reroute(
        self, link_id: int, *, to: str, until: datetime | None, by: str, home: int | None
    ) -> int:
        """Delivered over ``link_id`` instead, until ``until``; ``home`` is the link
        to return to at the end."""
        return self.update(
            link=link_id, reroute_to=to, reroute_until=until, reroute_by=by[:150], reroute_from=home
        )

    def unroute(self, link_id: int | None) -> int:
        """The re-route ended: back on ``link_id`` (the link it came from)."""
        return self.update(
            link=link_id, reroute_to="", reroute_until=None, reroute_by="", reroute_from=None
        )

    def learn_route(self, link_id: int) -> int:
        """A re-routed queue's route changed meanwhile: it returns there at the end."""
        return self.update(reroute_from=link_id)


class LinkQuerySet(LinkFlow):
    """The sweep's transitions of a link: taking back the lease of an owner that
    stopped renewing, and the links no live owner holds."""

    def reclaim_expired(self, now: datetime) -> int:
        expired = self.filter(lease_until__lt=now)
        with transaction.atomic():  # FOR UPDATE needs one, even in a subquery
            return not_locked(expired).update(lease_owner="", lease_until=None)

    def unowned(self, now: datetime) -> LinkQuerySet:
        return self.filter(Q(lease_until__isnull=True) | Q(lease_until__lt=now))
