"""The transitions of a message's way through the relay (``queues.transitions``):
the categorizer's claim and placement, a delivery round's claim, record and
release, a link's lease and verdict, and finishing a message; the operator's
and the sweep's extend these QuerySets (``queues.transitions.operator``).
The retry hints' QuerySet and the ``any`` lookup (``id__any``) the claims use
are here too."""

from __future__ import annotations

import logging
import os
import socket
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from datetime import datetime, timedelta
from functools import cache

from django.apps import apps
from django.conf import settings
from django.db import connection, models, transaction
from django.db.models import Exists, F, Lookup, OuterRef, Q
from django.db.models.lookups import In

from queues.bulk import field_columns, jsonb_payload, jsonb_rows, update_json
from queues.outcomes import Delivered, LinkOutcome, RecipientOutcome, Verdict
from queues.states import (
    FINAL_RECIPIENT_STATES,
    WAITING_RECIPIENT_STATES,
    LinkState,
    MessageState,
    RecipientState,
)

log = logging.getLogger(__name__)


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
    return crash_count > settings.MAILRELAY_POISON_THRESHOLD


# The categorizer's claim in one statement (PostgreSQL): a message to be tried
# alone first, else a batch, locked with SKIP LOCKED and leased to the owner;
# a claim of one counts the try in crash_count (see claim_for_categorizer).
_PG_CATEGORIZER_CLAIM = """
WITH iso AS (
    SELECT id FROM queues_message
    WHERE state = 'submission' AND next_attempt_at <= %(now)s AND NOT suspended AND isolate
    ORDER BY next_attempt_at, id LIMIT 1 FOR UPDATE SKIP LOCKED
), batch AS (
    SELECT id FROM queues_message
    WHERE state = 'submission' AND next_attempt_at <= %(now)s AND NOT suspended
        AND NOT isolate AND NOT EXISTS (SELECT 1 FROM iso)
    ORDER BY next_attempt_at, id LIMIT %(limit)s FOR UPDATE SKIP LOCKED
), picked AS (
    SELECT id FROM iso UNION ALL SELECT id FROM batch
), n AS (
    SELECT count(*) = 1 AS alone FROM picked
)
UPDATE queues_message AS m
SET state = 'categorizing', lease_owner = %(owner)s, lease_until = %(until)s,
    crash_count = m.crash_count + CASE WHEN n.alone THEN 1 ELSE 0 END, isolate = n.alone
FROM n
WHERE m.id IN (SELECT id FROM picked)
RETURNING m.id, m.crash_count
"""


