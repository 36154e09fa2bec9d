"""The transitions of a message's way through the relay (``queues.transitions``):
the categorizer's claim and placement, a delivery round's claim, record and
release, a link's lease and verdict, and finishing a message; the operator's
and the sweep's extend these QuerySets (``queues.transitions.operator``).
The ``Claim`` that holds such rows while its owner works, renewing their lease,
and the retry hints' QuerySet are here too."""

from __future__ import annotations

import concurrent.futures
import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from datetime import datetime, timedelta
from typing import TypeVar

from django.apps import apps
from django.db import connection, models, transaction
from django.db.models import Exists, F, OuterRef, Q

from queues.config import store_settings
from queues.database import (
    drop_connection,
    field_columns,
    json_payload,
    postgresql,
    prepared_cursor,
    retry_outages,
    update_json,
)
from queues.lib import clock
from queues.outcomes import Delivered, LinkOutcome, RecipientOutcome, Verdict
from queues.states import (
    FINAL_RECIPIENT_STATES,
    WAITING_RECIPIENT_STATES,
    LinkState,
    MessageState,
    RecipientState,
)

log = logging.getLogger(__name__)
T = TypeVar("T")


def model_named(name: str) -> type[models.Model]:
    """A model of the store by name: the models import this module for their
    managers, so this module never imports them (no cycle)."""
    return apps.get_model("queues", name)


def new_owner() -> str:
    """An owner token for a claim (a categorizer batch, a link's delivery task, a
    webhook sender): host, process and a random part, unique among the live."""
    return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"


def poisoned(crash_count: int) -> bool:
    """The poison rule: a message whose processing crashed its worker more than
    MAILRELAY_POISON_THRESHOLD times is parked in the Poison queue."""
    return crash_count > store_settings().poison_threshold


# Finish the messages of ids whose every recipient is final; (id, finished) of
# each one not done yet (MessageQuerySet.finish_ids).
# The final recipient states, bound as one array (``<> ALL``) in the statements below.
_FINAL_STATES = [str(state) for state in FINAL_RECIPIENT_STATES]

_FINISH_SQL = """WITH live AS (SELECT id FROM queues_message
  WHERE id = ANY(%(ids)s::bigint[]) AND state <> %(done)s),
f AS (UPDATE queues_message AS m SET state = %(done)s, completed_at = %(now)s,
  lease_owner = '', lease_until = NULL WHERE m.id IN (SELECT id FROM live) AND NOT EXISTS (
  SELECT 1 FROM queues_recipient AS r WHERE r.message_id = m.id
  AND r.state <> ALL(%(final)s::varchar[])) RETURNING m.id)
SELECT live.id, f.id IS NOT NULL FROM live LEFT JOIN f ON f.id = live.id"""


