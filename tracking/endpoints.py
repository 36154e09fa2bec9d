"""Webhook endpoints: the one place they are created, changed and deleted
(UI and API call these), each change in the audit log."""

from __future__ import annotations

import ipaddress
import re
import secrets
import socket
from collections.abc import Iterable
from urllib.parse import quote, urlsplit, urlunsplit

import idna
from django.db import transaction

from queues.lib import clock
from queues.models import AuditEntry
from tracking import record, redact
from tracking.config import tracking_settings
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


# What a URL may hold as is: printable ASCII; anything else in its path, query
# or userinfo is percent-encoded (UTF-8), the host IDNA-encoded.
_PRINTABLE = "".join(chr(c) for c in range(0x21, 0x7F))
_LABEL = re.compile(r"^[A-Za-z0-9_](?:[A-Za-z0-9_-]{0,61}[A-Za-z0-9_])?$")
MAX_URL = 2000  # WebhookEndpoint.url


def _ascii_host(host: str) -> str:
    """``host`` as sent: an IP literal as is, a name IDNA-encoded (UTS 46) and checked."""
    try:
        return str(ipaddress.ip_address(host))
    except ValueError:
        pass
    name = host.rstrip(".")
    if not name or len(name) > 253:
        raise EndpointError(f"url: {host!r} is not a host name")
    labels = []
    for label in name.split("."):
        if not label.isascii():
            try:
                label = idna.encode(label, uts46=True).decode("ascii")
            except idna.IDNAError as exc:
                raise EndpointError(f"url: {host!r} is not a valid host name ({exc})") from None
        if not _LABEL.match(label):
            raise EndpointError(f"url: {host!r} is not a valid host name (label {label!r})")
        labels.append(label.lower())
    ascii_name = ".".join(labels)
    if len(ascii_name) > 253:
        raise EndpointError(f"url: {host!r} is not a host name (longer than 253)")
    return ascii_name


def normalize_url(url: str) -> str:
    """``url`` as it is stored and POSTed to: http(s), a valid host (IDNA-encoded),
    a valid port, no blank or control character, the rest percent-encoded to
    ASCII. Raises EndpointError naming what is wrong (the API's 400, the UI's
    message): the sender can always send to a URL this returned."""
    url = url.strip()
    if any(c.isspace() or ord(c) < 0x20 or 0x7F <= ord(c) < 0xA0 for c in url):
        raise EndpointError("url: no blank or control characters")
    try:
        parts = urlsplit(url)
        port = parts.port
        hostname = parts.hostname
    except ValueError as exc:
        raise EndpointError(f"url: {exc}") from None
    if parts.scheme.lower() not in ("http", "https") or not hostname:
        raise EndpointError("url: an http:// or https:// URL")
    if port == 0:
        raise EndpointError("url: port 0")
    host = _ascii_host(hostname)
    netloc = f"[{host}]" if ":" in host else host
    if port is not None:
        netloc += f":{port}"
    userinfo, at, _ = parts.netloc.rpartition("@")
    if at:
        netloc = quote(userinfo, safe=_PRINTABLE) + "@" + netloc
    out = urlunsplit(
        (
            parts.scheme.lower(),
            netloc,
            quote(parts.path, safe=_PRINTABLE) or "/",
            quote(parts.query, safe=_PRINTABLE),
            quote(parts.fragment, safe=_PRINTABLE),
        )
    )
    if len(out) > MAX_URL:
        raise EndpointError(f"url: longer than {MAX_URL} characters")
    return out


def clean_url(url: str) -> str:
    url = normalize_url(url)
    parts = urlsplit(url)
    if not tracking_settings().webhook_allow_private:
        port = parts.port or (443 if parts.scheme == "https" else 80)
        try:
            addresses = resolve(parts.hostname, port)
        except (OSError, UnicodeError):
            addresses = []  # not resolvable now: the sender checks at each POST
        private = [a for a in addresses if not is_public(a)]
        if private:
            raise EndpointError(
                f"url: {parts.hostname} is a private address ({private[0]}), refused as "
                "MAILRELAY_WEBHOOK_ALLOW_PRIVATE is false"
            )
    return url


