"""Delivery of one link: claim due recipients, send them, record what happened."""

from __future__ import annotations

import asyncio
import logging
from collections import defaultdict
from dataclasses import dataclass, field
from datetime import datetime

from django.conf import settings
from django.db import transaction
from django.db.models import F, Q

from delivery import retry
from delivery import retryrules as rr
from delivery.categorize import worker_id
from delivery.routing import order_targets
from delivery.smtp_client import ClientConfig, deliver
from delivery.types import (
    BatchResult,
    NextHop,
    OutboundMessage,
    OutboundRecipient,
    RecipientResult,
)
from mailrelay import metrics
from queues import clock, dsn
from queues.bulk import bulk_update_rows
from queues.models import (
    WAITING_RECIPIENT_STATES,
    Attempt,
    AttemptOutcome,
    AttemptPhase,
    DeliveryType,
    Link,
    LinkState,
    Message,
    Queue,
    Recipient,
    RecipientState,
    RetryHint,
)
from queues.services.hints import hints_clear, hints_load, hints_save
from queues.services.messages import messages_finish
from queues.services.notify import notify
from queues.services.routing import special_queue

log = logging.getLogger(__name__)


def link_acquire(link_id: int, owner: str) -> bool:
    """Become the one delivery task of this link (conditional update, one row or none)."""
    now = clock.now()
    return (
        Link.objects.filter(pk=link_id)
        .filter(Q(lease_until__isnull=True) | Q(lease_until__lt=now) | Q(lease_owner=owner))
        # A round may last as long as a recipient claim; the lease is renewed per round.
        .update(lease_owner=owner, lease_until=now + settings.MAILRELAY_DELIVERY_LEASE)
        == 1
    )


def link_release(link_id: int, owner: str) -> None:
    Link.objects.filter(pk=link_id, lease_owner=owner).update(lease_owner="", lease_until=None)


def _due_recipients(link_id: int, now: datetime):
    return Recipient.objects.filter(
        queue__link_id=link_id,
        queue__suspended=False,
        state__in=WAITING_RECIPIENT_STATES,
        next_attempt_at__lte=now,
        message__suspended=False,
    )


def link_has_due_work(link_id: int, now: datetime | None = None) -> bool:
    now = now or clock.now()
    link = Link.objects.filter(pk=link_id).values("next_retry_at").first()
    if link is None or (link["next_retry_at"] and link["next_retry_at"] > now):
        return False
    return _due_recipients(link_id, now).exists()


def _claim(link_id: int, limit: int) -> tuple[list[int], datetime]:
    """Lease up to ``limit`` due recipients; returns their ids and the lease's end.

    The lease value identifies this claim: results are written only to rows
    still holding it, so a round that outlived its lease (the sweep gave the
    rows to another delivery) cannot overwrite newer states.
    """
    now = clock.now()
    lease = now + settings.MAILRELAY_DELIVERY_LEASE
    with transaction.atomic():
        ids = list(
            _due_recipients(link_id, now)
            .select_for_update(skip_locked=True, of=("self",))
            .order_by("next_attempt_at", "message_id", "id")
            .values_list("id", flat=True)[:limit]
        )
        if ids:
            Recipient.objects.filter(id__in=ids).update(
                state=RecipientState.ACTIVE, lease_until=lease
            )
    return ids, lease


def _load_batch(recipient_ids: list[int]) -> list[OutboundMessage]:
    rows = Recipient.objects.filter(id__in=recipient_ids).order_by("message_id", "id")
    by_message: dict[int, list[OutboundRecipient]] = defaultdict(list)
    for rid, mid, address, orcpt, notify_ in rows.values_list(
        "id", "message_id", "address", "orcpt", "notify"
    ):
        by_message[mid].append(OutboundRecipient(rid, address, orcpt, notify_))
    messages = []
    for m in Message.objects.filter(id__in=list(by_message)).values(
        "id", "mail_from", "data", "body_type", "smtputf8", "ret", "envid"
    ):
        messages.append(
            OutboundMessage(
                id=m["id"],
                mail_from=m["mail_from"],
                data=bytes(m["data"]),
                recipients=by_message[m["id"]],
                body_type=m["body_type"],
                smtputf8=m["smtputf8"],
                ret=m["ret"],
                envid=m["envid"],
            )
        )
    messages.sort(key=lambda m: m.id)
    return messages


