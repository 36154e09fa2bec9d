"""Outbound TLS policy levels (delivery.smtp.tls) against real peers on loopback.

Peers present certificates issued by a trustme CA made here; ``verify``
trusts that CA through ``TlsRequirement.ca_file`` (MAILRELAY_TLS_CA_FILE).
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import trustme
from django.core.exceptions import ImproperlyConfigured

from delivery.checks import validate_routing_settings
from delivery.route.routing import NextHop
from delivery.smtp.client import deliver, level_for, plan, requirement
from delivery.smtp.tls import MAY, TlsRequirement, parse_policy
from delivery.smtp.types import BatchResult
from tests.test_smtp_client import A, Target, config, message

MX = "mx.secure.test"


@pytest.fixture(scope="module")
def ca() -> trustme.CA:
    return trustme.CA()


@pytest.fixture
def ca_file(ca: trustme.CA, tmp_path: Path) -> str:
    path = tmp_path / "ca.pem"
    ca.cert_pem.write_to_path(str(path))
    return str(path)


def certificate(ca: trustme.CA, directory: Path, name: str) -> tuple[Path, Path]:
    """A certificate for ``name`` issued by ``ca``; the chain sent ends with the
    CA itself (DANE-TA needs the anchor in the chain, RFC 7672 §3.1.2)."""
    issued = ca.issue_cert(name)
    cert, key = directory / f"{name}.pem", directory / f"{name}.key"
    pems = [p.bytes() for p in issued.cert_chain_pems] + [ca.cert_pem.bytes()]
    cert.write_bytes(b"".join(pems))
    issued.private_key_pem.write_to_path(str(key))
    return cert, key


def send(port: int, req: TlsRequirement, host: str = MX) -> tuple[BatchResult, object]:
    msg = message("rcpt@secure.test")
    cfg = config(tls_for=lambda _peer: req)
    return asyncio.run(deliver([Target(host, A, port)], [msg], cfg)), msg


# --- the policy file --------------------------------------------------------------


def test_policy_file_lines_and_levels():
    table = parse_policy(
        "# comment\n"
        "example.com   verify\n"
        ".example.com  encrypt   # subdomains\n"
        "[10.0.0.5]:2525 none\n"
        "\n"
        "Partner.NET. dane-only\n"
    )
    assert table == {
        "example.com": "verify",
        ".example.com": "encrypt",
        "[10.0.0.5]:2525": "none",
        "partner.net": "dane-only",
    }
    assert level_for(table, ["example.com"], []) == "verify"
    assert level_for(table, ["a.b.example.com"], []) == "encrypt"
    assert level_for(table, ["other.org"], ["[10.0.0.5]:2525"]) == "none"
    assert level_for(table, ["other.org"], []) is None
    # several destinations in one round: the strictest wins
    assert level_for(table, ["example.com", "partner.net"], []) == "dane-only"


def test_bad_policy_line_stops_start_up_naming_the_line(settings, tmp_path):
    path = tmp_path / "tls_policy"
    path.write_text("example.com verify\nexample.org sometimes\n")
    settings.MAILRELAY_TLS_POLICY = str(path)
    with pytest.raises(ImproperlyConfigured, match=r"MAILRELAY_TLS_POLICY: line 2: unknown level"):
        validate_routing_settings()
    path.write_text("example.com verify\n")
    validate_routing_settings()
    settings.MAILRELAY_TLS_DEFAULT_LEVEL = "maybe"
    with pytest.raises(ImproperlyConfigured, match="MAILRELAY_TLS_DEFAULT_LEVEL"):
        validate_routing_settings()


def test_plan_applies_the_file_to_the_round(settings, tmp_path, ca_file):
    path = tmp_path / "tls_policy"
    path.write_text(".secure.test verify\n[10.9.9.9]:2525 encrypt\n")
    settings.MAILRELAY_TLS_POLICY = str(path)
    settings.MAILRELAY_TLS_CA_FILE = ca_file
    settings.MAILRELAY_MTA_STS = False
    target = Target(MX, A, 25)
    rnd = plan([NextHop(MX, 25)], True, ["a.secure.test"], [target], None)
    assert rnd.tls_for(target) == TlsRequirement("verify", True, "ca", ca_file=ca_file)
    hop = NextHop("10.9.9.9", 2525, literal=True)
    rnd = plan([hop], False, ["x.org"], [Target("10.9.9.9", "10.9.9.9", 2525)], None)
    assert rnd.default.level == "encrypt" and rnd.default.require
    rnd = plan([NextHop("mx.x.org", 25)], False, ["x.org"], [], None)
    assert rnd.default == MAY


# --- levels against real peers ----------------------------------------------------


def test_verify_delivers_over_a_verified_session(sink_factory, smtp_port, ca, ca_file, tmp_path):
    sink = sink_factory(A, tls=True, certificate=certificate(ca, tmp_path, MX))
    batch, _ = send(smtp_port, requirement("verify", ca_file))
    (res,) = batch.results
    assert res.outcome == "delivered", res.text
    assert res.tls_version.startswith("TLSv1") and res.tls_cipher
    assert (res.tls_verified, res.tls_policy) == ("ca", "verify")
    assert sink.messages[0].tls


def test_verify_with_a_mismatching_certificate_is_deferred_never_cleartext(
    sink_factory, smtp_port, ca, ca_file, tmp_path
):
    sink = sink_factory(A, tls=True, certificate=certificate(ca, tmp_path, "other.test"))
    batch, _ = send(smtp_port, requirement("verify", ca_file))
    (res,) = batch.results
    assert (res.outcome, res.scope, res.enhanced) == ("deferred", "connection", "4.7.5")
    assert "TLS required (verify)" in res.text and "certificate" in res.text.lower()
    assert res.tls_policy == "verify"
    assert batch.host_failures[-1].error == "tls_required"
    # one connection, and no transaction in cleartext, ever
    assert sink.wait_idle()
    assert sink.connections == 1
    assert not sink.messages and "MAIL" not in sink.verbs()


def test_verify_with_an_untrusted_ca_is_deferred(sink_factory, smtp_port, tmp_path, ca_file):
    other = trustme.CA()
    sink_factory(A, tls=True, certificate=certificate(other, tmp_path, MX))
    batch, _ = send(smtp_port, requirement("verify", ca_file))
    assert batch.results[0].enhanced == "4.7.5"


def test_encrypt_to_a_peer_without_starttls_is_deferred(sink_factory, smtp_port):
    sink = sink_factory(A)  # no STARTTLS offered
    batch, _ = send(smtp_port, requirement("encrypt"))
    (res,) = batch.results
    assert (res.outcome, res.enhanced) == ("deferred", "4.7.5")
    assert f"TLS required (encrypt) but not offered by {MX}" in res.text
    assert sink.wait_idle()
    assert sink.connections == 1 and not sink.messages and "MAIL" not in sink.verbs()


def test_encrypt_with_a_broken_handshake_never_falls_back(sink_factory, smtp_port):
    sink = sink_factory(A, tls_broken=True)
    batch, _ = send(smtp_port, requirement("encrypt"))
    assert batch.results[0].enhanced == "4.7.5"
    assert sink.wait_idle()
    assert sink.connections == 1 and not sink.messages


def test_encrypt_accepts_any_certificate(sink_factory, smtp_port):
    sink = sink_factory(A, tls=True)  # self-signed by an unknown CA, wrong name
    batch, _ = send(smtp_port, requirement("encrypt"))
    res = batch.results[0]
    assert res.outcome == "delivered" and res.tls_verified == "none"
    assert sink.messages[0].tls


def test_none_never_starts_tls(sink_factory, smtp_port):
    sink = sink_factory(A, tls=True)
    batch, _ = send(smtp_port, requirement("none"))
    res = batch.results[0]
    assert res.outcome == "delivered" and res.tls_version == "" and res.tls_policy == "none"
    assert not sink.messages[0].tls and "STARTTLS" not in sink.verbs()


def test_may_still_falls_back_to_cleartext(sink_factory, smtp_port):
    sink = sink_factory(A, tls_broken=True)
    batch, _ = send(smtp_port, requirement("may"))
    assert batch.results[0].outcome == "delivered"
    assert sink.messages and not sink.messages[0].tls


# --- through the engine: attempts and the link record the TLS -------------------------


@pytest.fixture
def relay(dns_settings, settings, smtp_port, tmp_path, ca_file):
    from datetime import timedelta

    settings.MAILRELAY_REMOTE_SMTP_PORT = smtp_port
    settings.MAILRELAY_SMTP_CONNECT_TIMEOUT = timedelta(seconds=2)
    settings.MAILRELAY_SMTP_CLIENT_TIMEOUT = timedelta(seconds=5)
    settings.MAILRELAY_TLS_CA_FILE = ca_file
    policy = tmp_path / "tls_policy"
    policy.write_text("example.net verify\n")
    settings.MAILRELAY_TLS_POLICY = str(policy)
    dns_settings.mx("example.net", [(10, "mx1.example.net")])
    dns_settings.a("mx1.example.net", A)
    return dns_settings


@pytest.mark.django_db
@pytest.mark.parametrize("name", ["mx1.example.net", "wrong.example.net"])
def test_engine_records_tls_per_attempt_and_link(relay, sink_factory, ca, tmp_path, name, client):
    from queues.models import Attempt, Link, Queue, Recipient
    from tests.support.browser import make_user
    from tests.support.pipeline import drain
    from tests.test_pipeline import accept

    sink = sink_factory(A, tls=True, certificate=certificate(ca, tmp_path, name))
    message = accept("u@example.net")
    drain()
    attempt = Attempt.objects.get()
    link = Link.objects.get(name__contains="mx1.example.net")
    assert attempt.tls_policy == "verify"
    if name.startswith("mx1"):
        assert attempt.outcome == "delivered"
        assert attempt.tls_version.startswith("TLSv1") and attempt.tls_cipher
        assert attempt.tls_verified == "ca"
        assert link.last_tls.startswith("TLSv1") and "verified (ca), policy verify" in link.last_tls
        assert sink.messages[0].tls
        # the message detail shows each attempt's TLS, the queue list each link's
        client.force_login(make_user("victor", "viewer"))
        detail = client.get(f"/messages/{message.pk}/").content.decode()
        assert f"{attempt.tls_version} · verified (ca)" in detail and "policy verify" in detail
        assert f"TLS: {link.last_tls}" in client.get("/queues/").content.decode()
        # and the REST API says the same of each attempt
        api = client.get(f"/api/v1/messages/{message.pk}/").json()["attempts"]
        assert [
            {k: a[k] for k in ("tls_version", "tls_cipher", "tls_verified", "tls_policy")}
            for a in api
        ] == [
            {
                "tls_version": attempt.tls_version,
                "tls_cipher": attempt.tls_cipher,
                "tls_verified": "ca",
                "tls_policy": "verify",
            }
        ]
        assert api[0]["auth_used"] == ""
    else:
        assert (attempt.outcome, attempt.enhanced) == ("deferred", "4.7.5")
        assert Recipient.objects.get().state == "deferred"
        # visible on the queue (the peer answered, so the link itself is not failing)
        assert "TLS required (verify)" in Queue.objects.get(name="example.net").last_error
        assert link.last_tls == "no session, policy verify"
        assert not sink.messages


def test_a_next_hop_is_found_as_written_before_its_mx_lookup(settings, tmp_path):
    # relay.partner.test is looked up for MX: the link holds mx1.partner.test
    settings.MAILRELAY_TRANSPORTS = "partner.test=relay.partner.test:587"
    settings.MAILRELAY_SMART_HOST = ""
    path = tmp_path / "tls_policy"
    path.write_text("relay.partner.test:587 encrypt\n")
    settings.MAILRELAY_TLS_POLICY = str(path)
    target = Target("mx1.partner.test", A, 587)
    rnd = plan([NextHop("mx1.partner.test", 587)], False, ["partner.test"], [target], None)
    assert rnd.tls_for(target).level == "encrypt"
