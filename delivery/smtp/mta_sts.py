"""MTA-STS (RFC 8461): a domain's published wish that mail to it use verified TLS.

For a domain routed by DNS (MX records), before a delivery round:

1. the ``_mta-sts.<domain>`` TXT record (``v=STSv1; id=...``) says whether the
   domain has a policy and which version;
2. the policy is fetched over HTTPS from
   ``https://mta-sts.<domain>/.well-known/mta-sts.txt`` (certificate verified
   against ``MAILRELAY_TLS_CA_FILE`` or the system store; no redirects; one
   deadline, ``MAILRELAY_MTA_STS_FETCH_TIMEOUT``, for the whole fetch; header
   and body sizes capped; only from a public address unless
   ``MAILRELAY_MTA_STS_ALLOW_PRIVATE``: ``delivery.smtp.https_fetch``), and cached
   in the database (``queues.models.MtaStsPolicy``) for its ``max_age``; it is
   fetched again when the TXT id changes;
3. a failed lookup or fetch keeps using a cached policy that has not expired
   (§5.1), or applies none.

``mode: enforce`` means the MX host must match one of the policy's ``mx``
patterns and TLS must verify (``delivery.smtp.tls`` turns that into a
requirement per host); ``testing`` means deliver anyway and report; ``none``
means no policy.

The host name ``mta-sts.<domain>`` is resolved through the relay's own
resolver (``MAILRELAY_DNS_NAMESERVERS``), so tests can point it at a loopback
HTTPS server; ``MAILRELAY_MTA_STS_PORT`` (test-only, default 443) sets its port,
and ``MAILRELAY_MTA_STS_ALLOW_PRIVATE`` lets it be on loopback.
"""

from __future__ import annotations

import logging
import re
import ssl
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import TypeVar

import dns.exception
import dns.resolver

from delivery.smtp import https_fetch
from delivery.smtp.config import round_settings
from queues.lib import seconds

log = logging.getLogger(__name__)
T = TypeVar("T")

WELL_KNOWN = "/.well-known/mta-sts.txt"
MODES = ("enforce", "testing", "none")
# RFC 8461 §3.2: max_age is at most 31557600 (about a year).
MAX_AGE_LIMIT = 31_557_600
# A policy is a few lines; a bigger answer is not a policy (§3.3 suggests 64 KiB).
MAX_POLICY_BYTES = 64 * 1024
_ID = re.compile(r"^[A-Za-z0-9]{1,32}$")


@dataclass(frozen=True)
class StsPolicy:
    domain: str
    policy_id: str
    mode: str  # enforce / testing / none
    mx: tuple[str, ...]
    max_age: int

    def mx_matches(self, host: str) -> bool:
        return any(mx_matches(host, pattern) for pattern in self.mx)


class PolicyError(ValueError):
    """A policy (TXT record or file) that does not follow RFC 8461."""


def mx_matches(host: str, pattern: str) -> bool:
    """RFC 8461 §4.1: ``mail.example.com`` matches itself; ``*.example.com``
    matches exactly one more label on the left."""
    host = host.rstrip(".").lower()
    pattern = pattern.rstrip(".").lower()
    if pattern.startswith("*."):
        label, _, rest = host.partition(".")
        return bool(label) and rest == pattern[2:]
    return host == pattern


def parse_txt(texts: list[str]) -> str | None:
    """The policy id of the ``_mta-sts`` TXT records, or None when there is no
    (single, valid) STSv1 record (§3.1: several mean no policy)."""
    records = [t for t in texts if t.startswith("v=STSv1")]
    if len(records) != 1:
        return None
    fields = dict(
        part.strip().partition("=")[::2] for part in records[0].split(";") if part.strip()
    )
    policy_id = fields.get("id", "").strip()
    return policy_id if _ID.match(policy_id) else None


def parse_policy(domain: str, policy_id: str, text: str) -> StsPolicy:
    """The policy file (``key: value`` lines, §3.2); raises PolicyError."""
    fields: dict[str, list[str]] = {}
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if sep:
            fields.setdefault(key.strip().lower(), []).append(value.strip())
    if fields.get("version") != ["STSv1"]:
        raise PolicyError(f"MTA-STS policy of {domain}: version is not STSv1")
    mode = (fields.get("mode") or [""])[0].lower()
    if mode not in MODES:
        raise PolicyError(f"MTA-STS policy of {domain}: unknown mode {mode!r}")
    age = (fields.get("max_age") or [""])[0]
    if not age.isdigit():
        raise PolicyError(f"MTA-STS policy of {domain}: max_age {age!r} is not a number")
    mx = tuple(p.lower() for p in fields.get("mx", []))
    if mode != "none" and not mx:
        raise PolicyError(f"MTA-STS policy of {domain}: no mx pattern")
    return StsPolicy(domain, policy_id, mode, mx, min(int(age), MAX_AGE_LIMIT))


