"""A real DNS server on loopback, serving a zone that each test writes.

The server (dnslib, UDP and TCP on one ephemeral port of 127.0.0.1) runs
once per test session; the ``dns_server`` fixture hands each test an empty
zone and the log of queries it received::

    def test_it_prefers_the_lower_mx(dns_settings):
        dns_settings.mx("example.com", [(10, "mx1.example.com"), (20, "mx2.example.com")])
        dns_settings.a("mx1.example.com", "127.0.0.2")

Any name the test did not configure answers NXDOMAIN with the AA flag; a
configured name without records of the asked type answers NOERROR/NODATA.
Records are served with TTL 0 and a negative TTL (SOA minimum) of 0, so a
caching resolver never keeps an answer from one test for the next.

``dns_settings`` also points ``MAILRELAY_DNS_NAMESERVERS`` at the server
(with a 1 s DNS timeout); processes started by a test can use
``dns_server.env()`` for the same.
"""

from __future__ import annotations

import logging
import socket
import threading
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from datetime import timedelta

import pytest
from dnslib import AAAA, CNAME, MX, QTYPE, RCODE, RR, SOA, A, DNSError, DNSRecord
from dnslib.server import DNSHandler, DNSLogger, DNSServer

from delivery.route.dns import clear_caches

log = logging.getLogger(__name__)

ADDRESS = "127.0.0.1"
TEST_DNS_TIMEOUT = timedelta(seconds=1)
# serve_forever() looks at its shutdown flag this often: keeps teardown quick.
_POLL_INTERVAL = 0.05
_MAX_CNAME_CHAIN = 8


def _norm(name: str) -> str:
    return name.strip().rstrip(".").lower()


class _Dropped(DNSError):
    """Raised by the resolver to send no answer (dnslib's handler swallows DNSError)."""


@dataclass(frozen=True)
class Query:
    name: str  # lower case, no final dot
    qtype: str  # "MX", "A", ...
    protocol: str  # "udp" or "tcp"


@dataclass
class _Node:
    records: dict[str, list] = field(default_factory=dict)  # qtype → rdata list
    cname: str | None = None


