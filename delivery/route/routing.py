"""Routing: which next hop receives the mail of a recipient domain.

Two moments use this module:

* **categorization** — ``Router.route(domain)`` decides the delivery type,
  the queue and the link of a domain: the transport map
  (``MAILRELAY_TRANSPORTS``) first, else the smart host
  (``MAILRELAY_SMART_HOST``), else the domain's MX records (RFC 5321 §5.1,
  RFC 7505). MX lookups happen here, so a route names concrete hosts.
* **delivery** — ``order_targets(hosts)`` turns a route's hosts into the
  ordered list of addresses to connect to: random among hosts of equal
  preference, A before AAAA, IP literals as they are.

Next-hop syntax follows Postfix: ``[host]:port`` (also ``[192.0.2.1]`` and
``[IPv6:2001:db8::1]``) is a literal host whose MX is never looked up;
``host[:port]`` without brackets is looked up for MX first, as Postfix's
relayhost is, falling back to the host's own A/AAAA records. One spec may
list several next hops separated by blanks (``[a]:25 [b]:25``); they are
tried in the order written.
"""

from __future__ import annotations

import functools
import hashlib
import ipaddress
import random
import re
import types
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Protocol

import dns.exception
import dns.name
import dns.rdatatype
import dns.resolver
from django.conf import settings

from delivery.route.config import route_settings
from delivery.route.dns import make_resolver, parse_nameserver
from queues import lib
from queues.config import once_per_process
from queues.services.reroute import NextHopRoute

# queues.models.DeliveryType values (kept as strings: routing does not import models)
TRANSPORT_MAP = "transport_map"
SMART_HOST = "smart_host"
DNS_MX = "dns_mx"

# Enhanced status codes (RFC 3463) of routing failures.
NULL_MX = "5.1.10"  # RFC 7505 §4.2: the domain accepts no mail
BAD_DESTINATION = "5.1.2"  # the domain does not exist or cannot receive mail
BAD_SYNTAX = "5.1.3"  # the domain is not a valid domain name
DNS_FAILURE = "4.4.3"  # directory server failure: try again later
UNROUTABLE = "4.4.4"  # a configured next hop has no usable DNS data (a setup problem)

# Link.name is a CharField(max_length=1024).
LINK_NAME_MAX = 1024

# A host name label: letters, digits, hyphens inside; underscores are seen in
# the wild on internal hosts, so tolerate them.
_LABEL = r"[A-Za-z0-9_](?:[A-Za-z0-9_-]{0,61}[A-Za-z0-9_])?"
_HOSTNAME = re.compile(rf"^{_LABEL}(?:\.{_LABEL})*\.?$")
_BRACKETED = re.compile(r"^\[(?P<host>[^\[\]]*)\](?::(?P<port>[^:]*))?$")
# Characters that can never appear in a transport-map key.
_BAD_KEY_CHARS = re.compile(r"[\s\[\]=,:@/\\]")


# --- a route: where the mail of one domain goes, as routing answers --------------------


@dataclass(frozen=True)
class NextHop:
    """One host to connect to. ``literal`` hosts are not looked up for MX."""

    host: str
    port: int
    preference: int = 0
    literal: bool = False

    def as_json(self) -> dict:
        return {
            "host": self.host,
            "port": self.port,
            "preference": self.preference,
            "literal": self.literal,
        }

    @classmethod
    def from_json(cls, data: dict) -> NextHop:
        return cls(
            data["host"],
            int(data["port"]),
            int(data.get("preference", 0)),
            bool(data.get("literal", False)),
        )


@dataclass(frozen=True)
class Route:
    """Where the recipients of one domain go.

    ``queue_name`` names the delivery queue (the destination domain);
    ``link_name`` names the next hop, shared by every queue behind it.
    ``hosts`` are in preference order; ties are shuffled at delivery time.
    """

    delivery_type: str  # queues.models.DeliveryType value
    queue_name: str
    link_name: str
    hosts: tuple[NextHop, ...]


class RouteError(Exception):
    """Routing failed. ``permanent`` failures fail the recipient (5xx)."""

    def __init__(self, text: str, *, permanent: bool, enhanced: str) -> None:
        super().__init__(text)
        self.text = text
        self.permanent = permanent
        self.enhanced = enhanced