class MessageFlow(models.QuerySet):
    # --- the categorizer's claim ---------------------------------------------------

    def due_for_categorizer(self, now: datetime) -> MessageFlow:
        return self.filter(state=MessageState.SUBMISSION, next_attempt_at__lte=now, suspended=False)

    def claim_for_categorizer(
        self, owner: str, limit: int, now: datetime, lease: timedelta
    ) -> list[tuple[int, int]]:
        """Claim due Submission messages for ``owner``: (id, crash_count) pairs
        by id (one statement on PostgreSQL: the claim and the poison check
        together).

        A message that was in a batch whose owner died (``isolate``) is claimed
        alone, and only a message claimed alone has the try counted in
        ``crash_count`` before it is processed (cleared by ``categorized``): so
        a hard crash of a batch is never counted against its innocent members,
        and the message that really kills its worker reaches the poison
        threshold on its own.
        """
        if postgresql():  # one statement, its plan pinned (migration queues/0014)
            with prepared_cursor() as cur:
                cur.execute(
                    "SELECT * FROM queues_claim_for_categorizer(%s, %s, %s, %s)",
                    [now, limit, owner, now + lease],
                )
                return sorted(cur.fetchall())
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
            counts = dict(self.filter(id__in=ids).values_list("id", "crash_count"))
        return [(mid, counts[mid]) for mid in ids]

    def owned_by(self, owner: str) -> MessageFlow:
        """Messages a categorizer still holds (its claim not taken back meanwhile)."""
        return self.filter(state=MessageState.CATEGORIZING, lease_owner=owner)

    def claim_held(self, owner: str, now: datetime, lease: timedelta) -> list[tuple[int, int]]:
        """What ``owner`` claimed and still holds, its lease renewed: (id,
        crash_count) pairs, as the claim returns them. A categorizer task run
        again after an outage takes back its batch whose claim committed but
        whose reply was lost (an expired lease is the reclaim's, not taken)."""
        with transaction.atomic():
            held = (
                self.owned_by(owner).filter(lease_until__gt=now).select_for_update(skip_locked=True)
            )
            pairs = sorted(held.values_list("id", "crash_count"))
            if pairs:
                self.filter(id__in=[mid for mid, _ in pairs]).update(lease_until=now + lease)
        return pairs

    def renew(self, owner: str, until: datetime) -> int:
        return self.owned_by(owner).update(lease_until=until)

    def queue_owned(self, ids: Sequence[int], owner: str) -> list[int]:
        """The categorizer's write fence and its result in one statement: those of
        ``ids`` that ``owner`` still holds become queued (``categorized``), locked
        until the caller's transaction ends; returns their ids. The caller then
        places only their recipients, in the same transaction."""
        if postgresql():
            with prepared_cursor() as cur:  # its plan pinned (migration queues/0018)
                cur.execute(
                    "SELECT * FROM queues_queue_owned(%s::bigint[], %s)", [list(ids), owner]
                )
                return sorted(row[0] for row in cur.fetchall())
        mine = sorted(
            self.select_for_update().filter(id__in=ids).owned_by(owner).values_list("id", flat=True)
        )
        self.model.objects.filter(id__in=mine).categorized()
        return mine

    def resubmit_if_recipients_submitted(self, ids: Sequence[int], now: datetime) -> int:
        """``with_submitted_recipients().back_to_submission(now)`` of the queued
        messages among ``ids`` (one hand-written statement on PostgreSQL)."""
        if not postgresql():
            return self.filter(id__in=ids).with_submitted_recipients().back_to_submission(now)
        with prepared_cursor() as cur:  # its plan pinned (migration queues/0014)
            cur.execute(
                "SELECT queues_resubmit_if_recipients_submitted(%s::bigint[], %s)", [list(ids), now]
            )
            return cur.fetchone()[0]

    def finish_ids(self, ids: Iterable[int], now: datetime, *, again: bool = True) -> int:
        """``filter(id__in=ids).finish(now)``: one hand-written statement on
        PostgreSQL; ``again``: ``finish_after_commit`` those it could not finish."""
        if not (ids := list(ids)):
            return 0
        if not postgresql():
            return self.filter(id__in=ids).finish(now)
        with connection.cursor() as cur:
            done = MessageState.DONE
            cur.execute(_FINISH_SQL, {"ids": ids, "done": done, "now": now, "final": _FINAL_STATES})
            rows = cur.fetchall()
        if again:
            self.finish_after_commit([mid for mid, finished in rows if not finished], now)
        return sum(finished for _, finished in rows)

    def finish_after_commit(self, ids: Iterable[int], now: datetime) -> None:
        """Check ``ids`` again once this transaction commits (now, outside one).
        Two transactions finalizing the last recipients of one message at once
        (two links' rounds; a round and an expiry or a removal) each see the
        other's recipient as it was, and neither finishes the message; of the
        checks after their commits, the later sees both. PostgreSQL only (SQLite
        has one writer at a time); a failed check is logged, not raised."""
        if not (ids := sorted(set(ids))) or not postgresql():
            return

        def check() -> None:
            try:
                self.model.objects.finish_ids(ids, now, again=False)
            except Exception:  # noqa: BLE001 - the commit it follows stands
                log.warning("checking %d messages for completion failed", len(ids), exc_info=True)

        transaction.on_commit(check) if connection.in_atomic_block else check()

    # --- the operator's transitions (queues.services) and the poison guard ----------

    def count_message_failures(self, ids: Iterable[int]) -> None:
        """A message-level 4xx (the peer refused the message, not a recipient):
        counted; past MAILRELAY_PER_MESSAGE_FAILURES_BEFORE_PROBLEM the message is
        a problem message (Exchange)."""
        ids = list(ids)
        if not ids:
            return
        threshold = store_settings().failures_before_problem
        self.filter(id__in=ids).update(per_message_failures=F("per_message_failures") + 1)
        self.filter(id__in=ids, per_message_failures__gte=threshold).update(problem=True)

    def categorized(self) -> int:
        """The categorizer placed every recipient: queued, the claim and crash count cleared."""
        return self.filter(state=MessageState.CATEGORIZING).update(
            state=MessageState.QUEUED,
            lease_owner="",
            lease_until=None,
            crash_count=0,
            isolate=False,
        )

    def back_to_submission(self, now: datetime) -> int:
        """Queued messages with recipients sent back to the categorizer."""
        return self.filter(state=MessageState.QUEUED).update(
            state=MessageState.SUBMISSION, next_attempt_at=now
        )

    def with_submitted_recipients(self) -> MessageFlow:
        Recipient = model_named("Recipient")
        return self.filter(
            Exists(Recipient.objects.filter(message=OuterRef("pk"), state=RecipientState.SUBMITTED))
        )

    def finish(self, now: datetime) -> int:
        """Mark done the messages whose every recipient reached a final state
        (on PostgreSQL with the check after commit: ``finish_after_commit``)."""
        if postgresql():
            return self.finish_ids(
                self.exclude(state=MessageState.DONE).values_list("id", flat=True), now
            )
        Recipient = model_named("Recipient")
        pending = Recipient.objects.filter(message=OuterRef("pk")).exclude(
            state__in=FINAL_RECIPIENT_STATES
        )
        return (
            self.exclude(state=MessageState.DONE)
            .exclude(Exists(pending))
            .update(state=MessageState.DONE, completed_at=now, lease_owner="", lease_until=None)
        )