class DNSZone:
    """A mutable in-memory zone; every setter replaces what the name had for that type.

    ``servfail(name)`` and ``drop(name)`` apply to every type asked for at
    the name, or only to ``qtype`` when given (e.g. to fail AAAA only).
    """

    def __init__(self, ttl: int = 0) -> None:
        self.ttl = ttl
        self._lock = threading.Lock()
        self._nodes: dict[str, _Node] = {}
        self._servfail: set[tuple[str, str | None]] = set()
        self._drop: set[tuple[str, str | None]] = set()
        self._authentic: set[tuple[str, str | None]] = set()
        self.queries: list[Query] = []

    # --- what tests call ---

    def mx(self, name: str, records: Iterable[tuple[int, str]]) -> None:
        """MX records ``[(preference, exchange), ...]``; an empty list makes the
        name exist with no MX (NODATA)."""
        self._set(name, "MX", [MX(exchange, preference) for preference, exchange in records])

    def null_mx(self, name: str) -> None:
        """The RFC 7505 null MX: a single ``MX 0 .``."""
        self._set(name, "MX", [MX(".", 0)])

    def a(self, name: str, *addresses: str) -> None:
        self._set(name, "A", [A(address) for address in addresses])

    def aaaa(self, name: str, *addresses: str) -> None:
        self._set(name, "AAAA", [AAAA(address) for address in addresses])

    def txt(self, name: str, *texts: str | bytes) -> None:
        """One TXT record per text; a text longer than 255 octets is split into
        several character-strings (RFC 7208 3.3, RFC 6376 3.6.2.2: readers join
        them), as a DKIM key record of a 2048-bit RSA key needs."""
        from dnslib import TXT  # here: the import line is shared with the TLSA work

        records = []
        for text in texts:
            raw = text.encode("ascii") if isinstance(text, str) else text
            records.append(TXT([raw[i : i + 255] for i in range(0, len(raw), 255)] or [b""]))
        self._set(name, "TXT", records)

    def tlsa(self, name: str, *records: tuple[int, int, int, bytes]) -> None:
        """TLSA records ``(usage, selector, matching type, data)`` at ``name``
        (``_25._tcp.mx.example.com``); ``authentic(name)`` to mark them validated."""
        from dnslib import TLSA  # here: the import line is shared with the TXT work

        self._set(name, "TLSA", [TLSA(u, s, m, data) for u, s, m, data in records])

    def authentic(self, name: str, qtype: str | None = None) -> None:
        """Answers for ``name`` (``qtype`` only, when given) carry the AD bit, as
        a validating resolver sets it for DNSSEC-signed data (RFC 4035 §3.2.3)."""
        with self._lock:
            self._authentic.add((_norm(name), qtype and qtype.upper()))

    def cname(self, name: str, target: str) -> None:
        with self._lock:
            self._nodes[_norm(name)] = _Node(cname=_norm(target))

    def exists(self, name: str) -> None:
        """Make ``name`` exist without records (every type is NODATA)."""
        with self._lock:
            self._nodes.setdefault(_norm(name), _Node())

    def servfail(self, name: str, qtype: str | None = None) -> None:
        with self._lock:
            self._servfail.add((_norm(name), qtype and qtype.upper()))

    def drop(self, name: str, qtype: str | None = None) -> None:
        """Never answer (the client times out)."""
        with self._lock:
            self._drop.add((_norm(name), qtype and qtype.upper()))

    def remove(self, name: str) -> None:
        """Forget ``name`` and its failure modes: it answers NXDOMAIN again."""
        key = _norm(name)
        with self._lock:
            self._nodes.pop(key, None)
            self._servfail = {item for item in self._servfail if item[0] != key}
            self._drop = {item for item in self._drop if item[0] != key}

    def reset(self) -> None:
        with self._lock:
            self.ttl = 0
            self._nodes.clear()
            self._servfail.clear()
            self._drop.clear()
            self._authentic.clear()
            self.queries.clear()

    def queried(self, name: str | None = None, qtype: str | None = None) -> list[Query]:
        """The queries received so far, optionally only for ``name`` / ``qtype``."""
        with self._lock:
            return [
                q
                for q in self.queries
                if (name is None or q.name == _norm(name)) and (qtype is None or q.qtype == qtype)
            ]

    # --- serving ---

    def _set(self, name: str, qtype: str, rdatas: list) -> None:
        with self._lock:
            node = self._nodes.setdefault(_norm(name), _Node())
            node.cname = None
            node.records[qtype] = rdatas

    def _exists(self, name: str) -> bool:
        # An empty non-terminal (a parent of a configured name) exists too.
        return name in self._nodes or any(other.endswith("." + name) for other in self._nodes)

    def _fails(self, modes: set[tuple[str, str | None]], name: str, qtype: str) -> bool:
        return (name, None) in modes or (name, qtype) in modes

    def _soa(self) -> RR:
        # The SOA minimum is the negative-caching TTL (RFC 2308): 0 as well.
        soa = SOA("ns.test.", "hostmaster.test.", (1, 60, 60, 60, self.ttl))
        return RR(".", QTYPE.SOA, rdata=soa, ttl=self.ttl)

    def answer(self, request: DNSRecord, protocol: str) -> DNSRecord:
        """The reply to ``request``; raises _Dropped to send none.

        Steps:
        1. log the query;
        2. dropped name/type → no reply; SERVFAIL name/type → SERVFAIL, not
           authoritative;
        3. follow CNAMEs inside the zone, adding them to the answer;
        4. name absent → NXDOMAIN; present → its records of the type (NODATA
           when none), authoritative, with the SOA in the authority section
           of negative answers.
        """
        name = _norm(str(request.q.qname))
        qtype = QTYPE.get(request.q.qtype, str(request.q.qtype))
        reply = request.reply()  # QR, AA and RA set, question copied
        with self._lock:
            self.queries.append(Query(name, qtype, protocol))
            if self._fails(self._drop, name, qtype):
                raise _Dropped(f"dropping {name} {qtype}")
            if self._fails(self._servfail, name, qtype):
                reply.header.aa = 0
                reply.header.rcode = RCODE.SERVFAIL
                return reply
            owner = name
            for _ in range(_MAX_CNAME_CHAIN):
                node = self._nodes.get(owner)
                if node is None or node.cname is None or qtype == "CNAME":
                    break
                reply.add_answer(RR(owner, QTYPE.CNAME, rdata=CNAME(node.cname), ttl=self.ttl))
                owner = node.cname
            if not self._exists(owner):
                reply.header.rcode = RCODE.NXDOMAIN
                reply.add_auth(self._soa())
                return reply
            node = self._nodes.get(owner) or _Node()
            if qtype == "CNAME" and node.cname:
                rdatas = [CNAME(node.cname)]
            else:
                rdatas = node.records.get(qtype, [])
            for rdata in rdatas:
                reply.add_answer(RR(owner, getattr(QTYPE, qtype), rdata=rdata, ttl=self.ttl))
            # reply() copies the query's flags, AD included (RFC 6840 §5.7 lets a
            # client set it to ask): only data marked authentic keeps it.
            reply.header.ad = int(self._fails(self._authentic, owner, qtype))
            if not rdatas:
                reply.add_auth(self._soa())
            return reply