class Shuffler(Protocol):
    def shuffle(self, x: list, /) -> None: ...


@dataclass(frozen=True)
class Target:
    """One address to connect to: ``host`` is the name it came from (for logs)."""

    host: str
    ip: str
    port: int


# --- parsing ------------------------------------------------------------------


def _parse_port(text: str | None, spec: str, default_port: int) -> int:
    if text is None:
        return default_port
    if not text.isdigit() or not 0 < int(text) < 65536:
        raise ValueError(f"next hop {spec!r}: port {text!r} is not a number from 1 to 65535")
    return int(text)


def _parse_hostname(text: str, spec: str) -> str:
    if len(text.rstrip(".")) > 253 or not _HOSTNAME.match(text):
        raise ValueError(
            f"next hop {spec!r}: {text!r} is not a host name "
            "(letters, digits, hyphens, dots; use the xn-- form for IDN)"
        )
    return text.rstrip(".").lower()


def _parse_one_hop(spec: str, default_port: int) -> NextHop:
    match = _BRACKETED.match(spec)
    if match:
        inner = match.group("host")
        port = _parse_port(match.group("port"), spec, default_port)
        if inner[:5].lower() == "ipv6:":
            try:
                return NextHop(str(ipaddress.IPv6Address(inner[5:])), port, 0, literal=True)
            except ValueError:
                raise ValueError(
                    f"next hop {spec!r}: {inner[5:]!r} is not an IPv6 address"
                ) from None
        try:
            return NextHop(str(ipaddress.ip_address(inner)), port, 0, literal=True)
        except ValueError:
            pass
        return NextHop(_parse_hostname(inner, spec), port, 0, literal=True)
    if "[" in spec or "]" in spec:
        raise ValueError(f"next hop {spec!r}: bad brackets (write [host] or [host]:port)")
    if spec.count(":") > 1:
        raise ValueError(
            f"next hop {spec!r}: an IPv6 address must be in brackets, e.g. [2001:db8::1]:25"
        )
    host, _, port_text = spec.partition(":")
    port = _parse_port(port_text if ":" in spec else None, spec, default_port)
    try:
        # An IP address has no MX records: Postfix would look it up and fail;
        # we take the operator's meaning and use it as a literal.
        return NextHop(str(ipaddress.IPv4Address(host)), port, 0, literal=True)
    except ValueError:
        pass
    return NextHop(_parse_hostname(host, spec), port, 0, literal=False)


def parse_next_hop(spec: str, default_port: int | None = None) -> tuple[NextHop, ...]:
    """Parse a next-hop spec (Postfix syntax) into its hops, in the order written.

    ``[host]:port``, ``[192.0.2.1]``, ``[IPv6:2001:db8::1]`` → literal (no MX
    lookup); ``host[:port]`` → MX lookup of ``host`` at routing time; a bare
    IPv4 address is literal. Several hops may be separated by blanks; each
    gets ``preference`` = its position. Host names are lower-cased, a final
    dot removed. Raises ValueError naming the bad part.
    """
    if default_port is None:
        default_port = route_settings().remote_smtp_port
    parts = spec.split()
    if not parts:
        raise ValueError("empty next hop (expected [host]:port or host[:port])")
    return tuple(
        replace(_parse_one_hop(part, default_port), preference=index)
        for index, part in enumerate(parts)
    )


def _parse_transport_key(key: str, entry: str) -> str:
    """A transport-map key in the form recipient domains are routed by (``domain_key``):
    ``ｅｘａｍｐｌｅ.test`` and ``Example.TEST.`` are ``example.test``, ``.bücher.de``
    is ``.xn--bcher-kva.de``; a leading dot (subdomains) is kept."""
    subdomains = key.startswith(".")
    bare = key[1:] if subdomains else key
    if not bare or _BAD_KEY_CHARS.search(bare):
        raise ValueError(
            f"transport {entry!r}: {key!r} is not a domain (use example.com, or "
            ".example.com for its subdomains)"
        )
    try:
        name = lib.domain_key(bare)
    except lib.DomainError as exc:
        raise ValueError(f"transport {entry!r}: {key!r} is not a domain ({exc})") from None
    return "." + name if subdomains else name


