"""DANE for SMTP (RFC 7672): TLSA records of an MX host, and matching them.

The relay does not validate DNSSEC itself. Like Postfix, it trusts the
configured resolver (``MAILRELAY_DNS_NAMESERVERS``, which should be a local
validating resolver) and uses a TLSA answer only when that resolver set the
AD ("authenticated data") bit. An answer without it is no TLSA at all
(RFC 7672 §2.2: "insecure" TLSA records are unusable).

Usable records: usage 3 (DANE-EE: the server's own key or certificate) and
2 (DANE-TA: a trust anchor in the chain the server sends), selector 0 (whole
certificate) or 1 (SubjectPublicKeyInfo), matching type 0 (exact), 1
(SHA-256) or 2 (SHA-512). Usages 0 and 1 (PKIX) are unusable for SMTP
(RFC 7672 §3.1.3). With DANE-EE the name and dates in the certificate are
not checked (§3.1.1); with DANE-TA the chain is checked to contain the anchor.
"""

from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass

import dns.exception
import dns.flags
import dns.resolver
from cryptography import x509
from cryptography.hazmat.primitives import serialization

log = logging.getLogger(__name__)

DANE_TA = 2
DANE_EE = 3
_USAGES = (DANE_TA, DANE_EE)
_SELECTORS = (0, 1)
_MATCHING = {0: None, 1: hashlib.sha256, 2: hashlib.sha512}
_EDNS_PAYLOAD = 1232


@dataclass(frozen=True)
class Tlsa:
    usage: int
    selector: int
    mtype: int
    data: bytes

    def __str__(self) -> str:
        return f"{self.usage} {self.selector} {self.mtype} {self.data.hex()[:16]}…"


class TlsaLookupError(Exception):
    """The TLSA lookup failed (SERVFAIL, timeout): not the same as "none"."""


def usable(record: Tlsa) -> bool:
    return record.usage in _USAGES and record.selector in _SELECTORS and record.mtype in _MATCHING


def tlsa_records(resolver: dns.resolver.Resolver, host: str, port: int) -> tuple[Tlsa, ...]:
    """The usable TLSA records of ``_port._tcp.host`` that the resolver
    validated (AD bit); () when there are none or the answer was not validated.

    ``resolver`` is changed to ask for DNSSEC data (EDNS DO, AD) and should
    not share the answer cache (a cached answer was maybe asked without DO).
    Raises TlsaLookupError when the lookup itself failed.
    """
    resolver.use_edns(0, dns.flags.DO, _EDNS_PAYLOAD)
    resolver.flags = dns.flags.RD | dns.flags.AD
    name = f"_{port}._tcp.{host.rstrip('.')}"
    try:
        answer = resolver.resolve(name, "TLSA", raise_on_no_answer=False)
    except (dns.resolver.NXDOMAIN, dns.resolver.NoNameservers) as exc:
        if isinstance(exc, dns.resolver.NXDOMAIN):
            return ()
        raise TlsaLookupError(f"TLSA lookup of {name} failed: {exc}") from None
    except dns.exception.DNSException as exc:
        raise TlsaLookupError(f"TLSA lookup of {name} failed: {exc}") from None
    if not answer.response.flags & dns.flags.AD:
        if answer.rrset is not None:
            log.info("TLSA records of %s not DNSSEC-validated (no AD bit): ignored", name)
        return ()
    if answer.rrset is None:
        return ()
    records = (Tlsa(r.usage, r.selector, r.mtype, bytes(r.cert)) for r in answer.rrset)
    return tuple(r for r in records if usable(r))


def _selected(cert_der: bytes, selector: int) -> bytes:
    if selector == 0:
        return cert_der
    cert = x509.load_der_x509_certificate(cert_der)
    return cert.public_key().public_bytes(
        serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
    )


def _matches(record: Tlsa, cert_der: bytes) -> bool:
    try:
        data = _selected(cert_der, record.selector)
    except ValueError:  # a certificate cryptography cannot parse matches nothing
        return False
    digest = _MATCHING[record.mtype]
    return (digest(data).digest() if digest else data) == record.data


def match(records: tuple[Tlsa, ...], chain: list[bytes]) -> Tlsa | None:
    """The record the peer's certificate chain (DER, leaf first) matches, or None.

    DANE-EE looks at the leaf only; DANE-TA at every certificate the server
    sent after the leaf (the anchor itself must be in the chain, RFC 7672 §3.1.2) and the leaf
    must lead up to it by signatures. The name in the certificate is not
    checked (a simplification: RFC 7672 §3.2.2 wants it for DANE-TA).
    """
    if not chain:
        return None
    for record in records:
        if record.usage == DANE_EE:
            if _matches(record, chain[0]):
                return record
            continue
        for depth in range(1, len(chain)):
            if _matches(record, chain[depth]) and _issued_through(chain[: depth + 1]):
                return record
    return None


def _issued_through(chain: list[bytes]) -> bool:
    """Whether each certificate of ``chain`` was signed by the next one (the
    leaf leads up to the trust anchor that ends the list)."""
    try:
        certs = [x509.load_der_x509_certificate(der) for der in chain]
        for child, parent in zip(certs, certs[1:], strict=False):
            child.verify_directly_issued_by(parent)
    except Exception:  # noqa: BLE001 - bad signature, unsupported key: no match
        return False
    return True