class RecipientFlow(models.QuerySet):
    def waiting(self) -> RecipientFlow:
        return self.filter(state__in=WAITING_RECIPIENT_STATES)

    def due_on_link(self, link_id: int, now: datetime) -> RecipientFlow:
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
        again: bool = False,
    ) -> list[int]:
        """Claim due recipients of a link for one delivery round; returns their ids.

        Oldest first, at most ``limit`` recipients and, counting each message
        once, at most ``max_bytes`` of message data (always at least the first
        message, whatever its size).

        ``again``: the same claim tried again because the connection broke; its
        first try may have committed with the reply lost, so the rows the round
        already holds are its claim, if there are any.
        """
        if again and (
            held := list(self.owned_by(owner).order_by("id").values_list("id", flat=True))
        ):
            return held
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
            if ids and postgresql():  # its plan pinned (migration queues/0014)
                with prepared_cursor() as cur:
                    cur.execute(
                        "SELECT queues_lease_recipients(%s::bigint[], %s, %s)",
                        [ids, owner, now + lease],
                    )
            elif ids:
                self.filter(id__in=ids).update(
                    state=RecipientState.ACTIVE, lease_owner=owner, lease_until=now + lease
                )
        return ids

    # --- the categorizer's placements ----------------------------------------------

    def place_many(self, placements: Sequence[tuple[int, int, int]], now: datetime) -> set[int]:
        """Submitted recipients routed, for (recipient id, queue id, link id)
        triples of several queues: waiting in their delivery queue, due now, their
        routing (``routed_at``, ``routed_queue``, ``routed_link``: their ``routed``
        event) written. Rows an expiry or an operator finished meanwhile are left
        alone. Returns the ids placed; one statement on PostgreSQL."""
        if not placements:
            return set()
        if postgresql():
            with prepared_cursor() as cur:  # its plan pinned (migration queues/0018)
                cur.execute(
                    "SELECT * FROM queues_place_recipients("
                    "%s::bigint[], %s::bigint[], %s::bigint[], %s)",
                    [
                        [rid for rid, _, _ in placements],
                        [qid for _, qid, _ in placements],
                        [lid for _, _, lid in placements],
                        now,
                    ],
                )
                return {rid for (rid,) in cur.fetchall()}
        by_route: dict[tuple[int, int], list[int]] = {}
        for rid, qid, lid in placements:
            by_route.setdefault((qid, lid), []).append(rid)
        placed: set[int] = set()
        for (qid, lid), rids in by_route.items():
            rows = self.filter(id__in=rids, state=RecipientState.SUBMITTED)
            ids = set(rows.select_for_update().values_list("id", flat=True))
            self.filter(id__in=ids).update(
                queue_id=qid,
                state=RecipientState.QUEUED,
                next_attempt_at=now,
                routed_at=now,
                routed_queue_id=qid,
                routed_link_id=lid,
            )
            placed |= ids
        return placed

    # --- delivery -------------------------------------------------------------------

    def owned_by(self, owner: str) -> RecipientFlow:
        """Recipients a delivery round still holds (its claim not taken back)."""
        return self.filter(state=RecipientState.ACTIVE, lease_owner=owner)

    def renew(self, owner: str, until: datetime) -> int:
        return self.owned_by(owner).update(lease_until=until)

    def record_round(
        self,
        rows: Mapping[int, models.Model],
        outcomes: Mapping[int, RecipientOutcome],
        owner: str,
        dead_letter_id: int | None,
        now: datetime,
    ) -> set[int]:
        """A round's outcome written: each recipient's verdict becomes its state
        (delivered and failed are final, failed ones kept in the Dead-letter
        queue ``dead_letter_id``; deferred ones wait until their next try), its
        attempt counted, its last reply kept, its claim cleared.

        Fenced in the same statement: only rows still held by the round ``owner``
        (ACTIVE with its token) are written, and locked until the caller's
        transaction ends; returns their ids. ``rows`` (the round's loaded rows)
        are updated in place, for the NDRs and counters that follow. On
        PostgreSQL one ``UPDATE … FROM json_to_recordset(…) … RETURNING id``.
        """
        if not outcomes:
            return set()
        written = [_apply(rows[rid], o, dead_letter_id, now) for rid, o in outcomes.items()]
        if not postgresql():
            from queues.database import bulk_update_rows

            kept = set(
                self.model.objects.select_for_update()
                .filter(id__in=[row.pk for row in written])
                .owned_by(owner)
                .values_list("id", flat=True)
            )
            bulk_update_rows([row for row in written if row.pk in kept], _RECORDED)
            return kept
        columns = field_columns(self.model, _RECORDED)
        names = [self.model._meta.get_field(name).attname for name in _RECORDED]
        pairs = [(column, name) for (column, _), name in zip(columns, names, strict=True)]
        batch = [{"id": row.pk, **{c: getattr(row, n) for c, n in pairs}} for row in written]
        return update_json(
            self.model._meta.db_table,
            columns,
            batch,
            where="t.state = %s AND t.lease_owner = %s",
            params=[RecipientState.ACTIVE, owner],
        )

    def record_delivered(
        self, attempts: Sequence[Mapping[str, object]], owner: str, now: datetime
    ) -> Callable[[], list[Delivered]]:
        """Deliveries in ONE statement (PostgreSQL; an early record): as ``record_round``
        for rows ``owner`` holds, an Attempt row each (``attempts``: its columns and
        ``last_host``; a lost claim's too), finished messages done (``finish_ids``).
        Returns how to read the rows written, once the caller's transaction
        committed; reading them checks again the messages it could not finish
        (``MessageQuerySet.finish_after_commit``)."""
        ids = [a["recipient_id"] for a in attempts]
        cur = prepared_cursor()  # its plan pinned (migration queues/0014)
        cur.execute(
            "SELECT * FROM queues_record_delivered(%s::json, %s::bigint[], %s, %s, %s::varchar[])",
            [json_payload(attempts), ids, owner, now, _FINAL_STATES],
        )

        def written() -> list[Delivered]:
            rows = [
                Delivered(rid, mid, qid, address, message_done=done)
                for rid, mid, qid, address, done in cur.fetchall()
            ]
            # A message with another recipient in flight elsewhere: checked again.
            model_named("Message").objects.finish_after_commit(
                {d.message_id for d in rows if not d.message_done}, now
            )
            return rows

        return written

    def release(self, now: datetime) -> int:
        """Claimed rows a round never tried (it stopped early): waiting again, due now."""
        return self.filter(state=RecipientState.ACTIVE).update(
            state=RecipientState.QUEUED, lease_owner="", lease_until=None, next_attempt_at=now
        )


