"""Outbound TLS policy: how much TLS each destination requires (Postfix TLS_README).

``MAILRELAY_TLS_POLICY`` names a file in the spirit of Postfix's
``smtp_tls_policy_maps``: one ``destination level`` line per destination,
where the destination is a recipient domain (``example.com``), ``.domain``
for its subdomains, or a next hop as written in the transport map or smart
host (``[10.0.0.5]:2525``, ``relay.example.com:25``, ``relay.example.com``).
Levels:

- ``none``: never STARTTLS;
- ``may``: opportunistic (RFC 7435), a failed handshake is retried in cleartext;
- ``encrypt``: TLS required, the certificate is not checked;
- ``verify`` / ``secure``: TLS required, chain and host name verified against
  ``MAILRELAY_TLS_CA_FILE`` (default: the system store);
- ``dane``: DANE (RFC 7672, ``delivery.smtp.dane``) where the MX host has
  DNSSEC-validated TLSA records, else ``may``; ``dane-only``: no usable TLSA
  is a failure.

Destinations without a line get ``MAILRELAY_TLS_DEFAULT_LEVEL`` (``may``);
DNS-routed domains without a line may get a stricter requirement from their
MTA-STS policy (``delivery.smtp.mta_sts``, ``MAILRELAY_MTA_STS``). When several
domains share a link in one round, the strictest level applies.

A level that cannot be met is a per-connection temporary failure
(``4.7.5 ...``, Exim error name ``tls_required``), never a fall-back to
cleartext. The work happens before a round sends (``plan``: DNS and HTTPS,
bounded by timeouts; the MTA-STS part through the round's ``wait``, which
keeps its claim renewed); the SMTP client only reads the result
(``RoundTls.tls_for``, ``RoundTls.auth_for``).

The next hops' AUTH credentials (``MAILRELAY_SMTP_AUTH``, below) are looked up
in the same plan: which peer gets which account, and whether cleartext is
allowed for it.
"""

from __future__ import annotations

import base64
import logging
import os
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from datetime import datetime

from django.conf import settings

from delivery.smtp import dane, mta_sts
from delivery.smtp.dane import Tlsa

log = logging.getLogger(__name__)

LEVELS = ("none", "may", "encrypt", "verify", "secure", "dane", "dane-only")
# Which level wins when several destinations of one round disagree.
_STRICTNESS = {
    "none": 0,
    "may": 1,
    "dane": 2,
    "encrypt": 3,
    "verify": 4,
    "secure": 4,
    "dane-only": 5,
}
TLS_REQUIRED = "tls_required"  # Exim's error name, for retry rules
ENHANCED = "4.7.5"


@dataclass(frozen=True)
class TlsRequirement:
    """What the client must do with TLS for one target.

    ``level`` is recorded (Attempt.tls_policy); ``require``: no cleartext
    session; ``verify``: "" (no check), "ca" (chain and name), "mta-sts"
    (same, for MTA-STS), "dane" (``tlsa`` must match) or "report" (MTA-STS
    ``testing``: checked after the fact, a failure is only reported);
    ``refuse``: do not even connect, for this reason (e.g. an MX not allowed
    by MTA-STS).
    """

    level: str = "may"
    require: bool = False
    verify: str = ""
    tlsa: tuple[Tlsa, ...] = ()
    refuse: str = ""
    ca_file: str = ""


MAY = TlsRequirement()


def requirement(level: str, ca_file: str = "") -> TlsRequirement:
    """The requirement of a level without DNS data (not for dane levels)."""
    if level in ("verify", "secure"):
        return TlsRequirement(level, True, "ca", ca_file=ca_file)
    if level == "encrypt":
        return TlsRequirement(level, True)
    return TlsRequirement(level)


# --- the policy file ----------------------------------------------------------------