def _unattempted(
    messages: list[OutboundMessage], outcome: str, enhanced: str, text: str
) -> BatchResult:
    """One result per recipient for a round decided without connecting."""
    now = clock.now()
    return BatchResult(
        results=[
            RecipientResult(
                recipient_id=r.id,
                message_id=m.id,
                outcome=outcome,
                phase=AttemptPhase.CONNECT,
                code=None,
                enhanced=enhanced,
                text=text,
                started_at=now,
                scope="connection",
            )
            for m in messages
            for r in m.recipients
        ],
        connected=False,
        connection_error=text,
    )


@dataclass
class _Round:
    """What one round decided, collected before it is written in one transaction."""

    now: datetime
    failed: dict[int, list[Recipient]] = field(default_factory=lambda: defaultdict(list))
    timed_out: set[int] = field(default_factory=set)  # recipient ids failed by a retry cutoff
    relayed: dict[int, list[Recipient]] = field(default_factory=lambda: defaultdict(list))
    message_failures: set[int] = field(default_factory=set)
    address_hints: list[RetryHint] = field(default_factory=list)
    cleared_hints: list[str] = field(default_factory=list)


def _via_mx(link: Link) -> bool:
    return any(not h.get("literal", False) for h in link.hosts)


def _link_failed(link: Link, batch: BatchResult, domain: str, now: datetime) -> bool:
    """Every host failed: put the link in Retry. Returns True when the retry
    rule's final cutoff has passed (the recipients time out)."""
    last = batch.host_failures[-1] if batch.host_failures else None
    error = retry.error_name(
        last.phase if last else "connect",
        last.code if last else None,
        last.error if last else "",
        _via_mx(link),
    )
    first_failed = link.first_failure_at or now
    decision = retry.decide(
        address=f"postmaster@{domain}",
        host=(last.host if last and last.host else None) or domain,
        error=error,
        first_failed=first_failed,
        last_tried=link.last_error_at or now,
        next_try=link.next_retry_at,
        now=now,
    )
    link.failure_count += 1
    link.state = LinkState.RETRY
    link.first_failure_at = first_failed
    link.next_retry_at = decision.at
    link.last_error = batch.connection_error
    link.last_error_at = now
    return decision.timed_out


def _host_hints(link: Link, batch: BatchResult, domain: str, now: datetime) -> list[RetryHint]:
    """Exim's per-host retry data for every host that could not be used."""
    keys = {rr.host_key(f.host, f.ip): f for f in batch.host_failures if f.host}
    if not keys:
        return []
    existing = hints_load(keys)
    active = retry.rules()
    saved = []
    for key, f in keys.items():
        error = retry.error_name(f.phase, f.code, f.error, _via_mx(link))
        rule = active.find(f"postmaster@{domain}", host=f.host, error=error or None)
        old = existing.get(key)
        outcome = rr.record_failure(
            _as_hint(old),
            key=key,
            rule=rule,
            now=now,
            error=error,
            text=f.text,
            options=active.options,
        )
        h = outcome.hint
        saved.append(
            RetryHint(
                key=key,
                first_failed=h.first_failed,
                last_tried=h.last_tried,
                next_try=h.next_try,
                expired=h.expired,
                error=h.error,
                text=_clean(h.text)[:2000],
            )
        )
    return saved


def _as_hint(row: RetryHint | None) -> rr.RetryHint | None:
    if row is None:
        return None
    return rr.RetryHint(
        row.key, row.first_failed, row.last_tried, row.next_try, row.expired, row.error, row.text
    )