def parse_transports(text: str, default_port: int | None = None) -> dict[str, tuple[NextHop, ...]]:
    """Parse ``MAILRELAY_TRANSPORTS``: ``domain=next-hop`` entries, comma separated.

    ``example.com=[10.0.0.5]:2525,.example.com=relay.example.net`` maps
    example.com exactly and (through the leading dot) every subdomain of
    example.com, Postfix style. Entries may also be on separate lines.
    Returns ``{key: hops}`` with keys in the one form of a domain
    (``queues.lib``: lower-case A-labels, leading dot kept). Raises
    ValueError naming the bad entry: no ``=``, a bad domain, a bad next hop,
    or a domain given twice (in any of its forms).
    """
    transports: dict[str, tuple[NextHop, ...]] = {}
    for raw in re.split(r"[,\n]", text):
        entry = raw.strip()
        if not entry:
            continue
        key, sep, value = entry.partition("=")
        if not sep:
            raise ValueError(f"transport {entry!r}: expected domain=next-hop")
        domain = _parse_transport_key(key.strip(), entry)
        try:
            hops = parse_next_hop(value, default_port)
        except ValueError as exc:
            raise ValueError(f"transport {entry!r}: {exc}") from None
        if domain in transports:
            raise ValueError(f"transport {entry!r}: {domain} is mapped twice")
        transports[domain] = hops
    return transports


def lookup_transport(
    transports: Mapping[str, tuple[NextHop, ...]], domain: str
) -> tuple[str, tuple[NextHop, ...]] | None:
    """The transport entry for ``domain``: the exact key, else the closest ``.parent``.

    ``a.b.example.com`` tries ``a.b.example.com``, ``.b.example.com``,
    ``.example.com``, ``.com``; ``.example.com`` never matches example.com
    itself (as in Postfix). Returns ``(key, hops)`` or None.
    """
    if domain in transports:
        return domain, transports[domain]
    labels = domain.split(".")
    for i in range(1, len(labels)):
        key = "." + ".".join(labels[i:])
        if key in transports:
            return key, transports[key]
    return None


def routing_setting_checks() -> list[tuple[str, Callable[[], object]]]:
    """(setting, check) pairs of the routing settings for the start-up check
    (``delivery.checks``): each check raises ValueError naming the bad line."""
    port = settings.MAILRELAY_REMOTE_SMTP_PORT
    smart_host = settings.MAILRELAY_SMART_HOST
    return [
        ("MAILRELAY_TRANSPORTS", lambda: parse_transports(settings.MAILRELAY_TRANSPORTS, port)),
        ("MAILRELAY_SMART_HOST", lambda: smart_host.strip() and parse_next_hop(smart_host, port)),
        (
            "MAILRELAY_DNS_NAMESERVERS",
            lambda: [parse_nameserver(spec) for spec in settings.MAILRELAY_DNS_NAMESERVERS],
        ),
    ]


# --- ordering -----------------------------------------------------------------


def hop_label(hop: NextHop) -> str:
    """``mx1.example.com:25`` for an MX-style host, ``[10.0.0.5]:2525`` for a literal."""
    return f"[{hop.host}]:{hop.port}" if hop.literal else f"{hop.host}:{hop.port}"


def link_name(hosts: Sequence[NextHop]) -> str:
    """The name of the link behind ``hosts`` (already in route order).

    Two domains with the same next hops get the same name, and so share one
    link (one set of connections, one retry state). A name too long for
    the Link table keeps its start and ends in a digest of the whole.
    """
    name = ",".join(hop_label(hop) for hop in hosts)
    if len(name) <= LINK_NAME_MAX:
        return name
    digest = hashlib.sha256(name.encode()).hexdigest()[:16]
    return f"{name[: LINK_NAME_MAX - 20]}...#{digest}"


