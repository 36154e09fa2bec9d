"""Webhook endpoints: the one place they are created, changed and deleted
(UI and API call these), each change in the audit log."""

from __future__ import annotations

import re
import secrets
from collections.abc import Iterable
from urllib.parse import urlsplit

from queues import clock
from queues.models import AuditEntry
from tracking import outbox
from tracking.events import WEBHOOK_EVENTS
from tracking.models import DeliveryState, WebhookAttempt, WebhookDelivery, WebhookEndpoint

# Operator actions added later are accepted by their audit name.
_ACTION = re.compile(r"^(queue|message|link)_[a-z_]{1,40}$")


class EndpointError(ValueError):
    pass


def clean_events(events: Iterable[str]) -> list[str]:
    out = []
    for e in events:
        e = e.strip()
        if not e:
            continue
        if e not in WEBHOOK_EVENTS and not _ACTION.match(e):
            raise EndpointError(f"events: unknown {e!r} (one of {', '.join(WEBHOOK_EVENTS)})")
        if e not in out:
            out.append(e)
    if not out:
        raise EndpointError("events: name at least one event")
    return out


def clean_url(url: str) -> str:
    parts = urlsplit(url.strip())
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise EndpointError("url: an http:// or https:// URL")
    return url.strip()


def new_secret() -> str:
    return secrets.token_urlsafe(32)


def _audit(actor, via: str, action: str, endpoint: WebhookEndpoint) -> None:
    AuditEntry.objects.create(
        created_at=clock.now(),
        actor=None if isinstance(actor, str) else actor,
        actor_name=(actor if isinstance(actor, str) else actor.get_username())[:150],
        via=via,
        action=action,
        target_type="webhook",
        target_ids=[endpoint.pk],
        count=1,
        detail=f"{endpoint.name} {endpoint.url} events={','.join(endpoint.events)}",
    )


def create(
    actor,
    via: str,
    *,
    name: str,
    url: str,
    events: Iterable[str],
    secret: str = "",
    enabled: bool = True,
) -> WebhookEndpoint:
    if not name.strip():
        raise EndpointError("name: required")
    if WebhookEndpoint.objects.filter(name=name.strip()).exists():
        raise EndpointError(f"name: {name!r} exists")
    now = clock.now()
    endpoint = WebhookEndpoint.objects.create(
        name=name.strip(),
        url=clean_url(url),
        events=clean_events(events),
        secret=secret or new_secret(),
        enabled=enabled,
        created_at=now,
        updated_at=now,
    )
    _audit(actor, via, "webhook_create", endpoint)
    outbox.invalidate()
    return endpoint


def update(actor, via: str, endpoint: WebhookEndpoint, **changes) -> WebhookEndpoint:
    if "url" in changes:
        endpoint.url = clean_url(changes["url"])
    if "events" in changes:
        endpoint.events = clean_events(changes["events"])
    if changes.get("secret"):
        endpoint.secret = changes["secret"]
    if "enabled" in changes:
        endpoint.enabled = bool(changes["enabled"])
    endpoint.updated_at = clock.now()
    endpoint.save()
    _audit(actor, via, "webhook_update", endpoint)
    outbox.invalidate()
    return endpoint


def delete(actor, via: str, endpoint: WebhookEndpoint) -> None:
    _audit(actor, via, "webhook_delete", endpoint)
    endpoint.delete()
    outbox.invalidate()


def recent(endpoint: WebhookEndpoint, limit: int = 50) -> dict:
    """What an endpoint's page shows: pending/failed counts, recent deliveries and attempts."""
    deliveries = endpoint.deliveries.order_by("-created_at", "-id")[:limit]
    return {
        "pending": endpoint.deliveries.filter(state=DeliveryState.PENDING).count(),
        "failed": endpoint.deliveries.filter(state=DeliveryState.FAILED).count(),
        "deliveries": list(deliveries),
        "failures": list(
            endpoint.deliveries.filter(state=DeliveryState.FAILED).order_by("-finished_at")[:limit]
        ),
        "attempts": list(
            WebhookAttempt.objects.filter(endpoint=endpoint)
            .select_related("delivery")
            .order_by("-at", "-id")[:limit]
        ),
    }


__all__ = ["EndpointError", "WebhookDelivery", "create", "delete", "recent", "update"]
