"""Every state transition of the queue store, written once.

The categorizer, delivery, the sweep and the operator actions change the
state of messages, recipients and links only through these QuerySet methods
(``Message.objects``, ``Recipient.objects``, ``Link.objects``), so the rules of
ownership are written in one place:

- **A claim has an owner and a lease.** Whoever claims rows (a categorizer
  batch, a delivery round, a link's delivery task) writes its owner token and
  a lease end. A live owner renews the lease while it works
  (``delivery.ownership.LeaseKeeper``), however long the work takes; a dead
  owner stops renewing, and the sweep takes the rows back once the lease has
  run out (``reclaim_expired``), within one lease and one reclaim interval.
- **An owner that lost its claim writes nothing.** Results are written only to
  rows still carrying the owner's token (``owned_by``), under row locks, so a
  late round cannot overwrite what a newer owner did.
- **A crash counts only against the message being worked on.** A batch whose
  owner died is not blamed on every message in it: its messages come back
  marked ``isolate`` and are tried one at a time, and only a message claimed
  alone has the try counted in ``crash_count`` (the poison guard).

Every method here is one set-based statement (or a few, in the caller's
transaction); none loads message bodies.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from datetime import datetime, timedelta

from django.db import models, transaction
from django.db.models import Exists, F, OuterRef, Q

from queues.states import (
    FINAL_RECIPIENT_STATES,
    WAITING_RECIPIENT_STATES,
    MessageState,
    RecipientState,
)


class MessageQuerySet(models.QuerySet):
    # --- the categorizer's claim ---------------------------------------------------

    def due_for_categorizer(self, now: datetime) -> MessageQuerySet:
        return self.filter(state=MessageState.SUBMISSION, next_attempt_at__lte=now, suspended=False)

    def claim_for_categorizer(
        self, owner: str, limit: int, now: datetime, lease: timedelta
    ) -> list[int]:
        """Claim due Submission messages for ``owner``; returns their ids.

        A message that was in a batch whose owner died (``isolate``) is claimed
        alone, and only a message claimed alone has the try counted in
        ``crash_count`` before it is processed (cleared by ``categorized``): so
        a hard crash of a batch is never counted against its innocent members,
        and the message that really kills its worker reaches the poison
        threshold on its own.
        """
        with transaction.atomic():
            due = self.due_for_categorizer(now).select_for_update(skip_locked=True)
            order = ("next_attempt_at", "id")
            ids = list(due.filter(isolate=True).order_by(*order).values_list("id", flat=True)[:1])
            if not ids:
                ids = list(
                    due.filter(isolate=False).order_by(*order).values_list("id", flat=True)[:limit]
                )
            if ids:
                alone = len(ids) == 1
                self.filter(id__in=ids).update(
                    state=MessageState.CATEGORIZING,
                    lease_owner=owner,
                    lease_until=now + lease,
                    crash_count=F("crash_count") + 1 if alone else F("crash_count"),
                    isolate=alone,
                )
        return ids

    def owned_by(self, owner: str) -> MessageQuerySet:
        """Messages a categorizer still holds (its claim not taken back meanwhile)."""
        return self.filter(state=MessageState.CATEGORIZING, lease_owner=owner)

    def renew(self, owner: str, until: datetime) -> int:
        return self.owned_by(owner).update(lease_until=until)

    def categorized(self) -> int:
        """The categorizer placed every recipient: queued, the claim and crash count cleared."""
        return self.filter(state=MessageState.CATEGORIZING).update(
            state=MessageState.QUEUED,
            lease_owner="",
            lease_until=None,
            crash_count=0,
            isolate=False,
        )

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

    def back_to_submission(self, now: datetime) -> int:
        """Queued messages with recipients sent back to the categorizer."""
        return self.filter(state=MessageState.QUEUED).update(
            state=MessageState.SUBMISSION, next_attempt_at=now
        )

    def with_submitted_recipients(self) -> MessageQuerySet:
        from queues.models import Recipient

        return self.filter(
            Exists(Recipient.objects.filter(message=OuterRef("pk"), state=RecipientState.SUBMITTED))
        )

    def finish(self, now: datetime) -> int:
        """Mark done the messages whose every recipient reached a final state."""
        from queues.models import Recipient

        pending = Recipient.objects.filter(message=OuterRef("pk")).exclude(
            state__in=FINAL_RECIPIENT_STATES
        )
        return (
            self.exclude(state=MessageState.DONE)
            .exclude(Exists(pending))
            .update(state=MessageState.DONE, completed_at=now, lease_owner="", lease_until=None)
        )

    def park_in_poison(self, poison_queue_id: int) -> int:
        """Messages that crashed their workers too often: suspended, their
        unfinished recipients parked in the Poison queue (an operator releases
        them with resume or resubmit)."""
        from queues.models import Recipient

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

    def reclaim_expired(self, now: datetime) -> int:
        """Categorizer claims whose owner stopped renewing: back to Submission, due
        now, each message tried alone next (its batch may have crashed on any one)."""
        return self.filter(state=MessageState.CATEGORIZING, lease_until__lt=now).update(
            state=MessageState.SUBMISSION,
            lease_owner="",
            lease_until=None,
            next_attempt_at=now,
            isolate=True,
        )


class RecipientQuerySet(models.QuerySet):
    def waiting(self) -> RecipientQuerySet:
        return self.filter(state__in=WAITING_RECIPIENT_STATES)

    def due_on_link(self, link_id: int, now: datetime) -> RecipientQuerySet:
        return self.waiting().filter(
            queue__link_id=link_id,
            queue__suspended=False,
            next_attempt_at__lte=now,
            message__suspended=False,
        )

    def claim_on_link(
        self,
        link_id: int,
        owner: str,
        now: datetime,
        lease: timedelta,
        *,
        limit: int,
        max_bytes: int,
    ) -> list[int]:
        """Claim due recipients of a link for one delivery round; returns their ids.

        Oldest first, at most ``limit`` recipients and, counting each message
        once, at most ``max_bytes`` of message data (always at least the first
        message, whatever its size).
        """
        with transaction.atomic():
            rows = list(
                self.due_on_link(link_id, now)
                .select_for_update(skip_locked=True, of=("self",))
                .order_by("next_attempt_at", "message_id", "id")
                .values_list("id", "message_id", "message__size")[:limit]
            )
            ids: list[int] = []
            seen: set[int] = set()
            total = 0
            for rid, mid, size in rows:
                if mid not in seen:
                    if seen and total + size > max_bytes:
                        continue
                    seen.add(mid)
                    total += size
                ids.append(rid)
            if ids:
                self.filter(id__in=ids).update(
                    state=RecipientState.ACTIVE, lease_owner=owner, lease_until=now + lease
                )
        return ids

    # --- the categorizer's placements ----------------------------------------------

    def place(self, queue_id: int, now: datetime) -> int:
        """Submitted recipients routed: waiting in their delivery queue, due now
        (rows an expiry or an operator finished meanwhile are left alone)."""
        return self.filter(state=RecipientState.SUBMITTED).update(
            queue_id=queue_id, state=RecipientState.QUEUED, next_attempt_at=now
        )

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

    # --- delivery -------------------------------------------------------------------

    def owned_by(self, owner: str) -> RecipientQuerySet:
        """Recipients a delivery round still holds (its claim not taken back)."""
        return self.filter(state=RecipientState.ACTIVE, lease_owner=owner)

    def renew(self, owner: str, until: datetime) -> int:
        return self.owned_by(owner).update(lease_until=until)

    def record(self, rows: Iterable, fields: Sequence[str]) -> None:
        """A round's results: each row's new state (delivered, deferred with its
        next try, failed), its attempt count and last reply, its claim cleared;
        one UPDATE … FROM VALUES for the round. Callers lock the rows first and
        pass only those the round still owns."""
        from queues.bulk import bulk_update_rows

        bulk_update_rows(list(rows), list(fields))

    def release(self, now: datetime) -> int:
        """Claimed rows a round never tried (it stopped early): waiting again, due now."""
        return self.filter(state=RecipientState.ACTIVE).update(
            state=RecipientState.QUEUED, lease_owner="", lease_until=None, next_attempt_at=now
        )

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

    def reclaim_expired(self, now: datetime) -> int:
        """Rounds whose owner stopped renewing (killed, cut off from the database):
        their recipients wait again, due now."""
        return self.filter(state=RecipientState.ACTIVE, lease_until__lt=now).update(
            state=RecipientState.QUEUED, lease_owner="", lease_until=None, next_attempt_at=now
        )


class LinkQuerySet(models.QuerySet):
    def acquire(self, link_id: int, owner: str, now: datetime, lease: timedelta) -> bool:
        """Become (or stay) the one delivery task of a link: a conditional update."""
        return (
            self.filter(pk=link_id)
            .filter(Q(lease_until__isnull=True) | Q(lease_until__lt=now) | Q(lease_owner=owner))
            .update(lease_owner=owner, lease_until=now + lease)
            == 1
        )

    def renew(self, link_id: int, owner: str, until: datetime) -> bool:
        return self.filter(pk=link_id, lease_owner=owner).update(lease_until=until) == 1

    def release(self, link_id: int, owner: str) -> int:
        return self.filter(pk=link_id, lease_owner=owner).update(lease_owner="", lease_until=None)

    def reclaim_expired(self, now: datetime) -> int:
        return self.filter(lease_until__lt=now).update(lease_owner="", lease_until=None)

    def unowned(self, now: datetime) -> LinkQuerySet:
        return self.filter(Q(lease_until__isnull=True) | Q(lease_until__lt=now))


class RetryHintQuerySet(models.QuerySet):
    """Exim's retry data, stored (the rules and the arithmetic live in delivery.retry)."""

    FIELDS = ("first_failed", "last_tried", "next_try", "expired", "error", "text")

    def load(self, keys: Iterable[str]) -> dict:
        return {h.key: h for h in self.filter(key__in=list(set(keys)))}

    def save(self, hints: Iterable) -> None:
        """Insert or update one row per key (the last one given wins)."""
        rows = {h.key: h for h in hints}
        if rows:
            self.bulk_create(
                list(rows.values()),
                update_conflicts=True,
                unique_fields=["key"],
                update_fields=list(self.FIELDS),
            )

    def clear(self, keys: Iterable[str]) -> None:
        """A success deletes the data (that resets Exim's retry clock)."""
        keys = list(set(keys))
        if keys:
            self.filter(key__in=keys).delete()