def sort_mx(records: Iterable[NextHop], rng: Shuffler | None = None) -> list[NextHop]:
    """Hosts in ascending preference; among equal preferences random, or by name.

    Steps:
    1. sort by (preference, host, port), so the result depends only on the
       set of records and the rng, never on the order DNS answered in;
    2. without ``rng`` stop there: the stable order a Route keeps, so that
       link names do not change when a server rotates its answers;
    3. with ``rng`` shuffle each run of equal preference (RFC 5321 §5.1:
       the client randomizes among MX records of equal preference).
    """
    ordered = sorted(records, key=lambda hop: (hop.preference, hop.host, hop.port))
    if rng is None:
        return ordered
    result: list[NextHop] = []
    start = 0
    while start < len(ordered):
        end = start
        while end < len(ordered) and ordered[end].preference == ordered[start].preference:
            end += 1
        group = ordered[start:end]
        rng.shuffle(group)
        result.extend(group)
        start = end
    return result


def _chain(groups: Sequence[Sequence[NextHop]]) -> tuple[NextHop, ...]:
    """Join the expanded hops of a multi-hop spec, keeping the spec's order.

    One spec (the usual case) keeps its MX preferences as DNS gave them. With
    several, preferences are renumbered 0, 1, 2… per run of equal
    preference, so that the spec order wins and ties inside one MX set stay ties.
    """
    if len(groups) == 1:
        return tuple(groups[0])
    out: list[NextHop] = []
    rank = -1
    for group in groups:
        previous = None
        for hop in group:
            if hop.preference != previous:
                rank += 1
                previous = hop.preference
            out.append(replace(hop, preference=rank))
    return tuple(out)


def _dedupe(hosts: Iterable[NextHop]) -> list[NextHop]:
    """Keep the first (best) occurrence of each host and port."""
    seen: set[tuple[str, int]] = set()
    out = []
    for hop in hosts:
        if (hop.host, hop.port) not in seen:
            seen.add((hop.host, hop.port))
            out.append(hop)
    return out


# --- DNS ----------------------------------------------------------------------


class _NullMX(Exception):
    """The name publishes a null MX (RFC 7505)."""


def _server_errors(errors: Iterable[tuple]) -> str:
    # dnspython's error tuples: (server, tcp, port, error, response)
    texts = [f"{err[0]} answered {err[3]}" for err in errors]
    return "; ".join(texts) or "no nameserver answered"


def _query(resolver: dns.resolver.Resolver, name: str, rdtype: str) -> list:
    """The records of ``rdtype`` at ``name``: [] when the name exists without
    them (NODATA). Raises dnspython's NXDOMAIN, or a temporary RouteError
    (4.4.3) on SERVFAIL, timeout or any other failure to get an answer."""
    try:
        answer = resolver.resolve(
            dns.name.from_text(name), rdtype, raise_on_no_answer=False, search=False
        )
    except dns.resolver.NXDOMAIN:
        raise
    except dns.resolver.LifetimeTimeout:
        raise RouteError(
            # the configured limit, not the measured time: it is what an operator can change
            f"DNS lookup of {rdtype} records for {name} timed out after "
            f"{resolver.lifetime:g} s; will retry",
            permanent=False,
            enhanced=DNS_FAILURE,
        ) from None
    except dns.resolver.NoNameservers as exc:
        raise RouteError(
            f"DNS lookup of {rdtype} records for {name} failed "
            f"({_server_errors(exc.kwargs.get('errors', []))}); will retry",
            permanent=False,
            enhanced=DNS_FAILURE,
        ) from None
    except dns.exception.DNSException as exc:
        raise RouteError(
            f"DNS lookup of {rdtype} records for {name} failed ({exc}); will retry",
            permanent=False,
            enhanced=DNS_FAILURE,
        ) from None
    return list(answer.rrset) if answer.rrset is not None else []


def _mx_hosts(resolver: dns.resolver.Resolver, name: str, port: int) -> list[NextHop] | None:
    """The MX hosts of ``name`` in stable route order, or None when it has no MX.

    Steps:
    1. query MX (NXDOMAIN and temporary errors propagate);
    2. no records (NODATA) → None: the caller applies the implicit MX rule;
    3. drop targets that are the root ``.``; if nothing is left the name
       has a null MX (RFC 7505) → _NullMX. (A null MX beside real MX records
       breaks RFC 7505 §3; the real ones are used.);
    4. one entry per host (its best preference), sorted by preference then name.
    """
    records = _query(resolver, name, "MX")
    if not records:
        return None
    hops = [
        NextHop(rr.exchange.to_text(omit_final_dot=True).lower(), port, rr.preference)
        for rr in records
        if rr.exchange != dns.name.root
    ]
    if not hops:
        raise _NullMX(name)
    return _dedupe(sort_mx(hops))