class _ZoneResolver:
    """dnslib's resolver interface over a DNSZone."""

    def __init__(self, zone: DNSZone) -> None:
        self.zone = zone

    def resolve(self, request: DNSRecord, handler: DNSHandler) -> DNSRecord:
        return self.zone.answer(request, handler.protocol)


class DNSTestServer(DNSZone):
    """The zone plus the UDP and TCP servers that serve it on ``ADDRESS:port``."""

    def __init__(self, address: str = ADDRESS) -> None:
        super().__init__()
        self.address = address
        self.port = 0
        self._servers: list[DNSServer] = []
        self._threads: list[threading.Thread] = []

    @property
    def nameserver(self) -> str:
        """The ``ip:port`` entry for MAILRELAY_DNS_NAMESERVERS."""
        return f"{self.address}:{self.port}"

    def env(self) -> dict[str, str]:
        """Environment for a child process (worker, ingress) to use this server."""
        return {
            "MAILRELAY_DNS_NAMESERVERS": self.nameserver,
            "MAILRELAY_DNS_TIMEOUT": f"{int(TEST_DNS_TIMEOUT.total_seconds())}s",
        }

    def start(self) -> None:
        """Bind UDP on an ephemeral port, TCP on the same port, and serve both."""
        resolver = _ZoneResolver(self)
        logger = DNSLogger(prefix=False, logf=log.debug)
        for _attempt in range(20):
            udp = DNSServer(resolver, address=self.address, port=0, logger=logger)
            port = udp.server.server_address[1]
            try:
                tcp = DNSServer(resolver, address=self.address, port=port, tcp=True, logger=logger)
            except OSError:  # the port is taken for TCP: try another one
                udp.server.server_close()
                continue
            break
        else:
            raise RuntimeError("could not bind a UDP+TCP port pair for the test DNS server")
        self.port = port
        self._servers = [udp, tcp]
        for server in self._servers:
            thread = threading.Thread(
                target=server.server.serve_forever,
                kwargs={"poll_interval": _POLL_INTERVAL},
                name=f"test-dns-{server.server.socket_type}",
                daemon=True,
            )
            thread.start()
            self._threads.append(thread)

    def stop(self) -> None:
        for server in self._servers:
            server.server.shutdown()
            server.server.server_close()
        for thread in self._threads:
            thread.join(timeout=5)
        self._servers, self._threads = [], []


@pytest.fixture(scope="session")
def _dns_server_session() -> Iterator[DNSTestServer]:
    server = DNSTestServer()
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def dns_server(_dns_server_session: DNSTestServer) -> Iterator[DNSTestServer]:
    """The loopback DNS server with an empty zone and an empty query log."""
    _dns_server_session.reset()
    # A test may raise the TTL; its answers must not outlive it in the
    # relay's process-wide resolver cache.
    clear_caches()
    yield _dns_server_session
    _dns_server_session.reset()
    clear_caches()


@pytest.fixture
def dns_settings(dns_server: DNSTestServer, settings) -> DNSTestServer:
    """``dns_server``, with the relay's settings pointing at it and no
    transport map or smart host, so routing goes to DNS."""
    settings.MAILRELAY_DNS_NAMESERVERS = [dns_server.nameserver]
    settings.MAILRELAY_DNS_TIMEOUT = TEST_DNS_TIMEOUT
    settings.MAILRELAY_TRANSPORTS = ""
    settings.MAILRELAY_SMART_HOST = ""
    return dns_server


def free_udp_port(address: str = ADDRESS) -> int:
    """A port on which nothing answers (for "no nameserver reachable" tests)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        sock.bind((address, 0))
        return sock.getsockname()[1]