def check_chain(chain: list[bytes], host: str, ca_file: str) -> str:
    """Why the certificate chain (DER, leaf first) would not pass an ``enforce``
    policy for ``host``, or "" when it would: for ``testing`` policies, whose
    sessions are not verified but whose failures are reported (RFC 8461 §5)."""
    from cryptography.x509 import (
        DNSName,
        SubjectAlternativeName,
        load_der_x509_certificate,
        load_pem_x509_certificates,
    )
    from cryptography.x509.verification import Criticality, ExtensionPolicy, PolicyBuilder, Store

    if not chain:
        return "no certificate"
    bundle = ca_file or ssl.get_default_verify_paths().cafile
    if not bundle:
        return ""  # nothing to check against: say nothing rather than guess
    try:
        with open(bundle, "rb") as fh:
            store = Store(load_pem_x509_certificates(fh.read()))
        # The chain and the name as OpenSSL checks them for "enforce"; the
        # leaf's other extensions are not held to the Web PKI's stricter rules.
        ee = ExtensionPolicy.permit_all().require_present(
            SubjectAlternativeName, Criticality.AGNOSTIC, None
        )
        builder = (
            PolicyBuilder()
            .store(store)
            .extension_policies(ca_policy=ExtensionPolicy.webpki_defaults_ca(), ee_policy=ee)
        )
        verifier = builder.build_server_verifier(DNSName(host))
        certs = [load_der_x509_certificate(der) for der in chain]
        verifier.verify(certs[0], certs[1:])
    except Exception as exc:  # noqa: BLE001 - VerificationError, bad certificate, unreadable CA
        return f"certificate of {host} does not verify: {exc}"
    return ""


def _txt_id(resolver: dns.resolver.Resolver, domain: str) -> str | None:
    answer = resolver.resolve(f"_mta-sts.{domain}", "TXT", raise_on_no_answer=False)
    if answer.rrset is None:
        return None
    texts = [b"".join(r.strings).decode("ascii", "replace") for r in answer.rrset]
    return parse_txt(texts)


def fetch_text(resolver: dns.resolver.Resolver, domain: str) -> str:
    """The policy file of ``domain`` over verified HTTPS (``delivery.smtp.https_fetch``:
    one deadline, size caps, public addresses only); raises on any failure."""
    config = round_settings()
    try:
        body = https_fetch.fetch(
            resolver,
            f"mta-sts.{domain}",
            WELL_KNOWN,  # §3.3: redirects are not followed
            port=config.mta_sts_port,
            timeout=seconds(config.mta_sts_fetch_timeout),
            ca_file=config.tls_ca_file,
            allow_private=config.mta_sts_allow_private,
            max_body=MAX_POLICY_BYTES,
        )
    except https_fetch.FetchError as exc:
        raise PolicyError(str(exc)) from None
    return body.decode("utf-8", "replace")


def _cached(domain: str, now: datetime) -> tuple[StsPolicy | None, object | None]:
    from queues.models import MtaStsPolicy

    row = MtaStsPolicy.objects.filter(domain=domain).first()
    if row is None or row.expires_at <= now:
        return None, row
    return StsPolicy(domain, row.policy_id, row.mode, tuple(row.mx), row.max_age), row


def _store(policy: StsPolicy, text: str, now: datetime) -> None:
    from queues.models import MtaStsPolicy

    MtaStsPolicy.objects.update_or_create(
        domain=policy.domain,
        defaults={
            "policy_id": policy.policy_id,
            "mode": policy.mode,
            "mx": list(policy.mx),
            "max_age": policy.max_age,
            "text": text,
            "fetched_at": now,
            "expires_at": now + timedelta(seconds=policy.max_age),
        },
    )


def _published(
    resolver: dns.resolver.Resolver, domain: str, cached: StsPolicy | None
) -> tuple[str | None, str | None]:
    """The TXT id and, when it is not the cached policy's, the policy text.

    Network only, no database: the delivery round runs it in a thread of its
    own while it renews its claim (``queues.transitions.flow.while_renewing``).
    """
    try:
        policy_id = _txt_id(resolver, domain)
    except dns.exception.DNSException as exc:
        log.info("MTA-STS TXT lookup for %s failed (%s); cached policy: %s", domain, exc, cached)
        return None, None
    if policy_id is None or (cached is not None and cached.policy_id == policy_id):
        return policy_id, None
    return policy_id, fetch_text(resolver, domain)


def _at_once(work: Callable[[], T]) -> T:
    return work()


def policy_for(
    resolver: dns.resolver.Resolver,
    domain: str,
    now: datetime,
    wait: Callable[[Callable[[], T]], T] | None = None,
) -> StsPolicy | None:
    """The MTA-STS policy that applies to ``domain`` now, or None.

    Steps: TXT id; a cached, unexpired policy with that id is used as is;
    otherwise fetch, parse and cache it. A failed TXT lookup or fetch falls
    back to the cached policy while it has not expired (RFC 8461 §5.1). The
    lookup and fetch run through ``wait`` (the caller's way to wait for
    network work: a delivery round keeps its claim renewed meanwhile).
    """
    domain = domain.rstrip(".").lower()
    cached, _row = _cached(domain, now)
    wait = wait or _at_once
    try:
        policy_id, text = wait(lambda: _published(resolver, domain, cached))
        if policy_id is None or text is None:
            # no record (§5.1: a removed record does not end a cached policy
            # early), a failed lookup, or the cached policy's id
            return cached
        policy = parse_policy(domain, policy_id, text)
    except Exception as exc:  # noqa: BLE001 - DNS, TLS, HTTP, parse: all "no new policy"
        log.warning("MTA-STS policy of %s could not be fetched: %s", domain, exc)
        return cached
    _store(policy, text, now)
    return policy if policy.mode != "none" else None