# Whether a receiver of queues.signals.attempts_recorded writes rows for a
# delivery that owes no report (tracking: an enabled webhook endpoint or the
# event log; else such a delivery is its attempt alone). While none does, an
# early record of such deliveries (``record_delivered``) is one statement, its
# own transaction (delivery.smtp.deliver).
_deliveries_heard: list[Callable[[], bool]] = []


def hear_deliveries(check: Callable[[], bool]) -> None:
    """Register ``check`` (tracking.apps): True while its receiver writes rows
    for deliveries."""
    if check not in _deliveries_heard:
        _deliveries_heard.append(check)


def deliveries_heard() -> bool:
    return any(check() for check in _deliveries_heard)


# What a round writes of each recipient (record_round).
_RECORDED = [
    "state",
    "attempt_count",
    "last_attempt_at",
    "last_code",
    "last_enhanced",
    "last_text",
    "last_host",
    "lease_owner",
    "lease_until",
    "final_at",
    "first_failure_at",
    "next_attempt_at",
    "queue_id",
]
_FINAL = {Verdict.DELIVERED: RecipientState.DELIVERED, Verdict.FAILED: RecipientState.FAILED}


def _apply(
    row: models.Model, outcome: RecipientOutcome, dead_letter_id: int | None, now: datetime
) -> models.Model:
    """A recipient's outcome on its loaded row (record_round writes it); a final
    one is final as of the round's ``now``."""
    row.attempt_count += 1
    row.lease_owner, row.lease_until = "", None
    row.last_attempt_at, row.last_code = outcome.tried_at, outcome.code
    row.last_enhanced, row.last_text = outcome.enhanced, outcome.text
    row.last_host = outcome.host
    row.first_failure_at = outcome.first_failure_at
    if outcome.verdict == Verdict.DEFERRED:
        row.state = RecipientState.DEFERRED
        if outcome.until is not None:
            row.next_attempt_at = outcome.until
    else:
        row.state, row.final_at = _FINAL[outcome.verdict], now
        if outcome.verdict == Verdict.FAILED:
            row.queue_id = dead_letter_id
    return row