def _defer(
    row: Recipient,
    res: RecipientResult,
    link: Link,
    batch: BatchResult,
    link_timed_out: bool,
    sender: str,
    rnd: _Round,
) -> None:
    """Decide a deferred recipient's next try (or its timeout)."""
    now = rnd.now
    first_failed = row.first_failure_at or now
    row.first_failure_at = first_failed
    if res.scope == "connection" and not batch.connected:
        if link_timed_out:
            rnd.timed_out.add(row.id)
            return
        row.next_attempt_at = link.next_retry_at or now
        return
    host_error = (
        ("lost_connection" if res.code is None else "") if res.scope == "connection" else ""
    )
    error = retry.error_name(res.phase, res.code, host_error, _via_mx(link))
    decision = retry.decide(
        address=row.address,
        error=error,
        host=(res.host or None) if host_error else None,
        sender=sender,
        first_failed=first_failed,
        last_tried=row.last_attempt_at or now,
        next_try=row.next_attempt_at,
        now=now,
    )
    if decision.timed_out:
        rnd.timed_out.add(row.id)
        return
    row.next_attempt_at = decision.at
    if res.scope == "message":
        rnd.message_failures.add(row.message_id)
    if res.phase == "rcpt":
        rnd.address_hints.append(
            RetryHint(
                key=rr.address_key(row.address, sender),
                first_failed=first_failed,
                last_tried=now,
                next_try=decision.at,
                expired=False,
                error=error,
                text=res.text[:2000],
            )
        )


def _clean(text: str) -> str:
    """PostgreSQL text cannot hold NUL; a peer's reply may."""
    return text.replace("\x00", "\ufffd")


