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
cleartext. The work happens before a round sends (``delivery.smtp.client.plan``:
DNS and HTTPS, bounded by timeouts; the MTA-STS part through the round's
``wait``, which keeps its claim renewed); the SMTP client only reads the
result (``RoundTls.tls_for``, ``RoundTls.auth_for``). This module holds what
the plan reads: the levels and ``TlsRequirement``, the policy file's format
(``parse_policy``), what DANE and MTA-STS require of a round's hosts.

The next hops' AUTH credentials (``MAILRELAY_SMTP_AUTH``, below: the file's
format and ``lookup_auth``) are looked up in the same plan: which peer gets
which account, and whether cleartext is allowed for it.
"""

from __future__ import annotations

import base64
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import datetime

from delivery.route.dns import make_resolver
from delivery.smtp import dane, mta_sts
from delivery.smtp.dane import Tlsa

log = logging.getLogger(__name__)

LEVELS = ("none", "may", "encrypt", "verify", "secure", "dane", "dane-only")
# Which level wins when several destinations of one round disagree.
STRICTNESS = {
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


# --- what DANE and MTA-STS require (for ``delivery.smtp.client.plan``) ---------------


def dane_requirements(
    level: str, hosts: Sequence[tuple[str, int]]
) -> tuple[TlsRequirement, dict[tuple[str, int], TlsRequirement]]:
    """What a ``dane``/``dane-only`` level requires of a target not looked up
    (none should be: no TLSA known), and of each of ``hosts``, looked up."""
    by_target = {
        (host, port): _dane(level, host, port, make_resolver(cache=False)) for host, port in hosts
    }
    default = (
        TlsRequirement(level)
        if level == "dane"
        else TlsRequirement(level, True, refuse=f"{ENHANCED} no TLSA lookup for this host")
    )
    return default, by_target


def _dane(level: str, host: str, port: int, resolver) -> TlsRequirement:
    """What a ``dane``/``dane-only`` level requires of one MX host, from its
    DNSSEC-validated TLSA records (RFC 7672)."""
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


def mta_sts_requirements(
    domains: Sequence[str],
    hosts: Sequence[tuple[str, int]],
    now: datetime,
    ca_file: str,
    wait: Callable | None,
) -> tuple[dict[tuple[str, int], TlsRequirement], list[str]]:
    """What the recipient domains' MTA-STS policies require of each of ``hosts``
    (none: no requirement of their own), and what their "testing" policies
    would refuse, for the operator."""
    resolver = make_resolver()
    by_target: dict[tuple[str, int], TlsRequirement] = {}
    reports: list[str] = []
    policies = [p for d in domains if (p := mta_sts.policy_for(resolver, d, now, wait)) is not None]
    policies = [p for p in policies if p.mode in ("enforce", "testing")]
    if not policies:
        return by_target, reports
    enforce = [p for p in policies if p.mode == "enforce"]
    for host, port in hosts:
        if enforce:
            bad = [p for p in enforce if not p.mx_matches(host)]
            if bad:
                by_target[(host, port)] = TlsRequirement(
                    "mta-sts",
                    True,
                    "mta-sts",
                    refuse=(
                        f"{ENHANCED} MX host {host} does not match the MTA-STS policy "
                        f"of {bad[0].domain} (mx: {', '.join(bad[0].mx)}; mode enforce)"
                    ),
                )
            else:
                by_target[(host, port)] = TlsRequirement(
                    "mta-sts", True, "mta-sts", ca_file=ca_file
                )
        testing = [p for p in policies if p.mode == "testing"]
        for p in testing:
            if not p.mx_matches(host):
                reports.append(
                    f"MTA-STS (testing) of {p.domain}: MX host {host} does not match "
                    f"{', '.join(p.mx)}; delivered anyway"
                )
        if testing and not enforce:
            # TLS is checked after the fact; a failure is reported, not fatal.
            by_target[(host, port)] = TlsRequirement("may", False, "report", ca_file=ca_file)
    return by_target, reports


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


def lookup_auth(table: dict[str, Credentials], names: list[str]) -> Credentials | None:
    """The credentials of the first of ``names`` (next-hop spellings, most
    specific first) that has a line."""
    for name in names:
        creds = table.get(_key(name))
        if creds is not None:
            return creds
    return None