class LinkFlow(models.QuerySet):
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

    def record_round(self, link: models.Model, outcome: LinkOutcome, now: datetime) -> None:
        """A round's verdict on its link: READY, or RETRY when every host failed
        (with the retry clock the rule gave); the queues that delivered, and the
        last error of those that deferred, noted. ``link`` is updated in place."""
        Queue = model_named("Queue")
        link.failure_count = outcome.failure_count
        link.first_failure_at = outcome.first_failure_at
        link.next_retry_at = outcome.next_retry_at
        if outcome.failed:
            link.state = LinkState.RETRY
            link.last_error, link.last_error_at = outcome.error, now
        else:
            link.state = LinkState.READY
        if outcome.delivered_queues:
            Queue.objects.filter(id__in=outcome.delivered_queues).update(last_delivery_at=now)
            link.last_success_at = now
        for queue_id, text in outcome.errors_by_queue.items():
            Queue.objects.filter(id=queue_id).update(last_error=text, last_error_at=now)
        if outcome.tls:
            link.last_tls = outcome.tls
        link.save(update_fields=_LINK_RECORDED)


_LINK_RECORDED = [
    "state",
    "failure_count",
    "first_failure_at",
    "next_retry_at",
    "last_error",
    "last_error_at",
    "last_success_at",
    "last_tls",
]


