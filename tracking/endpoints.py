"""Webhook endpoints: the one place they are created, changed and deleted
(UI and API call these), each change in the audit log."""

from __future__ import annotations

import ipaddress
import re
import secrets
import socket
from collections.abc import Iterable
from urllib.parse import urlsplit

from django.conf import settings
from django.db import transaction

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
    if not settings.MAILRELAY_WEBHOOK_ALLOW_PRIVATE:
        port = parts.port or (443 if parts.scheme == "https" else 80)
        try:
            addresses = resolve(parts.hostname, port)
        except OSError:
            addresses = []  # not resolvable now: the sender checks at each POST
        private = [a for a in addresses if not is_public(a)]
        if private:
            raise EndpointError(
                f"url: {parts.hostname} is a private address ({private[0]}), refused as "
                "MAILRELAY_WEBHOOK_ALLOW_PRIVATE is false"
            )
    return url.strip()


def is_public(address: str) -> bool:
    """False for loopback, RFC 1918, link-local (169.254.169.254), CGNAT, ULA…"""
    ip = ipaddress.ip_address(address.split("%", 1)[0])
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped:
        ip = ip.ipv4_mapped
    return ip.is_global and not ip.is_multicast


def resolve(host: str, port: int) -> list[str]:
    """The addresses of ``host`` (an IP literal is its own), in resolver order."""
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    out: list[str] = []
    for *_, sockaddr in infos:
        if sockaddr[0] not in out:
            out.append(sockaddr[0])
    return out


def new_secret() -> str:
    return secrets.token_urlsafe(32)


def secret_hint(secret: str) -> str:
    """What is shown of a secret after its creation: its last four characters."""
    return f"…{secret[-4:]}" if len(secret) >= 16 else "…"


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


def rotate_secret(actor, via: str, endpoint: WebhookEndpoint) -> str:
    """A new random secret for ``endpoint``; returned once (shown masked after)."""
    endpoint.secret = new_secret()
    endpoint.updated_at = clock.now()
    endpoint.save(update_fields=["secret", "updated_at"])
    _audit(actor, via, "webhook_rotate_secret", endpoint)
    outbox.invalidate()
    return endpoint.secret


def delete(actor, via: str, endpoint: WebhookEndpoint) -> None:
    """Delete ``endpoint`` and its deliveries. Its row is locked first: a delivery
    round that is queuing webhooks for it (``outbox.enqueue`` holds the row FOR
    KEY SHARE) commits first, and no new delivery row can follow once the
    lock is ours, so neither side's commit fails on the foreign key."""
    with transaction.atomic():
        list(WebhookEndpoint.objects.select_for_update().filter(pk=endpoint.pk).values_list("pk"))
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


__all__ = [
    "EndpointError",
    "WebhookDelivery",
    "create",
    "delete",
    "recent",
    "rotate_secret",
    "update",
]
