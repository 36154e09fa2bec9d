"""Who is asking: the client's address behind trusted proxies, and network checks.

``REMOTE_ADDR`` is the peer of the web server. Behind a reverse proxy that
is the proxy, so the client is taken from ``X-Forwarded-For`` only when the
peer is one of ``MAILRELAY_TRUSTED_PROXIES``: reading the header from
right to left, the first address that is not a trusted proxy is the client
(the left part of the header is whatever the client wrote, never trusted).
``DJANGO_SECURE_PROXY_SSL_HEADER`` only says the scheme; it does not make
``X-Forwarded-For`` trustworthy.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable

from django.conf import settings
from django.http import HttpRequest

Address = ipaddress.IPv4Address | ipaddress.IPv6Address
Network = ipaddress.IPv4Network | ipaddress.IPv6Network


def _address(text: str) -> Address | None:
    text = text.strip()
    if text.startswith("[") and "]" in text:  # [v6]:port
        text = text[1 : text.index("]")]
    elif text.count(":") == 1:  # v4:port
        text = text.split(":", 1)[0]
    try:
        address = ipaddress.ip_address(text)
    except ValueError:
        return None
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped:
        return address.ipv4_mapped
    return address


def _in(address: Address, networks: Iterable[Network]) -> bool:
    return any(address.version == net.version and address in net for net in networks)


def client_ip(request: HttpRequest) -> Address | None:
    """The client's address (see the module's docstring), or None when unknown."""
    peer = _address(request.META.get("REMOTE_ADDR", ""))
    trusted = list(settings.MAILRELAY_TRUSTED_PROXIES)
    if peer is None or not trusted or not _in(peer, trusted):
        return peer
    forwarded = request.META.get("HTTP_X_FORWARDED_FOR", "")
    for item in reversed([part for part in forwarded.split(",") if part.strip()]):
        hop = _address(item)
        if hop is None:
            return peer  # a hop we cannot read: the last proxy is all we know
        if not _in(hop, trusted):
            return hop
    return peer


def client_address(request: HttpRequest) -> str:
    """The client's address as text ("unknown" when there is none)."""
    address = client_ip(request)
    return str(address) if address is not None else "unknown"


def client_in_networks(request: HttpRequest, networks: Iterable[Network]) -> bool:
    """Whether the client (behind trusted proxies) is in one of ``networks``."""
    address = client_ip(request)
    return address is not None and _in(address, networks)