# ----------------------------------------------------------------------------
# Claims that follow liveness: a live owner renews its lease while it works.
#
# A categorizer batch, a delivery round and a link's delivery task each hold
# rows under a lease (``queues.transitions``). The lease is short
# (``MAILRELAY_DELIVERY_LEASE``, 30 s by default) and the owner renews it every
# third of it from the thread that does the work and holds its database
# connection, whatever it is waiting for (a slow peer, a DNS answer, a
# 10-minute reply to the final dot: the SMTP exchange runs in an event-loop
# thread of its own while the owner's thread renews and serves it message
# bodies, see ``delivery.smtp.deliver``). So:
#
# - a process killed with -9, OOM-killed or cut off from PostgreSQL stops
#   renewing, its leases run out, and the sweep's reclaim hands the rows on
#   within one lease and one reclaim interval;
# - a live owner is never robbed by a timer, however long its work takes;
# - a claim is a lease in time, not a belief: ``Claim.held()`` is True only
#   while the monotonic time since the *start* of the last successful renewal
#   is below the lease less a safety margin (``MAILRELAY_DELIVERY_LEASE_MARGIN``,
#   for clock drift between hosts and the time a send takes). A frozen
#   (SIGSTOP, VM pause) or cut-off owner therefore stops by itself — before
#   MAIL FROM and before the final dot — without waiting to hear that it lost,
#   and before anyone else may take its rows over (the sweep takes them back
#   only once the lease in the database has run out). A renewal that fails or
#   is slow counts the same as a lost one. This is the fencing rule of lease
#   systems (Chubby's lease with a local timeout that starts before the
#   request; etcd leases; Kafka's zombie fencing): the holder's own clock ends
#   its lease no later than everyone else's;
# - an owner that found its rows taken knows it at once; its writes are fenced
#   by its owner token anyway.
#
# Renewal runs on the owner's own connection, so ownership is tied to the
# process that does the work; after a database error the connection is
# replaced, so a PostgreSQL restart costs a renewal, not the claim.
# ----------------------------------------------------------------------------

# renew(until) -> False when the claim is gone (taken back by the sweep)
Renew = Callable[[datetime], bool]


def renewal_interval(lease: timedelta) -> float:
    """A third of the lease: two renewals may fail before the lease runs out."""
    return max(0.05, lease.total_seconds() / 3)


def valid_for(lease: timedelta, margin: timedelta | None = None) -> float:
    """How long after the start of a successful renewal the owner may still act:
    the lease less the safety margin (at most a third of the lease, so that short
    leases in tests keep two renewals' worth of validity)."""
    if margin is None:
        margin = store_settings().lease_margin
    seconds = lease.total_seconds()
    return seconds - min(margin.total_seconds(), seconds / 3)