def _has_address(resolver: dns.resolver.Resolver, name: str) -> bool:
    """Whether ``name`` has an A or AAAA record (the implicit MX, RFC 5321 §5.1).

    A temporary failure of one type does not matter when the other answers
    with addresses; otherwise it propagates, as it may be hiding the address.
    """
    failure: RouteError | None = None
    for rdtype in ("A", "AAAA"):
        try:
            if _query(resolver, name, rdtype):
                return True
        except RouteError as exc:
            failure = failure or exc
    if failure is not None:
        raise failure
    return False


def _addresses(resolver: dns.resolver.Resolver, host: str) -> tuple[list[str], list[str]]:
    """A then AAAA addresses of ``host``, and the texts of what failed."""
    addresses: list[str] = []
    errors: list[str] = []
    for rdtype in ("A", "AAAA"):
        try:
            addresses.extend(rr.address for rr in _query(resolver, host, rdtype))
        except dns.resolver.NXDOMAIN:
            return [], [f"{host}: no such host (NXDOMAIN)"]
        except RouteError as exc:
            errors.append(f"{host}: {exc.text}")
    if not addresses and not errors:
        errors.append(f"{host}: no A or AAAA record")
    return addresses, errors


def order_targets(
    hosts: Sequence[NextHop],
    resolver: dns.resolver.Resolver | None = None,
    rng: Shuffler = random,
) -> tuple[list[Target], str]:
    """The addresses to try, in order, for a route's hosts (at delivery time).

    Steps:
    1. order the hosts: ascending preference, shuffled among equals (sort_mx);
    2. per host: an IP address is its own target; a name is resolved for A,
       then AAAA (never MX: the route already holds the MX hosts), each
       address a target in the order DNS gave;
    3. a host that does not resolve is skipped; a temporary DNS failure is
       skipped too, and both are reported;
    4. an address already listed (two MX names, one machine) is tried once.

    Returns ``(targets, errors)``: ``errors`` says what failed ("" if
    nothing), one clause per host joined by "; ". No targets means the next
    hop is unreachable for now; the caller decides how to retry.
    """
    targets: list[Target] = []
    errors: list[str] = []
    seen: set[tuple[str, int]] = set()
    for hop in sort_mx(hosts, rng):
        try:
            addresses = [str(ipaddress.ip_address(hop.host))]
        except ValueError:
            if resolver is None:
                resolver = make_resolver()
            addresses, failed = _addresses(resolver, hop.host)
            errors.extend(failed)
        for ip in addresses:
            if (ip, hop.port) not in seen:
                seen.add((ip, hop.port))
                targets.append(Target(hop.host, ip, hop.port))
    return targets, "; ".join(errors)


# --- the router ---------------------------------------------------------------


def _route_name(domain: str) -> str:
    """The name a recipient domain is routed by (its one form); RouteError without one.

    Recipient domains are normalised at accept; this catches rows stored
    before that was so, and callers that pass raw text.
    """
    text = domain.strip()
    if not text:
        raise RouteError("empty recipient domain", permanent=True, enhanced=BAD_SYNTAX)
    try:
        return lib.domain_key(text)
    except lib.DomainError as exc:
        raise RouteError(
            f"{text} is not a valid domain name ({exc})", permanent=True, enhanced=BAD_SYNTAX
        ) from None


@functools.lru_cache(maxsize=4)
def _configured_routes(
    transports: str, smart_host: str, port: int
) -> tuple[Mapping[str, tuple[NextHop, ...]], tuple[NextHop, ...]]:
    """MAILRELAY_TRANSPORTS and MAILRELAY_SMART_HOST parsed (cached: not per batch)."""
    parsed = parse_transports(transports, port)
    hops = parse_next_hop(smart_host, port) if smart_host.strip() else ()
    return types.MappingProxyType(dict(parsed)), tuple(hops)