def parse_policy(text: str) -> dict[str, str]:
    """Destination → level; raises ValueError naming the line."""
    table: dict[str, str] = {}
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        parts = line.split()
        if len(parts) != 2:
            raise ValueError(f"line {number}: expected 'destination level', got {raw.strip()!r}")
        destination, level = parts[0].lower(), parts[1].lower()
        if level not in LEVELS:
            raise ValueError(
                f"line {number}: unknown level {parts[1]!r} (known: {', '.join(LEVELS)})"
            )
        table[destination.rstrip(".")] = level
    return table


_loaded: tuple[tuple[str, float], dict[str, str]] | None = None


def load_policy() -> dict[str, str]:
    """The table of ``MAILRELAY_TLS_POLICY``, read again when the file changes."""
    global _loaded
    path = settings.MAILRELAY_TLS_POLICY.strip()
    if not path:
        return {}
    stamp = (path, os.stat(path).st_mtime)
    if _loaded is None or _loaded[0] != stamp:
        with open(path, encoding="utf-8") as fh:
            _loaded = (stamp, parse_policy(fh.read()))
    return _loaded[1]


def validate_tls_settings() -> list[tuple[str, object]]:
    """(setting, check) pairs for the start-up check (``delivery.checks``): each
    check raises ValueError naming the bad line."""

    def policy() -> object:
        try:
            return load_policy()
        except OSError as exc:
            raise ValueError(f"cannot read {settings.MAILRELAY_TLS_POLICY!r}: {exc}") from None

    def default() -> object:
        if settings.MAILRELAY_TLS_DEFAULT_LEVEL not in LEVELS:
            raise ValueError(f"must be one of {', '.join(LEVELS)}")
        return None

    return [
        ("MAILRELAY_TLS_POLICY", policy),
        ("MAILRELAY_TLS_DEFAULT_LEVEL", default),
        ("MAILRELAY_SMTP_AUTH", load_auth),
    ]


def _domain_keys(domain: str) -> Iterable[str]:
    """``a.b.com``, then ``.b.com``, then ``.com`` (Postfix: ``.domain`` matches
    subdomains only)."""
    domain = domain.rstrip(".").lower()
    yield domain
    labels = domain.split(".")
    for i in range(1, len(labels)):
        yield "." + ".".join(labels[i:])


def level_for(
    table: dict[str, str], domains: Iterable[str], hop_names: Iterable[str]
) -> str | None:
    """The strictest level configured for the round's next hops and domains,
    or None when no line applies."""
    found = [table[name.lower()] for name in hop_names if name.lower() in table]
    for domain in domains:
        for key in _domain_keys(domain):
            if key in table:
                found.append(table[key])
                break
    return max(found, key=_STRICTNESS.__getitem__) if found else None


# --- one round ----------------------------------------------------------------------


def _names(host: str, port: int) -> list[str]:
    """The ways a next hop may be written, most specific first."""
    return [f"[{host}]:{port}", f"[{host}]", f"{host}:{port}", host]


@dataclass
class RoundTls:
    """The TLS requirement and AUTH credentials per target for one round."""

    default: TlsRequirement = MAY
    by_target: dict[tuple[str, int], TlsRequirement] = field(default_factory=dict)
    auth: dict[tuple[str, int], Credentials] = field(default_factory=dict)
    # MTA-STS "testing" failures, for the operator (queues Event)
    reports: list[str] = field(default_factory=list)

    def tls_for(self, peer) -> TlsRequirement:
        return self.by_target.get((peer.host, peer.port), self.default)

    def auth_for(self, peer) -> Credentials | None:
        return self.auth.get((peer.host, peer.port))