_NAT64 = ipaddress.ip_network("64:ff9b::/96")  # RFC 6052: the IPv4 address in the last 32 bits
_NAT64_LOCAL = ipaddress.ip_network("64:ff9b:1::/48")  # RFC 8215: a local network's own
_V4_COMPATIBLE = ipaddress.ip_network("::/96")  # deprecated ::a.b.c.d


def embedded_ipv4(ip: ipaddress.IPv6Address) -> ipaddress.IPv4Address | None:
    """The IPv4 address an IPv6 address carries to its host: IPv4-mapped
    (::ffff:a.b.c.d), NAT64 (64:ff9b::a.b.c.d), 6to4 (2002:AABB:CCDD::) or
    IPv4-compatible (::a.b.c.d); None for the others."""
    if ip.ipv4_mapped is not None:
        return ip.ipv4_mapped
    if ip.sixtofour is not None:
        return ip.sixtofour
    if ip in _NAT64 or (ip in _V4_COMPATIBLE and int(ip) > 1):  # not :: nor ::1
        return ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF)
    return None


def is_public(address: str) -> bool:
    """False for loopback, RFC 1918, link-local (169.254.169.254), CGNAT, ULA…,
    and for an IPv6 address that carries one of those IPv4 addresses."""
    ip = ipaddress.ip_address(address.split("%", 1)[0])
    if isinstance(ip, ipaddress.IPv6Address):
        if ip in _NAT64_LOCAL:
            return False
        ip = embedded_ipv4(ip) or ip
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


MIN_SECRET = 32
HTTP_WARNING = (
    "url: http:// sends every event and its signature in clear (anyone on the path reads "
    "them, and may replay one while its timestamp is fresh); use https://"
)


def clean_secret(secret: str) -> str:
    """A secret of one's own: at least ``MIN_SECRET`` characters ("": a random one)."""
    if secret and len(secret) < MIN_SECRET:
        raise EndpointError(
            f"secret: at least {MIN_SECRET} characters (leave it empty for a random one)"
        )
    return secret


def warnings(endpoint: WebhookEndpoint) -> list[str]:
    """What is allowed but unwise about ``endpoint`` (the API's ``warnings``, the page's)."""
    return [HTTP_WARNING] if endpoint.url.lower().startswith("http://") else []


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
        # Viewers read the audit log: no userinfo password nor query value of the URL.
        detail=f"{endpoint.name} {redact.url(endpoint.url)} events={','.join(endpoint.events)}",
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
        secret=clean_secret(secret) or new_secret(),
        enabled=enabled,
        created_at=now,
        updated_at=now,
    )
    _audit(actor, via, "webhook_create", endpoint)
    record.invalidate()
    return endpoint


def update(actor, via: str, endpoint: WebhookEndpoint, **changes) -> WebhookEndpoint:
    # Everything checked before anything changes: a refused change changes nothing.
    url = clean_url(changes["url"]) if "url" in changes else endpoint.url
    events = clean_events(changes["events"]) if "events" in changes else endpoint.events
    secret = clean_secret(changes.get("secret") or "") or endpoint.secret
    endpoint.url, endpoint.events, endpoint.secret = url, events, secret
    if "enabled" in changes:
        endpoint.enabled = bool(changes["enabled"])
    endpoint.updated_at = clock.now()
    endpoint.save()
    _audit(actor, via, "webhook_update", endpoint)
    record.invalidate()
    return endpoint


def rotate_secret(actor, via: str, endpoint: WebhookEndpoint) -> str:
    """A new random secret for ``endpoint``; returned once (shown masked after)."""
    endpoint.secret = new_secret()
    endpoint.updated_at = clock.now()
    endpoint.save(update_fields=["secret", "updated_at"])
    _audit(actor, via, "webhook_rotate_secret", endpoint)
    record.invalidate()
    return endpoint.secret


def delete(actor, via: str, endpoint: WebhookEndpoint) -> None:
    """Delete ``endpoint`` and its deliveries. Its row is locked first: a delivery
    round that is queuing webhooks for it (``record.enqueue`` holds the row FOR
    KEY SHARE) commits first, and no new delivery row can follow once the
    lock is ours, so neither side's commit fails on the foreign key."""
    with transaction.atomic():
        list(WebhookEndpoint.objects.select_for_update().filter(pk=endpoint.pk).values_list("pk"))
        _audit(actor, via, "webhook_delete", endpoint)
        endpoint.delete()
    record.invalidate()


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
