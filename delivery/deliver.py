"""Delivery of one link: claim due recipients, send them, record what happened."""

from __future__ import annotations

import asyncio
import logging
from collections import defaultdict
from datetime import datetime, timedelta

from django.conf import settings
from django.db import transaction
from django.db.models import Q

from delivery import retry
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
from queues import clock
from queues.models import (
    WAITING_RECIPIENT_STATES,
    Attempt,
    AttemptOutcome,
    AttemptPhase,
    Link,
    LinkState,
    Message,
    Queue,
    Recipient,
    RecipientState,
)
from queues.services.messages import messages_finish

log = logging.getLogger(__name__)

LINK_LEASE = timedelta(minutes=2)


def link_acquire(link_id: int, owner: str) -> bool:
    """Become the one delivery task of this link (conditional update, one row or none)."""
    now = clock.now()
    return (
        Link.objects.filter(pk=link_id)
        .filter(Q(lease_until__isnull=True) | Q(lease_until__lt=now) | Q(lease_owner=owner))
        .update(lease_owner=owner, lease_until=now + LINK_LEASE)
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


def _claim(link_id: int, limit: int) -> list[int]:
    now = clock.now()
    with transaction.atomic():
        ids = list(
            _due_recipients(link_id, now)
            .select_for_update(skip_locked=True, of=("self",))
            .order_by("next_attempt_at", "message_id", "id")
            .values_list("id", flat=True)[:limit]
        )
        if ids:
            Recipient.objects.filter(id__in=ids).update(
                state=RecipientState.ACTIVE,
                lease_until=now + settings.MAILRELAY_DELIVERY_LEASE,
            )
    return ids


def _load_batch(recipient_ids: list[int]) -> list[OutboundMessage]:
    rows = Recipient.objects.filter(id__in=recipient_ids).order_by("message_id", "id")
    by_message: dict[int, list[OutboundRecipient]] = defaultdict(list)
    for rid, mid, address, orcpt, notify in rows.values_list(
        "id", "message_id", "address", "orcpt", "notify"
    ):
        by_message[mid].append(OutboundRecipient(rid, address, orcpt, notify))
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


def _no_route_results(messages: list[OutboundMessage], error: str) -> BatchResult:
    now = clock.now()
    return BatchResult(
        results=[
            RecipientResult(
                recipient_id=r.id,
                message_id=m.id,
                outcome=AttemptOutcome.DEFERRED,
                phase=AttemptPhase.CONNECT,
                code=None,
                enhanced="4.4.4",
                text=error,
                started_at=now,
                scope="connection",
            )
            for m in messages
            for r in m.recipients
        ],
        connected=False,
        connection_error=error,
    )


def _record(link: Link, batch: BatchResult) -> None:
    """Write one round's outcome: attempts, recipient states, messages, link state.

    Steps:
    1. one Attempt row per result;
    2. recipients: delivered/failed become final; deferred get their next try
       (connection failures wait for the link's retry time);
    3. messages whose recipients are all final are done;
    4. the link is Ready again after any connection, or in Retry when every host failed.
    """
    now = clock.now()
    results = batch.results
    rows = {
        r.id: r
        for r in Recipient.objects.filter(id__in=[x.recipient_id for x in results]).only(
            "id", "attempt_count", "first_failure_at", "queue_id"
        )
    }
    if batch.connected:
        link.state, link.failure_count, link.next_retry_at = LinkState.READY, 0, None
    else:
        link.failure_count += 1
        link.state = LinkState.RETRY
        link.next_retry_at = retry.link_retry_at(link.failure_count, now)
        link.last_error = batch.connection_error
        link.last_error_at = now
    attempts = []
    delivered_queues: set[int] = set()
    errors_by_queue: dict[int, str] = {}
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
        row.attempt_count += 1
        row.last_attempt_at = res.started_at or now
        row.last_code = res.code
        row.last_enhanced = res.enhanced[:16]
        row.last_text = res.text
        row.last_host = f"{res.host} [{res.ip}]" if res.ip else res.host
        row.lease_until = None
        if res.outcome == AttemptOutcome.DELIVERED:
            row.state, row.final_at = RecipientState.DELIVERED, now
            delivered_queues.add(row.queue_id)
        elif res.outcome == AttemptOutcome.FAILED:
            row.state, row.final_at = RecipientState.FAILED, now
        else:
            row.state = RecipientState.DEFERRED
            row.first_failure_at = row.first_failure_at or now
            if res.scope == "connection" and link.next_retry_at:
                row.next_attempt_at = link.next_retry_at
            else:
                row.next_attempt_at = retry.recipient_retry_at(row.attempt_count, now)
            errors_by_queue[row.queue_id] = res.text
    with transaction.atomic():
        Attempt.objects.bulk_create(attempts)
        Recipient.objects.bulk_update(
            list(rows.values()),
            [
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
            ],
        )
        messages_finish({r.message_id for r in results}, now)
        if delivered_queues:
            Queue.objects.filter(id__in=delivered_queues).update(last_delivery_at=now)
            link.last_success_at = now
        for queue_id, text in errors_by_queue.items():
            Queue.objects.filter(id=queue_id).update(last_error=text, last_error_at=now)
        link.save(
            update_fields=[
                "state",
                "failure_count",
                "next_retry_at",
                "last_error",
                "last_error_at",
                "last_success_at",
            ]
        )


def deliver_round(link: Link, config: ClientConfig) -> int:
    """Claim, send and record one round for ``link``. Returns recipients handled."""
    limit = config.max_connections * config.max_messages_per_connection
    ids = _claim(link.pk, limit)
    if not ids:
        return 0
    messages = _load_batch(ids)
    hops = [NextHop.from_json(h) for h in link.hosts]
    targets, error = order_targets(hops)
    if not targets:
        batch = _no_route_results(messages, error or "no address for the next hop")
    else:
        batch = asyncio.run(deliver(targets, messages, config))
    _record(link, batch)
    return len(ids)


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
                link_acquire(link_id, owner)  # renew the lease
        finally:
            link_release(link_id, owner)
        # Work that arrived while we held the lease rang a bell we swallowed:
        # look once more after letting go.
        if handled == before or not link_has_due_work(link_id):
            break
    return handled