def plan(
    link_hops: Sequence,
    dns_routed: bool,
    domains: Sequence[str],
    targets: Sequence,
    now: datetime,
    wait: Callable | None = None,
) -> RoundTls:
    """Work out, before a round, what each target requires (see the module doc).

    ``link_hops`` are the link's ``NextHop``s, ``targets`` the addresses the
    client will try (``routing.Target``: host, ip, port). ``wait`` runs the
    MTA-STS lookups and fetches (``mta_sts.policy_for``): a round passes one
    that renews its claim meanwhile.
    """
    from delivery.route.dns import make_resolver
    from delivery.route.routing import configured_hops, hop_label

    ca_file = settings.MAILRELAY_TLS_CA_FILE
    hops = list(link_hops)
    if not dns_routed:  # the hops as written too, when an MX lookup expanded them
        hops += [hop for domain in domains for hop in configured_hops(domain)]
    hop_names = list(
        dict.fromkeys(n for hop in hops for n in [hop_label(hop), *_names(hop.host, hop.port)])
    )
    configured = level_for(load_policy(), domains, hop_names)
    level = configured or settings.MAILRELAY_TLS_DEFAULT_LEVEL
    rnd = RoundTls(default=requirement(level, ca_file))
    hosts = sorted({(t.host, t.port) for t in targets})
    if level in ("dane", "dane-only"):
        for host, port in hosts:
            rnd.by_target[(host, port)] = _dane(level, host, port, make_resolver(cache=False))
        # A target not looked up (none should be): no TLSA known.
        rnd.default = (
            TlsRequirement(level)
            if level == "dane"
            else TlsRequirement(level, True, refuse=f"{ENHANCED} no TLSA lookup for this host")
        )
    elif configured is None and dns_routed and settings.MAILRELAY_MTA_STS:
        _apply_mta_sts(rnd, make_resolver(), domains, hosts, now, ca_file, wait)
    table = load_auth()
    if table:
        for host, port in hosts:
            creds = lookup_auth(table, _names(host, port) + hop_names)
            if creds is not None:
                rnd.auth[(host, port)] = creds
    return rnd


def _dane(level: str, host: str, port: int, resolver) -> TlsRequirement:
    try:
        records = dane.tlsa_records(resolver, host, port)
    except dane.TlsaLookupError as exc:
        # RFC 7672 §2.2.1: a failed TLSA lookup must not lead to cleartext.
        return TlsRequirement(level, True, refuse=f"{ENHANCED} {exc}; will retry")
    if records:
        return TlsRequirement(level, True, "dane", records)
    if level == "dane-only":
        return TlsRequirement(
            level,
            True,
            refuse=f"{ENHANCED} no usable DNSSEC-validated TLSA record for {host} (dane-only)",
        )
    return TlsRequirement(level)  # dane without TLSA: opportunistic


def _apply_mta_sts(
    rnd: RoundTls,
    resolver,
    domains: Sequence[str],
    hosts: Sequence[tuple[str, int]],
    now: datetime,
    ca_file: str,
    wait: Callable | None,
) -> None:
    policies = [p for d in domains if (p := mta_sts.policy_for(resolver, d, now, wait)) is not None]
    policies = [p for p in policies if p.mode in ("enforce", "testing")]
    if not policies:
        return
    enforce = [p for p in policies if p.mode == "enforce"]
    for host, port in hosts:
        if enforce:
            bad = [p for p in enforce if not p.mx_matches(host)]
            if bad:
                rnd.by_target[(host, port)] = TlsRequirement(
                    "mta-sts",
                    True,
                    "mta-sts",
                    refuse=(
                        f"{ENHANCED} MX host {host} does not match the MTA-STS policy "
                        f"of {bad[0].domain} (mx: {', '.join(bad[0].mx)}; mode enforce)"
                    ),
                )
            else:
                rnd.by_target[(host, port)] = TlsRequirement(
                    "mta-sts", True, "mta-sts", ca_file=ca_file
                )
        testing = [p for p in policies if p.mode == "testing"]
        for p in testing:
            if not p.mx_matches(host):
                rnd.reports.append(
                    f"MTA-STS (testing) of {p.domain}: MX host {host} does not match "
                    f"{', '.join(p.mx)}; delivered anyway"
                )
        if testing and not enforce:
            # TLS is checked after the fact; a failure is reported, not fatal.
            rnd.by_target[(host, port)] = TlsRequirement("may", False, "report", ca_file=ca_file)


