"""The webhook sender: claim due outbox rows, POST each, record the attempt.

Runs in the ``webhooks`` Celery queue (its own worker with a few threads), so
a slow or dead endpoint never holds a categorize or delivery task. Rows are
claimed with ``FOR UPDATE SKIP LOCKED`` and a lease: a sender that dies
leaves its rows to the next one once the lease ran out (at least once).

Back-off is per endpoint: after a failed POST the endpoint rests 30 s,
doubling with each failure in a row up to 1 h, and none of its webhooks is
tried meanwhile (a dead endpoint costs one try per interval, not one per
event); its first success ends it. A webhook whose next try would come later
than ``MAILRELAY_WEBHOOK_RETRY_FOR`` (24 h) after its event is ``failed``
(shown on the endpoint's page and in the API).
"""

from __future__ import annotations

import http.client
import logging
import os
import socket
import ssl
import time
import uuid
from dataclasses import dataclass
from datetime import datetime, timedelta
from urllib.parse import urlsplit

from django.conf import settings
from django.db import transaction
from django.db.models import Q

from queues import clock
from tracking import signing
from tracking.models import DeliveryState, WebhookAttempt, WebhookDelivery, WebhookEndpoint

log = logging.getLogger(__name__)

CLAIM = 20
LEASE = timedelta(minutes=5)
FIRST_RETRY = 30.0
MAX_RETRY = 3600.0
DISABLED_WAIT = timedelta(minutes=5)
READ_LIMIT = 64 * 1024
USER_AGENT = "mailrelay-webhooks/1"


@dataclass
class PostResult:
    status: int | None
    error: str
    duration_ms: int

    @property
    def ok(self) -> bool:
        return self.status is not None and 200 <= self.status < 300


def owner_id() -> str:
    return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"


def backoff(attempts: int) -> timedelta:
    """Wait after the ``attempts``-th failed try: 30 s, 1 m, 2 m … 1 h."""
    return timedelta(seconds=min(FIRST_RETRY * 2 ** max(attempts - 1, 0), MAX_RETRY))


def post(url: str, body: str, headers: dict[str, str], timeout: float) -> PostResult:
    """One POST, no redirects followed; any 2xx is success."""
    started = time.monotonic()
    parts = urlsplit(url)
    path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    try:
        if parts.scheme == "https":
            context = ssl.create_default_context(cafile=settings.MAILRELAY_TLS_CA_FILE or None)
            conn: http.client.HTTPConnection = http.client.HTTPSConnection(
                parts.hostname, parts.port, timeout=timeout, context=context
            )
        elif parts.scheme == "http":
            conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=timeout)
        else:
            return PostResult(None, f"unsupported URL scheme {parts.scheme!r}", 0)
        try:
            conn.request("POST", path, body=body.encode(), headers=headers)
            response = conn.getresponse()
            response.read(READ_LIMIT)
            status = response.status
        finally:
            conn.close()
    except (OSError, http.client.HTTPException) as exc:
        text = f"{type(exc).__name__}: {exc}"[:500]
        return PostResult(None, text, int((time.monotonic() - started) * 1000))
    ms = int((time.monotonic() - started) * 1000)
    return PostResult(status, "" if 200 <= status < 300 else f"HTTP {status}", ms)


def headers_for(delivery: WebhookDelivery, secret: str, timestamp: int) -> dict[str, str]:
    return {
        "Content-Type": "application/json",
        "User-Agent": USER_AGENT,
        signing.EVENT_ID_HEADER: str(delivery.event_id),
        signing.EVENT_TYPE_HEADER: delivery.event,
        signing.SIGNATURE_HEADER: signing.header(secret, timestamp, delivery.body),
    }


def _due(now: datetime):
    return (
        WebhookDelivery.objects.filter(state=DeliveryState.PENDING, next_attempt_at__lte=now)
        .filter(Q(lease_until__isnull=True) | Q(lease_until__lt=now))
        .filter(Q(endpoint__down_until__isnull=True) | Q(endpoint__down_until__lte=now))
    )