class Claim:
    """One owner's hold on some rows, renewed by the owner while it works.

    ``acquired_at``: the monotonic time at which the request that took the
    rows was sent (their lease runs from then); default now. ``monotonic``:
    the clock (tests move it)."""

    def __init__(
        self,
        name: str,
        renew: Renew,
        lease: timedelta | None = None,
        *,
        acquired_at: float | None = None,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        self.name = name
        self._renew = renew
        self._monotonic = monotonic
        self.lease = lease or store_settings().lease
        self.interval = renewal_interval(self.lease)
        self.valid_for = valid_for(self.lease)
        self.renewed_at = monotonic() if acquired_at is None else acquired_at
        self._lost = threading.Event()

    def held(self) -> bool:
        """Cheap and thread-safe, for the hot loop: False once the claim is lost,
        or once the time since the start of its last successful renewal reached
        the lease less the margin (then it stays lost)."""
        if self._lost.is_set():
            return False
        age = self._monotonic() - self.renewed_at
        if age >= self.valid_for:
            self.lose(f"not renewed for {age:.1f}s (valid for {self.valid_for:.1f}s)")
            return False
        return True

    def lose(self, why: str) -> None:
        if not self._lost.is_set():
            log.warning("lost the claim %s: %s", self.name, why)
            self._lost.set()

    def seconds_to_renewal(self) -> float:
        return max(0.0, self.renewed_at + self.interval - self._monotonic())

    def renew_if_due(self) -> None:
        """Renew when a third of the lease has passed since the last renewal."""
        if self.held() and self.seconds_to_renewal() <= 0:
            self.renew()

    def renew(self) -> None:
        """Extend the lease. Its validity counts from the start of this request:
        a renewal that took long bought less time, one that failed bought none."""
        started = self._monotonic()
        try:
            still = self._renew(clock.now() + self.lease)
        except Exception as exc:  # noqa: BLE001 - the database may be restarting
            log.warning("could not renew the claim %s: %s", self.name, exc)
            drop_connection()
            self.held()  # loses it once the validity has run out
            return
        if not still:
            self.lose("its rows were taken back")
        elif not self._lost.is_set():
            self.renewed_at = started


def while_connected(claim: Claim, work: Callable[[], T]) -> T:
    """Run ``work``; when the database connection breaks (PostgreSQL restarting),
    reconnect and run it again for as long as the claim is held, renewing it,
    so an outage shorter than a lease costs a moment, not the claim (and not a
    second copy of what a round already sent). ``work`` must be safe to repeat:
    one transaction, fenced by the owner token."""

    def still_held() -> bool:
        claim.renew()  # keeps the claim across the outage, or finds it lost
        return claim.held()

    return retry_outages(work, still_held)


def while_renewing(claim: Claim, work: Callable[[], T]) -> T:
    """Run ``work`` in a thread of its own while this thread (the owner, which
    holds the database connection) renews ``claim``: for slow network work
    inside a round, such as fetching a recipient domain's MTA-STS policy, so
    a slow server cannot make the claim run out. ``work`` must not use the
    database and must be bounded by its own deadline; its result is returned
    and its exception raised here."""
    done: concurrent.futures.Future[T] = concurrent.futures.Future()

    def run() -> None:
        try:
            done.set_result(work())
        except BaseException as exc:  # noqa: BLE001 - raised in the owner thread
            done.set_exception(exc)

    threading.Thread(target=run, name=f"{claim.name} wait", daemon=True).start()
    while not concurrent.futures.wait([done], max(0.01, claim.seconds_to_renewal())).done:
        claim.renew_if_due()
    return done.result()


# ----------------------------------------------------------------------------
# Exim's retry data, stored: the queryset of ``RetryHint`` rows (a hint, not a
# state: the rules and the arithmetic live in delivery.smtp.retry).
# ----------------------------------------------------------------------------


class RetryHintQuerySet(models.QuerySet):
    """Exim's retry data, stored (the rules and the arithmetic live in delivery.smtp.retry)."""

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
            self.filter(key__any=keys).delete()
