"""One bounded HTTPS GET from a server that strangers choose (MTA-STS, RFC 8461 §3.3).

Whoever controls a recipient domain picks the server and its address, so what
it could stretch is bounded here, not by what it sends:

- one deadline for the whole fetch (address lookup, connect, TLS handshake,
  request, headers, body): each step waits at most for the time that is left
  (CPython keeps one deadline across a TLS handshake or read call), so a server
  trickling its answer a byte at a time is cut at the deadline;
- at most MAX_HEADER_BYTES of status line and header fields, and at most
  ``max_body`` bytes of body plus MAX_FRAMING_BYTES of chunked framing,
  counted on the wire (chunk extensions and trailers included);
- only public addresses, unless ``allow_private``: never loopback, private,
  shared (100.64/10), link-local (169.254.169.254, the cloud metadata
  service), multicast, reserved or unspecified ones, nor the IPv6 forms of
  such an IPv4 address (IPv4-mapped, NAT64, 6to4).
"""

from __future__ import annotations

import http.client
import io
import socket
import ssl
import time
from ipaddress import IPv4Address, IPv6Address, ip_address, ip_network

import dns.exception
import dns.resolver

MAX_HEADER_BYTES = 16 * 1024
MAX_FRAMING_BYTES = 16 * 1024

_NAT64 = ip_network("64:ff9b::/96")  # RFC 6052 well-known prefix: the IPv4 is embedded
_NAT64_LOCAL = ip_network("64:ff9b:1::/48")  # RFC 8215: local use


class FetchError(Exception):
    """The fetch was refused or cut: the address, the size, the time, the status.
    (Not a ValueError: http.client turns those into IncompleteRead.)"""


def is_public(ip: IPv4Address | IPv6Address) -> bool:
    """Whether ``ip`` is a public unicast address (an IPv6 form of an IPv4
    address is judged by the IPv4 address)."""
    if isinstance(ip, IPv6Address):
        if ip in _NAT64_LOCAL:
            return False
        embedded = ip.ipv4_mapped or ip.sixtofour
        if embedded is None and ip in _NAT64:
            embedded = IPv4Address(int(ip) & 0xFFFFFFFF)
        if embedded is not None:
            return is_public(embedded)
    return ip.is_global and not (
        ip.is_multicast or ip.is_reserved or ip.is_private or ip.is_link_local
    )


class _Deadline:
    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.end = time.monotonic() + seconds

    def left(self) -> float:
        """The time left; TimeoutError when none is."""
        left = self.end - time.monotonic()
        if left <= 0:
            raise TimeoutError("deadline reached")
        return left


class _Wire(io.RawIOBase):
    """The TLS socket as http.client reads it: each read waits at most for the
    time left, and no more than ``limit`` bytes are read in all."""

    def __init__(self, sock: ssl.SSLSocket, deadline: _Deadline) -> None:
        self.sock = sock
        self.deadline = deadline
        self.received = 0
        self.limit = MAX_HEADER_BYTES
        self.too_large = f"response headers larger than {MAX_HEADER_BYTES} bytes"

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:  # type: ignore[override]
        if self.received >= self.limit:
            raise FetchError(self.too_large)
        self.sock.settimeout(self.deadline.left())
        n = self.sock.recv_into(buffer, min(len(buffer), self.limit - self.received))
        self.received += n
        return n


class _Source:
    """What http.client.HTTPResponse reads from (it only calls ``makefile``)."""

    def __init__(self, wire: _Wire) -> None:
        self.wire = wire

    def makefile(self, mode: str) -> io.BufferedReader:
        return io.BufferedReader(self.wire)


def _address(resolver: dns.resolver.Resolver, host: str, deadline: _Deadline, allow_private: bool):
    found: list[str] = []
    for qtype in ("A", "AAAA"):
        try:
            answer = resolver.resolve(host, qtype, lifetime=deadline.left())
        except dns.resolver.NoAnswer:
            continue
        found = [str(ip_address(r.address)) for r in answer]
        break
    if not found:
        raise FetchError(f"{host} has no address")
    usable = found if allow_private else [a for a in found if is_public(ip_address(a))]
    if not usable:
        raise FetchError(f"{host}: {', '.join(found)} is not a public address; not fetched")
    return usable[0]


def fetch(
    resolver: dns.resolver.Resolver,
    host: str,
    path: str,
    *,
    port: int,
    timeout: float,
    ca_file: str,
    allow_private: bool,
    max_body: int,
) -> bytes:
    """The body of ``GET https://host:port/path`` when it answers 200 (the
    certificate verified for ``host``; redirects are not followed); raises
    FetchError (or the DNS or TLS error) otherwise."""
    deadline = _Deadline(timeout)
    url = f"https://{host}{path}"
    try:
        ip = _address(resolver, host, deadline, allow_private)
        context = ssl.create_default_context(cafile=ca_file or None)
        with socket.create_connection((ip, port), deadline.left()) as raw:
            raw.settimeout(deadline.left())
            with context.wrap_socket(raw, server_hostname=host) as sock:
                sock.settimeout(deadline.left())
                sock.sendall(
                    f"GET {path} HTTP/1.1\r\nHost: {host}\r\nUser-Agent: mailrelay\r\n"
                    "Connection: close\r\n\r\n".encode("ascii")
                )
                wire = _Wire(sock, deadline)
                response = http.client.HTTPResponse(_Source(wire), method="GET")  # type: ignore[arg-type]
                response.begin()
                if response.status != 200:
                    raise FetchError(f"{url} answered HTTP {response.status}")
                wire.limit = MAX_HEADER_BYTES + max_body + MAX_FRAMING_BYTES
                wire.too_large = f"{url} is larger than {max_body} bytes (with its framing)"
                body = response.read(max_body + 1)
    except (TimeoutError, dns.exception.Timeout):
        raise FetchError(f"{url} did not answer in full within {timeout:g}s") from None
    except http.client.HTTPException as exc:
        raise FetchError(f"{url}: bad HTTP response ({exc!r})") from None
    if len(body) > max_body:
        raise FetchError(f"{url} is larger than {max_body} bytes")
    return body