# Finish the messages of ids whose every recipient is final; (id, finished) of
# each one not done yet (MessageQuerySet.finish_ids).
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
    ) -> list[int]:
        """Claim due Submission messages for ``owner``; returns their ids.

        A message that was in a batch whose owner died (``isolate``) is claimed
        alone, and only a message claimed alone has the try counted in
        ``crash_count`` before it is processed (cleared by ``categorized``): so
        a hard crash of a batch is never counted against its innocent members,
        and the message that really kills its worker reaches the poison
        threshold on its own.
        """
        return [mid for mid, _ in self.claim_for_categorizer_counted(owner, limit, now, lease)]

    def claim_for_categorizer_counted(
        self, owner: str, limit: int, now: datetime, lease: timedelta
    ) -> list[tuple[int, int]]:
        """``claim_for_categorizer`` returning (id, crash_count) pairs by id (one
        statement on PostgreSQL: the claim and the poison check together)."""
        if postgresql():
            params = {"now": now, "limit": limit, "owner": owner, "until": now + lease}
            with connection.cursor() as cur:
                cur.execute(_PG_CATEGORIZER_CLAIM, params)
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
            with connection.cursor() as cur:
                cur.execute(
                    "UPDATE queues_message SET state = %s, lease_owner = '', lease_until = NULL, "
                    "crash_count = 0, isolate = false "
                    "WHERE id = ANY(%s::bigint[]) AND state = %s AND lease_owner = %s RETURNING id",
                    [MessageState.QUEUED, list(ids), MessageState.CATEGORIZING, owner],
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
        with connection.cursor() as cur:
            cur.execute(
                "UPDATE queues_message AS m SET state = %s, next_attempt_at = %s "
                "WHERE m.id = ANY(%s::bigint[]) AND m.state = %s AND EXISTS ("
                "SELECT 1 FROM queues_recipient AS r WHERE r.message_id = m.id AND r.state = %s)",
                [
                    MessageState.SUBMISSION,
                    now,
                    list(ids),
                    MessageState.QUEUED,
                    RecipientState.SUBMITTED,
                ],
            )
            return cur.rowcount

    def finish_ids(self, ids: Iterable[int], now: datetime, *, again: bool = True) -> int:
        """``filter(id__in=ids).finish(now)``: one hand-written statement on
        PostgreSQL; ``again``: ``finish_after_commit`` those it could not finish."""
        if not (ids := list(ids)):
            return 0
        if not postgresql():
            return self.filter(id__in=ids).finish(now)
        with connection.cursor() as cur:
            final = [str(state) for state in FINAL_RECIPIENT_STATES]
            done = MessageState.DONE
            cur.execute(_FINISH_SQL, {"ids": ids, "done": done, "now": now, "final": final})
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
        threshold = settings.MAILRELAY_PER_MESSAGE_FAILURES_BEFORE_PROBLEM
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
            if ids:
                self.filter(id__in=ids).update(
                    state=RecipientState.ACTIVE, lease_owner=owner, lease_until=now + lease
                )
        return ids

    # --- the categorizer's placements ----------------------------------------------

    def place_many(self, placements: Sequence[tuple[int, int]], now: datetime) -> int:
        """``place`` for (recipient id, queue id) pairs of several queues: one
        statement on PostgreSQL."""
        if not placements:
            return 0
        if postgresql():
            with connection.cursor() as cur:
                cur.execute(
                    "UPDATE queues_recipient AS r SET queue_id = v.queue_id, state = %s, "
                    "next_attempt_at = %s "
                    "FROM unnest(%s::bigint[], %s::bigint[]) AS v(id, queue_id) "
                    "WHERE r.id = v.id AND r.state = %s",
                    [
                        RecipientState.QUEUED,
                        now,
                        [rid for rid, _ in placements],
                        [qid for _, qid in placements],
                        RecipientState.SUBMITTED,
                    ],
                )
                return cur.rowcount
        by_queue: dict[int, list[int]] = {}
        for rid, qid in placements:
            by_queue.setdefault(qid, []).append(rid)
        return sum(self.filter(id__in=rids).place(qid, now) for qid, rids in by_queue.items())

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
        PostgreSQL one ``UPDATE … FROM jsonb_to_recordset(…) … RETURNING id``.
        """
        if not outcomes:
            return set()
        written = [_apply(rows[rid], o, dead_letter_id, now) for rid, o in outcomes.items()]
        if not postgresql():
            from queues.bulk import bulk_update_rows

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
        ids, final = [a["recipient_id"] for a in attempts], list(FINAL_RECIPIENT_STATES)
        params = {"rows": jsonb_payload(attempts), "ids": ids, "owner": owner, "now": now}
        cur = connection.cursor()
        cur.execute(_record_delivered_sql(), params | {"final": final})

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

    def place(self, queue_id: int, now: datetime) -> int:
        """Submitted recipients routed: waiting in their delivery queue, due now
        (rows an expiry or an operator finished meanwhile are left alone)."""
        return self.filter(state=RecipientState.SUBMITTED).update(
            queue_id=queue_id, state=RecipientState.QUEUED, next_attempt_at=now
        )


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


@cache
def _record_delivered_sql() -> str:
    """``record_delivered``'s statement (the Attempt columns but its queue)."""
    attempt = model_named("Attempt")
    fields = attempt._meta.concrete_fields
    names = [f.attname for f in fields if f.attname not in ("id", "queue_id")]
    columns = field_columns(attempt, names)
    return f"""
WITH v AS (SELECT * FROM {jsonb_rows("v", [*columns, ("last_host", "text")], "%(rows)s")}),
r AS (UPDATE queues_recipient AS t SET state = '{RecipientState.DELIVERED}',
  attempt_count = t.attempt_count + 1, last_attempt_at = v.started_at, last_code = v.code,
  last_enhanced = v.enhanced, last_text = v.text, last_host = v.last_host,
  lease_owner = '', lease_until = NULL, final_at = %(now)s
  FROM v WHERE t.id = ANY(%(ids)s::bigint[]) AND t.id = v.recipient_id
  AND t.state = '{RecipientState.ACTIVE}' AND t.lease_owner = %(owner)s
  RETURNING t.id, t.message_id, t.queue_id, t.address),
a AS (INSERT INTO {attempt._meta.db_table} ({", ".join(c for c, _ in columns)}, queue_id)
  SELECT {", ".join("v." + c for c, _ in columns)}, t.queue_id
  FROM v JOIN queues_recipient AS t ON t.id = ANY(%(ids)s::bigint[]) AND t.id = v.recipient_id),
m AS (UPDATE queues_message AS m SET state = '{MessageState.DONE}', completed_at = %(now)s,
  lease_owner = '', lease_until = NULL
  WHERE m.id IN (SELECT message_id FROM r) AND m.state <> '{MessageState.DONE}' AND NOT EXISTS (
  SELECT 1 FROM queues_recipient AS x WHERE x.message_id = m.id
  AND x.state <> ALL(%(final)s::varchar[]) AND x.id NOT IN (SELECT id FROM r))
  RETURNING m.id)
SELECT id, message_id, queue_id, address, message_id IN (SELECT id FROM m) FROM r"""


def not_locked(expired: models.QuerySet) -> models.QuerySet:
    """The expired claims whose rows no transaction holds (FOR UPDATE SKIP LOCKED):
    a cut-off owner's session may still hold its rows, idle in a transaction,
    until PostgreSQL ends it (MAILRELAY_DB_IDLE_IN_TRANSACTION_TIMEOUT); the
    reclaim must not wait for it — it takes those rows at a later run, and
    everything else at once."""
    return expired.model.objects.filter(
        pk__in=expired.select_for_update(skip_locked=True).values("pk")
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
        expired = self.filter(lease_until__lt=now)
        with transaction.atomic():  # FOR UPDATE needs one, even in a subquery
            return not_locked(expired).update(lease_owner="", lease_until=None)

    def unowned(self, now: datetime) -> LinkQuerySet:
        return self.filter(Q(lease_until__isnull=True) | Q(lease_until__lt=now))

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
# The store's query helpers for PostgreSQL's hand-written hot paths: the
# ``any`` lookup (``filter(id__any=ids)``) and whether they may be used.
# ----------------------------------------------------------------------------


class AnyOf(Lookup):
    """``filter(id__any=ids)``: ``id = ANY(%s)`` with the ids as one array parameter
    on PostgreSQL (an ``IN (%s, %s, …)`` list of hundreds of ids costs psycopg's
    client-side binding and Django's compiler a placeholder each, and makes
    every batch size a new statement); an ``IN`` list elsewhere."""

    lookup_name = "any"
    prepare_rhs = False

    def as_sql(self, compiler, connection):  # type: ignore[no-untyped-def]
        if connection.vendor != "postgresql":
            return In(self.lhs, list(self.rhs)).as_sql(compiler, connection)
        lhs, params = self.process_lhs(compiler, connection)
        # The base type without its length: an explicit cast to varchar(n)
        # truncates, and a longer value would then match another row.
        cast = self.lhs.output_field.cast_db_type(connection).partition("(")[0]
        return f"{lhs} = ANY(%s::{cast}[])", [*params, list(self.rhs)]


models.Field.register_lookup(AnyOf)
models.ForeignObject.register_lookup(AnyOf)  # its lookups stop at ForeignObject


def postgresql() -> bool:
    """Whether the hot paths may use their hand-written PostgreSQL statements."""
    return connection.vendor == "postgresql"


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
