"""DANE for SMTP (RFC 7672): TLSA records from the DNS fixture, with and
without the AD bit, against real STARTTLS peers on loopback."""

from __future__ import annotations

import asyncio
import hashlib
from pathlib import Path

import pytest
import trustme
from cryptography import x509
from cryptography.hazmat.primitives import serialization

from delivery.route.routing import NextHop
from delivery.smtp.client import deliver, plan
from delivery.smtp.types import BatchResult
from tests.test_smtp_client import A, Target, config, message
from tests.test_tls_policy import certificate

MX = "mx.dane.test"


@pytest.fixture(scope="module")
def ca() -> trustme.CA:
    return trustme.CA()


@pytest.fixture
def peer(sink_factory, ca, tmp_path: Path):
    """A STARTTLS sink presenting a certificate for MX issued by ``ca``."""
    return sink_factory(A, tls=True, certificate=certificate(ca, tmp_path, MX))


def spki_sha256(pem: bytes) -> bytes:
    cert = x509.load_pem_x509_certificate(pem)
    spki = cert.public_key().public_bytes(
        serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
    )
    return hashlib.sha256(spki).digest()


def run_round(settings, dns, port: int, level: str = "dane") -> BatchResult:
    settings.MAILRELAY_TLS_DEFAULT_LEVEL = level
    target = Target(MX, A, port)
    rnd = plan([NextHop(MX, port)], True, ["dane.test"], [target], None)
    cfg = config(tls_for=rnd.tls_for)
    return asyncio.run(deliver([target], [message("rcpt@dane.test")], cfg))


def publish(dns, port: int, *records, authentic: bool = True) -> None:
    name = f"_{port}._tcp.{MX}"
    dns.tlsa(name, *records)
    if authentic:
        dns.authentic(name)


def issued_leaf(ca: trustme.CA, tmp_path: Path) -> bytes:
    return (tmp_path / f"{MX}.pem").read_bytes().split(b"-----END CERTIFICATE-----")[0] + (
        b"-----END CERTIFICATE-----\n"
    )


def test_dane_ee_match_delivers_verified(settings, dns_settings, peer, smtp_port, ca, tmp_path):
    publish(dns_settings, smtp_port, (3, 1, 1, spki_sha256(issued_leaf(ca, tmp_path))))
    (res,) = run_round(settings, dns_settings, smtp_port).results
    assert res.outcome == "delivered", res.text
    assert (res.tls_verified, res.tls_policy) == ("dane", "dane")
    assert dns_settings.queried(f"_{smtp_port}._tcp.{MX}", "TLSA")


def test_dane_ta_match_delivers(settings, dns_settings, peer, smtp_port, ca):
    publish(dns_settings, smtp_port, (2, 1, 1, spki_sha256(ca.cert_pem.bytes())))
    (res,) = run_round(settings, dns_settings, smtp_port).results
    assert res.outcome == "delivered", res.text
    assert res.tls_verified == "dane"


def test_dane_mismatch_is_deferred_and_never_cleartext(settings, dns_settings, peer, smtp_port):
    publish(dns_settings, smtp_port, (3, 1, 1, b"\x01" * 32))
    batch = run_round(settings, dns_settings, smtp_port)
    (res,) = batch.results
    assert (res.outcome, res.enhanced) == ("deferred", "4.7.5")
    assert "no TLSA record" in res.text and "matches" in res.text
    assert batch.host_failures[-1].error == "tls_required"
    assert peer.wait_idle()
    assert peer.connections == 1 and not peer.messages and "MAIL" not in peer.verbs()


def test_tlsa_without_the_ad_bit_is_ignored_dane_falls_back_to_may(
    settings, dns_settings, peer, smtp_port
):
    publish(dns_settings, smtp_port, (3, 1, 1, b"\x01" * 32), authentic=False)
    (res,) = run_round(settings, dns_settings, smtp_port).results
    assert res.outcome == "delivered", res.text
    assert (res.tls_verified, res.tls_policy) == ("none", "dane")
    assert res.tls_version  # opportunistic TLS still used


def test_dane_only_without_usable_tlsa_does_not_connect(settings, dns_settings, peer, smtp_port):
    # Usage 1 (PKIX-EE) is unusable for SMTP (RFC 7672 §3.1.3).
    publish(dns_settings, smtp_port, (1, 1, 1, b"\x01" * 32))
    (res,) = run_round(settings, dns_settings, smtp_port, "dane-only").results
    assert (res.outcome, res.enhanced) == ("deferred", "4.7.5")
    assert "no usable DNSSEC-validated TLSA record" in res.text
    assert peer.connections == 0