def claim(owner: str, now: datetime, limit: int = CLAIM) -> list[WebhookDelivery]:
    with transaction.atomic():
        ids = list(
            _due(now)
            .select_for_update(skip_locked=True, of=("self",))
            .order_by("next_attempt_at", "id")
            .values_list("id", flat=True)[:limit]
        )
        if not ids:
            return []
        WebhookDelivery.objects.filter(id__in=ids).update(
            lease_owner=owner, lease_until=now + LEASE
        )
    return list(
        WebhookDelivery.objects.filter(id__in=ids, lease_owner=owner)
        .select_related("endpoint")
        .order_by("next_attempt_at", "id")
    )


def _finish(delivery: WebhookDelivery, owner: str, **changes) -> None:
    WebhookDelivery.objects.filter(pk=delivery.pk, lease_owner=owner).update(
        lease_owner="", lease_until=None, **changes
    )


def _endpoint_up(endpoint: WebhookEndpoint, at: datetime) -> None:
    if endpoint.failures or endpoint.down_until:
        log.info("webhook endpoint %s answers again", endpoint.name)
    WebhookEndpoint.objects.filter(pk=endpoint.pk).update(
        failures=0, down_until=None, last_error="", last_success_at=at
    )


def _endpoint_down(endpoint: WebhookEndpoint, at: datetime, error: str) -> datetime:
    """One more failure of ``endpoint``: it rests for its back-off; returns until when."""
    failures = (
        WebhookEndpoint.objects.filter(pk=endpoint.pk).values_list("failures", flat=True).first()
        or 0
    ) + 1
    until = at + backoff(failures)
    WebhookEndpoint.objects.filter(pk=endpoint.pk).update(
        failures=failures, down_until=until, last_error=error
    )
    return until


def send_due(owner: str | None = None, limit: int = CLAIM) -> int:
    """Send one claim of due webhooks. Returns how many rows it claimed."""
    owner = owner or owner_id()
    now = clock.now()
    batch = claim(owner, now, limit)
    timeout = settings.MAILRELAY_WEBHOOK_TIMEOUT.total_seconds()
    give_up_after = settings.MAILRELAY_WEBHOOK_RETRY_FOR
    resting: dict[int, datetime] = {}  # endpoints that failed in this claim: until when
    for delivery in batch:
        endpoint = delivery.endpoint
        if not endpoint.enabled:  # kept for when it is enabled again, within the day
            if now + DISABLED_WAIT > delivery.created_at + give_up_after:
                _finish(
                    delivery,
                    owner,
                    state=DeliveryState.FAILED,
                    finished_at=now,
                    last_error="endpoint disabled",
                )
            else:
                _finish(delivery, owner, next_attempt_at=now + DISABLED_WAIT)
            continue
        if endpoint.pk in resting:  # waits with its endpoint, untried
            _finish(delivery, owner, next_attempt_at=resting[endpoint.pk])
            continue
        result = post(
            endpoint.url,
            delivery.body,
            headers_for(delivery, endpoint.secret, int(time.time())),
            timeout,
        )
        at = clock.now()
        WebhookAttempt.objects.create(
            delivery=delivery,
            endpoint=endpoint,
            at=at,
            status=result.status,
            error=result.error,
            duration_ms=result.duration_ms,
        )
        attempts = delivery.attempts + 1
        tried = {"attempts": attempts, "last_status": result.status, "last_error": result.error}
        if result.ok:
            _endpoint_up(endpoint, at)
            _finish(delivery, owner, state=DeliveryState.DELIVERED, finished_at=at, **tried)
            continue
        resting[endpoint.pk] = next_at = _endpoint_down(endpoint, at, result.error)
        if next_at > delivery.created_at + give_up_after:
            _finish(delivery, owner, state=DeliveryState.FAILED, finished_at=at, **tried)
            log.warning(
                "webhook %s to %s failed for good: %s",
                delivery.event_id,
                endpoint.name,
                result.error,
            )
            continue
        _finish(delivery, owner, next_attempt_at=next_at, **tried)
    return len(batch)


def has_due(now: datetime | None = None) -> bool:
    return _due(now or clock.now()).exists()


KEEP_FINISHED = timedelta(days=7)
PRUNE_BATCH = 5000


def prune(now: datetime) -> int:
    """Delivered and failed rows (with their attempts) are kept a week."""
    ids = list(
        WebhookDelivery.objects.filter(finished_at__lt=now - KEEP_FINISHED).values_list(
            "id", flat=True
        )[:PRUNE_BATCH]
    )
    if ids:
        WebhookDelivery.objects.filter(id__in=ids).delete()
    return len(ids)