def _record(link: Link, batch: BatchResult, lease: datetime | None = None) -> None:
    """Write one round's outcome: attempts, recipient states, notifications, link state.

    Steps:
    1. one Attempt row per result;
    2. every host that could not be used gets its retry hint; a link whose
       every host failed goes to Retry at the time its retry rule gives;
    3. recipients: delivered and failed become final (failed ones move to the
       Dead-letter queue); deferred ones get their next try from the retry rule,
       or fail when the rule's final cutoff has passed;
    4. in the same transaction: the NDRs and "relayed" DSNs owed, messages whose
       recipients are all final are done, problem-message counters.
    """
    now = clock.now()
    results = batch.results
    for res in results:
        res.text, res.host = _clean(res.text), _clean(res.host)
    batch.connection_error = _clean(batch.connection_error)
    claimed = Recipient.objects.filter(
        id__in=[x.recipient_id for x in results], state=RecipientState.ACTIVE
    )
    if lease is not None:
        claimed = claimed.filter(lease_until=lease)
    rows = {
        r.id: r
        for r in claimed.only(
            "id",
            "message_id",
            "address",
            "orcpt",
            "notify",
            "attempt_count",
            "first_failure_at",
            "last_attempt_at",
            "next_attempt_at",
            "queue_id",
        )
    }
    senders = dict(
        Message.objects.filter(id__in={r.message_id for r in rows.values()}).values_list(
            "id", "mail_from"
        )
    )
    domain = next(iter(rows.values())).address.rpartition("@")[2] if rows else link.name
    rnd = _Round(now)
    host_hints = _host_hints(link, batch, domain, now)
    link_timed_out = False
    if batch.connected:
        link.state, link.failure_count, link.next_retry_at = LinkState.READY, 0, None
        link.first_failure_at = None
    else:
        link_timed_out = _link_failed(link, batch, domain, now)
    attempts = []
    delivered_queues: set[int] = set()
    errors_by_queue: dict[int, str] = {}
    dead_letter = None
    for res in results:
        row = rows.get(res.recipient_id)
        if row is None:  # removed by an operator meanwhile
            continue
        attempts.append(
            Attempt(
                recipient_id=res.recipient_id,
                message_id=res.message_id,
                queue_id=row.queue_id,
                started_at=res.started_at or now,
                duration_ms=res.duration_ms,
                host=res.host[:300],
                ip=res.ip[:64],
                port=res.port,
                phase=res.phase,
                code=res.code,
                enhanced=res.enhanced[:16],
                text=res.text,
                outcome=res.outcome,
            )
        )
        sender = senders.get(row.message_id, "")
        row.attempt_count += 1
        row.lease_until = None
        if res.outcome == AttemptOutcome.DEFERRED:
            _defer(row, res, link, batch, link_timed_out, sender, rnd)
            errors_by_queue[row.queue_id] = res.text
        row.last_attempt_at = res.started_at or now
        row.last_code = res.code
        row.last_enhanced = res.enhanced[:16]
        row.last_text = res.text
        row.last_host = f"{res.host} [{res.ip}]" if res.ip else res.host
        if res.outcome == AttemptOutcome.DELIVERED:
            row.state, row.final_at = RecipientState.DELIVERED, now
            delivered_queues.add(row.queue_id)
            rnd.cleared_hints.append(rr.address_key(row.address, sender))
            if res.host:
                rnd.cleared_hints.append(rr.host_key(res.host, res.ip))
            if "SUCCESS" in row.notify.upper() and not res.peer_dsn:
                rnd.relayed[row.message_id].append(row)
        elif res.outcome == AttemptOutcome.FAILED or row.id in rnd.timed_out:
            dead_letter = dead_letter or special_queue(DeliveryType.DEAD_LETTER, now)
            row.state, row.final_at, row.queue_id = RecipientState.FAILED, now, dead_letter.pk
            if row.id in rnd.timed_out:
                row.last_text = f"retry timeout exceeded; last error: {res.text}"
            rnd.failed[row.message_id].append(row)
        else:
            row.state = RecipientState.DEFERRED
    with transaction.atomic():
        # Lock what we write and drop rows whose claim ended meanwhile (the
        # sweep took them back): their newer state wins; the attempts stay.
        kept = set(
            claimed.select_for_update().filter(id__in=list(rows)).values_list("id", flat=True)
        )
        if len(kept) != len(rows):
            rows = {rid: row for rid, row in rows.items() if rid in kept}
            for per_message in (rnd.failed, rnd.relayed):
                for mid in list(per_message):
                    per_message[mid] = [r for r in per_message[mid] if r.id in kept]
        Attempt.objects.bulk_create(attempts)
        bulk_update_rows(list(rows.values()), RECIPIENT_UPDATE_FIELDS)
        hints_save(host_hints + rnd.address_hints)
        hints_clear(rnd.cleared_hints)
        _notify_round(rnd)
        if rnd.message_failures:
            threshold = settings.MAILRELAY_PER_MESSAGE_FAILURES_BEFORE_PROBLEM
            Message.objects.filter(id__in=rnd.message_failures).update(
                per_message_failures=F("per_message_failures") + 1
            )
            Message.objects.filter(
                id__in=rnd.message_failures, per_message_failures__gte=threshold
            ).update(problem=True)
        messages_finish({r.message_id for r in results}, now)
        if delivered_queues:
            Queue.objects.filter(id__in=delivered_queues).update(last_delivery_at=now)
            link.last_success_at = now
        for queue_id, text in errors_by_queue.items():
            Queue.objects.filter(id=queue_id).update(last_error=text, last_error_at=now)
        link.save(update_fields=LINK_UPDATE_FIELDS)
    metrics.record_delivery(attempts, rows.values())


RECIPIENT_UPDATE_FIELDS = [
    "state",
    "attempt_count",
    "last_attempt_at",
    "last_code",
    "last_enhanced",
    "last_text",
    "last_host",
    "lease_until",
    "final_at",
    "first_failure_at",
    "next_attempt_at",
    "queue_id",
]
LINK_UPDATE_FIELDS = [
    "state",
    "failure_count",
    "first_failure_at",
    "next_retry_at",
    "last_error",
    "last_error_at",
    "last_success_at",
]


def _notify_round(rnd: _Round) -> None:
    ids = set(rnd.failed) | set(rnd.relayed)
    if not ids:
        return
    messages = {m.pk: m for m in Message.objects.filter(id__in=ids).exclude(mail_from="")}
    for mid, rows in rnd.failed.items():
        if mid in messages:
            notify(dsn.FAILURE, messages[mid], rows, now=rnd.now)
    for mid, rows in rnd.relayed.items():
        if mid in messages:
            notify(dsn.SUCCESS, messages[mid], rows, now=rnd.now)