def configured_hops(domain: str) -> tuple[NextHop, ...]:
    """The next hops of ``domain`` as written in the transport map or smart host
    (before any MX lookup), or () when DNS routes it: the names a TLS policy
    or AUTH line may use for them (the round's TLS plan, delivery.smtp.client)."""
    router = configured_router()
    try:
        entry = lookup_transport(router.transports, _route_name(domain))
    except RouteError:
        return ()
    return entry[1] if entry is not None else router.smart_host


def override_route(spec: str, queue_name: str) -> Route:
    """The route of a queue re-routed by an operator to ``spec`` (Postfix next-hop
    syntax, as a transport-map entry: ``[10.0.0.9]:25``, ``smarthost.example.net``).

    Parsed and expanded as a configured next hop is (literal as written, other
    hosts through their MX now), so the re-route delivers over the link of
    exactly these hosts. Raises ValueError for a bad spec and RouteError when a
    host name has no usable DNS data.
    """
    router = configured_router()
    hops = parse_next_hop(spec.strip(), router.default_port)
    labels = " ".join(hop_label(h) for h in hops)
    return router._make(TRANSPORT_MAP, queue_name, router._expand(hops, f"re-route to {labels}"))


def resolve_override(spec: str, queue_name: str) -> NextHopRoute:
    """``override_route`` as the store's re-route asks for it (queues.services.
    reroute.route_resolver, plugged in by delivery.apps): the link's name, type
    and hosts, or ValueError saying why ``spec`` cannot be used."""
    try:
        route = override_route(spec, queue_name)
    except RouteError as exc:
        raise ValueError(exc.text) from None
    return NextHopRoute(
        route.link_name, route.delivery_type, [hop.as_json() for hop in route.hosts]
    )