# ----------------------------------------------------------------------------
# Credentials for AUTH to next hops (Postfix's ``smtp_sasl_password_maps``).
#
# ``MAILRELAY_SMTP_AUTH`` names a file of lines::
#
#     # next hop                  username:password            flags
#     [smtp.office365.com]:587    relay@example.com:s3cret
#     [10.0.0.5]:25               relay:secret                 allow-cleartext
#     smtp.provider.net           user:pass
#
# The next hop is written as in the transport map or smart host: ``[host]:port``
# or ``[host]`` for a host used as is, ``host:port`` or ``host`` for a name
# (looked up for MX); a line also matches a host it expands to, and the MX host
# names themselves. The password is everything after the first colon (it may
# contain colons, not spaces). Credentials are never sent without TLS unless
# the line says ``allow-cleartext``, nor over TLS whose certificate was not
# verified (policy ``may``/``encrypt``) unless the line says ``allow-cleartext``
# or ``MAILRELAY_SMTP_AUTH_ALLOW_UNVERIFIED_TLS`` is set (``delivery.smtp.connection``). With
# ``MAILRELAY_SMTP_AUTH_FILE`` (a mounted secret) the setting's value is the
# file's content itself.
# ----------------------------------------------------------------------------


ALLOW_CLEARTEXT = "allow-cleartext"


@dataclass(frozen=True)
class Credentials:
    username: str
    password: str = field(repr=False)  # never in logs or reprs
    allow_cleartext: bool = False

    def plain(self) -> bytes:
        """The AUTH PLAIN initial response (RFC 4616): NUL user NUL password."""
        raw = b"\0" + self.username.encode() + b"\0" + self.password.encode()
        return base64.b64encode(raw)


def _key(spec: str) -> str:
    return spec.strip().lower()


def parse_auth(text: str) -> dict[str, Credentials]:
    """Next hop → credentials; raises ValueError naming the line (not the password)."""
    table: dict[str, Credentials] = {}
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        parts = line.split()
        if len(parts) < 2 or ":" not in parts[1]:
            raise ValueError(f"line {number}: expected 'next-hop username:password [flags]'")
        flags = parts[2:]
        unknown = [f for f in flags if f != ALLOW_CLEARTEXT]
        if unknown:
            raise ValueError(f"line {number}: unknown flag {unknown[0]!r} (known: allow-cleartext)")
        username, _, password = parts[1].partition(":")
        if not username:
            raise ValueError(f"line {number}: empty username")
        table[_key(parts[0])] = Credentials(username, password, ALLOW_CLEARTEXT in flags)
    return table


_auth_loaded: tuple[tuple[str, float], dict[str, Credentials]] | None = None


def load_auth() -> dict[str, Credentials]:
    """The table of ``MAILRELAY_SMTP_AUTH`` (a path, or the content from a
    ``_FILE`` secret), read again when the file changes."""
    global _auth_loaded
    value = settings.MAILRELAY_SMTP_AUTH
    if not value.strip():
        return {}
    path = value.strip()
    if any(ch.isspace() for ch in path):  # content (a _FILE secret), not a path
        return parse_auth(value)
    if not os.path.isfile(path):
        raise ValueError(f"file {path!r} does not exist")
    stamp = (path, os.stat(path).st_mtime)
    if _auth_loaded is None or _auth_loaded[0] != stamp:
        with open(path, encoding="utf-8") as fh:
            _auth_loaded = (stamp, parse_auth(fh.read()))
    return _auth_loaded[1]


def lookup_auth(table: dict[str, Credentials], names: list[str]) -> Credentials | None:
    """The credentials of the first of ``names`` (next-hop spellings, most
    specific first) that has a line."""
    for name in names:
        creds = table.get(_key(name))
        if creds is not None:
            return creds
    return None