def _usable_targets(targets: list, domain: str, now: datetime) -> tuple[list, str]:
    """Which hosts to try, from their retry data (Exim §10).

    Returns the targets and a verdict: "try" (hosts whose retry time has come,
    or that have no retry data), "bounce" (every host is past its rule's final
    cutoff and not due: the recipients time out without an attempt), or
    "defer" — which cannot stop a round here, because the link's own retry
    time has just come: then every host is tried.
    """
    hints = hints_load(rr.host_key(t.host, t.ip) for t in targets)
    if not hints:
        return targets, "try"
    active = retry.rules()
    decisions = []
    for t in targets:
        row = hints.get(rr.host_key(t.host, t.ip))
        rule = (
            active.find(f"postmaster@{domain}", host=t.host, error=row.error or None)
            if row
            else None
        )
        decisions.append(rr.may_try(_as_hint(row), now=now, rule=rule, options=active.options))
    verdict = rr.combine_decisions(decisions)
    if verdict == "bounce":
        return [], verdict
    ready = [t for t, d in zip(targets, decisions, strict=True) if d is rr.TryDecision.TRY]
    return (ready or targets), "try"


def deliver_round(link: Link, config: ClientConfig) -> int:
    """Claim, send and record one round for ``link``. Returns recipients handled."""
    limit = config.max_connections * config.max_messages_per_connection
    ids, lease = _claim(link.pk, limit)
    if not ids:
        return 0
    messages = _load_batch(ids)
    hops = [NextHop.from_json(h) for h in link.hosts]
    targets, error = order_targets(hops)
    domain = messages[0].recipients[0].address.rpartition("@")[2] if messages else link.name
    targets, verdict = _usable_targets(targets, domain, clock.now())
    if verdict == "bounce":
        batch = _unattempted(
            messages,
            AttemptOutcome.FAILED,
            "4.4.7",
            "retry time not reached for any host after a long failure period",
        )
    elif not targets:
        batch = _unattempted(
            messages, AttemptOutcome.DEFERRED, "4.4.4", error or "no address for the next hop"
        )
    else:
        batch = asyncio.run(deliver(targets, messages, config))
    try:
        _record(link, batch, lease)
    except Exception:
        # Never retry the same batch in a tight loop: park it for a while, and
        # a message that keeps breaking the recording goes to Poison.
        log.exception("recording a delivery round of link %s failed", link.pk)
        _record_crash(ids, lease)
    return len(ids)


def _record_crash(recipient_ids: list[int], lease: datetime) -> None:
    from delivery.categorize import park_poison

    now = clock.now()
    with transaction.atomic():
        rows = Recipient.objects.filter(
            id__in=recipient_ids, state=RecipientState.ACTIVE, lease_until=lease
        )
        message_ids = set(rows.values_list("message_id", flat=True))
        rows.update(
            state=RecipientState.DEFERRED,
            lease_until=None,
            next_attempt_at=now + settings.MAILRELAY_MESSAGE_RETRY_INTERVAL,
            last_text="internal error while recording the delivery; will retry",
        )
        Message.objects.filter(id__in=message_ids).update(crash_count=F("crash_count") + 1)
        poisoned = list(
            Message.objects.filter(
                id__in=message_ids, crash_count__gt=settings.MAILRELAY_POISON_THRESHOLD
            ).values_list("id", flat=True)
        )
    if poisoned:
        park_poison(poisoned)


def deliver_link(link_id: int, owner: str | None = None) -> int:
    """Deliver everything due on one link, as its only delivery task.

    Returns how many recipients were handled. Exits at once when another task
    holds the link, or when the link waits for its retry time.
    """
    owner = owner or worker_id()
    handled = 0
    config = ClientConfig.from_settings()
    while link_acquire(link_id, owner):
        before = handled
        try:
            while True:
                link = Link.objects.get(pk=link_id)
                if link.next_retry_at and link.next_retry_at > clock.now():
                    break
                count = deliver_round(link, config)
                if not count:
                    break
                handled += count
                if not link_acquire(link_id, owner):  # renew; lost it: another task delivers
                    break
        finally:
            link_release(link_id, owner)
        # Work that arrived while we held the lease rang a bell we swallowed:
        # look once more after letting go.
        if handled == before or not link_has_due_work(link_id):
            break
    return handled