class Router:
    """Routes recipient domains: transport map, else smart host, else DNS MX.

    Build it with ``Router.from_settings()``; tests pass the same strings the
    settings hold (or parsed hops) and a resolver. The resolver is only
    built when a lookup is needed.
    """

    def __init__(
        self,
        *,
        transports: str | Mapping[str, tuple[NextHop, ...]] = "",
        smart_host: str | Sequence[NextHop] = "",
        resolver: dns.resolver.Resolver | None = None,
        default_port: int | None = None,
    ) -> None:
        if default_port is None:
            default_port = route_settings().remote_smtp_port
        self.default_port = default_port
        if isinstance(transports, str):
            transports = parse_transports(transports, default_port)
        self.transports = dict(transports)
        if isinstance(smart_host, str):
            smart_host = parse_next_hop(smart_host, default_port) if smart_host.strip() else ()
        self.smart_host = tuple(smart_host)
        self._resolver = resolver

    @classmethod
    def from_settings(cls) -> Router:
        """A router on the configured routes, parsed once per process (and again
        only when the settings change, as tests change them)."""
        config = route_settings()
        port = config.remote_smtp_port
        transports, smart_host = _configured_routes(config.transports, config.smart_host, port)
        return cls(transports=transports, smart_host=smart_host, default_port=port)

    @property
    def resolver(self) -> dns.resolver.Resolver:
        if self._resolver is None:
            self._resolver = make_resolver()
        return self._resolver

    def route(self, domain: str) -> Route:
        """The route of ``domain``, or RouteError.

        Steps:
        1. normalise the domain (its one form: IDNA 2008 + UTS #46 in A-labels,
           lower case, no final dot; an address literal in lower case);
        2. transport map: the exact domain, else the closest ``.parent`` key;
        3. else the smart host;
        4. else an address literal (``[192.0.2.1]``) is its own next hop;
        5. else DNS: MX hosts by preference; no MX → the domain itself if it
           has A/AAAA (implicit MX); null MX, NXDOMAIN, or no MX and no
           address → permanent failure; SERVFAIL or timeout → temporary.
        Next hops without brackets (transport map, smart host) are looked up
        for MX here too (step 2, 3), like Postfix's relayhost.
        """
        name = _route_name(domain)
        entry = lookup_transport(self.transports, name)
        if entry is not None:
            key, hops = entry
            labels = " ".join(hop_label(h) for h in hops)
            what = f"transport {key}={labels} (MAILRELAY_TRANSPORTS)"
            return self._make(TRANSPORT_MAP, name, self._expand(hops, what))
        if self.smart_host:
            labels = " ".join(hop_label(h) for h in self.smart_host)
            what = f"smart host {labels} (MAILRELAY_SMART_HOST)"
            return self._make(SMART_HOST, name, self._expand(self.smart_host, what))
        if name.startswith("["):
            return self._make(DNS_MX, name, (self._address_literal(name),))
        return self._make(DNS_MX, name, self._dns_route(name))

    def _make(self, delivery_type: str, queue_name: str, hosts: Sequence[NextHop]) -> Route:
        return Route(delivery_type, queue_name, link_name(hosts), tuple(hosts))

    def _address_literal(self, name: str) -> NextHop:
        inner = name[1:-1] if name.endswith("]") else ""
        if inner.startswith("ipv6:"):
            inner = inner[5:]
        try:
            ip = ipaddress.ip_address(inner)
        except ValueError:
            raise RouteError(
                f"{name} is not a valid address literal", permanent=True, enhanced=BAD_SYNTAX
            ) from None
        return NextHop(str(ip), self.default_port, 0, literal=True)

    def _dns_route(self, domain: str) -> tuple[NextHop, ...]:
        """MX hosts of a recipient domain; failures here are the domain's own."""
        try:
            dns.name.from_text(domain)
        except dns.exception.DNSException as exc:
            raise RouteError(
                f"{domain} is not a valid domain name ({exc})",
                permanent=True,
                enhanced=BAD_SYNTAX,
            ) from None
        try:
            hosts = _mx_hosts(self.resolver, domain, self.default_port)
            if hosts is None:
                if not _has_address(self.resolver, domain):
                    raise RouteError(
                        f"domain {domain} has no MX, A or AAAA record: it cannot receive mail",
                        permanent=True,
                        enhanced=BAD_DESTINATION,
                    )
                # Found by its address record, not an MX: "literal" (no MX lookup),
                # which also makes its errors Exim's *_A kind.
                hosts = [NextHop(domain, self.default_port, 0, literal=True)]
        except dns.resolver.NXDOMAIN:
            raise RouteError(
                f"domain {domain} does not exist (DNS answered NXDOMAIN)",
                permanent=True,
                enhanced=BAD_DESTINATION,
            ) from None
        except _NullMX:
            raise RouteError(
                f"domain {domain} has a null MX (RFC 7505): it accepts no mail",
                permanent=True,
                enhanced=NULL_MX,
            ) from None
        return tuple(hosts)

    def _expand(self, hops: Sequence[NextHop], what: str) -> tuple[NextHop, ...]:
        """Configured next hops → hosts: literal as they are, others through MX.

        A DNS problem with a configured next hop is the operator's to fix, not
        the recipient's fault: it is always temporary (mail waits, visible in
        the Unreachable queue), never a bounce.
        """
        groups: list[list[NextHop]] = []
        for hop in hops:
            if hop.literal:
                groups.append([replace(hop, preference=0)])
                continue
            try:
                mx = _mx_hosts(self.resolver, hop.host, hop.port)
            except dns.resolver.NXDOMAIN:
                raise RouteError(
                    f"{what}: {hop.host} does not exist in DNS (NXDOMAIN); check the setting",
                    permanent=False,
                    enhanced=UNROUTABLE,
                ) from None
            except _NullMX:
                raise RouteError(
                    f"{what}: {hop.host} has a null MX (RFC 7505); "
                    f"write [{hop.host}]:{hop.port} to skip the MX lookup",
                    permanent=False,
                    enhanced=UNROUTABLE,
                ) from None
            except RouteError as exc:
                raise RouteError(
                    f"{what}: {exc.text}", permanent=False, enhanced=exc.enhanced
                ) from None
            # No MX: the host itself (its A/AAAA are looked up at delivery).
            groups.append(mx if mx is not None else [NextHop(hop.host, hop.port, 0)])
        return tuple(_dedupe(_chain(groups)))


# The router on the configured routes, built once per process (queues.config):
# the categorizer's batches and the rounds' TLS plans share it and its resolver.
configured_router = once_per_process(Router.from_settings)
