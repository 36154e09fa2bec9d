"""The DNS resolver of the relay, built from settings.

``MAILRELAY_DNS_NAMESERVERS`` lists ``ip[:port]`` entries (IPv6 with a port
in brackets: ``[::1]:5353``); an empty list means the system's resolver
(``/etc/resolv.conf``). ``MAILRELAY_DNS_TIMEOUT`` bounds one whole lookup
(dnspython's *lifetime*), retransmissions included.
"""

from __future__ import annotations

import ipaddress
import re
import threading
from collections.abc import Sequence
from datetime import timedelta

import dns.nameserver
import dns.resolver

from delivery.route.config import route_settings
from queues.lib import seconds

DNS_PORT = 53
# dnspython retransmits a UDP query after this long when a server stays silent;
# the lifetime (the setting) bounds the whole lookup.
_RETRANSMIT_AFTER = 2.0
_CACHE_SIZE = 10_000

_BRACKETED = re.compile(r"^\[(?P<ip>[^\]]+)\](?::(?P<port>\d+))?$")

# One TTL-respecting cache per nameserver configuration, shared by every
# resolver a process builds: the categorizer and delivery build a resolver per
# batch, and a per-resolver cache would forget everything between batches.
_caches: dict[tuple[tuple[str, int], ...], dns.resolver.LRUCache] = {}
_caches_lock = threading.Lock()


def parse_nameserver(spec: str) -> tuple[str, int]:
    """``1.2.3.4``, ``1.2.3.4:5353``, ``::1`` or ``[::1]:5353`` → ``(ip, port)``.

    Raises ValueError with a message that names the bad entry.
    """
    text = spec.strip()
    port_text: str | None = None
    match = _BRACKETED.match(text)
    if match:
        ip_text, port_text = match.group("ip"), match.group("port")
    elif text.count(":") == 1:
        ip_text, port_text = text.split(":")
    else:
        # no colon (IPv4) or several (a bare IPv6 address, no port)
        ip_text = text
    try:
        ip = ipaddress.ip_address(ip_text)
    except ValueError:
        raise ValueError(
            f"nameserver {spec!r} is not an IP address with an optional port "
            "(e.g. 192.0.2.53, 192.0.2.53:5353, [2001:db8::53]:5353)"
        ) from None
    if match and ip.version == 4 and port_text is None:
        raise ValueError(f"nameserver {spec!r}: brackets are only needed for IPv6 with a port")
    port = DNS_PORT
    if port_text is not None:
        port = int(port_text) if port_text.isdigit() else 0
        if not 0 < port < 65536:
            raise ValueError(f"nameserver {spec!r}: port must be 1-65535")
    return str(ip), port


def _shared_cache(servers: Sequence[tuple[str, int]]) -> dns.resolver.LRUCache:
    key = tuple(servers)
    with _caches_lock:
        cache = _caches.get(key)
        if cache is None:
            cache = _caches[key] = dns.resolver.LRUCache(_CACHE_SIZE)
        return cache


def clear_caches() -> None:
    """Forget every cached answer (tests that change a zone with TTLs above 0)."""
    with _caches_lock:
        for cache in _caches.values():
            cache.flush()


def make_resolver(
    nameservers: Sequence[str] | None = None,
    timeout: float | timedelta | None = None,
    *,
    cache: bool = True,
) -> dns.resolver.Resolver:
    """A dnspython resolver for the relay.

    ``nameservers`` and ``timeout`` default to ``MAILRELAY_DNS_NAMESERVERS``
    and ``MAILRELAY_DNS_TIMEOUT`` (``delivery.route.config``). With ``cache``
    the resolver shares a process-wide cache (per nameserver list) that
    honours the records' TTLs, negative answers included.
    """
    if nameservers is None:
        nameservers = route_settings().dns_nameservers
    if timeout is None:
        timeout = route_settings().dns_timeout
    servers = [parse_nameserver(spec) for spec in nameservers]
    if servers:
        resolver = dns.resolver.Resolver(configure=False)
        resolver.nameservers = [dns.nameserver.Do53Nameserver(ip, port) for ip, port in servers]
    else:
        resolver = dns.resolver.Resolver()  # the system's /etc/resolv.conf
    lifetime = seconds(timeout)
    if lifetime <= 0:
        raise ValueError(f"DNS timeout must be positive, not {timeout!r}")
    resolver.lifetime = lifetime
    resolver.timeout = min(_RETRANSMIT_AFTER, lifetime)
    if cache:
        resolver.cache = _shared_cache(servers)
    return resolver
