"""MTA-STS (RFC 8461): the policy from a loopback HTTPS server found through
the DNS fixture, cached in the database, enforced against real peers."""

from __future__ import annotations

import asyncio
import ssl
import threading
from collections.abc import Iterator
from datetime import timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import trustme

from delivery import mta_sts
from delivery.smtp_client import deliver
from delivery.tls_policy import plan
from delivery.types import BatchResult, NextHop
from queues import clock
from queues.models import MtaStsPolicy
from tests.test_smtp_client import A, Target, config, message
from tests.test_tls_policy import certificate

DOMAIN = "sts.test"
MX = f"mx.{DOMAIN}"
POLICY = "version: STSv1\nmode: {mode}\nmx: {mx}\nmax_age: 86400\n"


class PolicyServer:
    """HTTPS on 127.0.0.1 serving ``text`` at /.well-known/mta-sts.txt."""

    def __init__(self, cert: Path, key: Path) -> None:
        self.text = ""
        self.requests: list[str] = []
        owner = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 - http.server's name
                owner.requests.append(f"{self.headers['Host']}{self.path}")
                body = owner.text.encode()
                status = 200 if self.path == mta_sts.WELL_KNOWN else 404
                self.send_response(status)
                self.send_header("Content-Type", "text/plain")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args) -> None:
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.load_cert_chain(cert, key)
        self.httpd.socket = ctx.wrap_socket(self.httpd.socket, server_side=True)
        self.port = self.httpd.server_address[1]
        self.thread = threading.Thread(target=self.httpd.serve_forever, args=(0.05,), daemon=True)
        self.thread.start()

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture(scope="module")
def ca() -> trustme.CA:
    return trustme.CA()


@pytest.fixture
def sts(ca, tmp_path, settings, dns_settings) -> Iterator[PolicyServer]:
    """The policy server, its name in DNS, and the relay trusting the test CA."""
    server = PolicyServer(*certificate(ca, tmp_path, f"mta-sts.{DOMAIN}"))
    ca_file = tmp_path / "ca.pem"
    ca.cert_pem.write_to_path(str(ca_file))
    settings.MAILRELAY_TLS_CA_FILE = str(ca_file)
    settings.MAILRELAY_MTA_STS_PORT = server.port
    settings.MAILRELAY_MTA_STS = True
    settings.MAILRELAY_TLS_POLICY = ""
    dns_settings.a(f"mta-sts.{DOMAIN}", "127.0.0.1")
    try:
        yield server
    finally:
        server.stop()


def publish(dns, server: PolicyServer, policy_id: str, mode: str, mx: str) -> None:
    dns.txt(f"_mta-sts.{DOMAIN}", f"v=STSv1; id={policy_id};")
    server.text = POLICY.format(mode=mode, mx=mx)


def run_round(port: int) -> tuple[BatchResult, list[str]]:
    target = Target(MX, A, port)
    rnd = plan([NextHop(MX, port)], True, [DOMAIN], [target], clock.now())
    batch = asyncio.run(deliver([target], [message(f"rcpt@{DOMAIN}")], config(tls_for=rnd.tls_for)))
    return batch, rnd.reports


def test_policy_parsing_and_mx_patterns():
    p = mta_sts.parse_policy(DOMAIN, "a1", POLICY.format(mode="enforce", mx="*.sts.test"))
    assert (p.mode, p.mx, p.max_age) == ("enforce", ("*.sts.test",), 86400)
    assert p.mx_matches("mx.sts.test") and not p.mx_matches("a.mx.sts.test")
    assert not p.mx_matches("sts.test")
    assert mta_sts.parse_txt(["v=STSv1; id=2024-01-01;"]) is None  # id: letters, digits
    assert mta_sts.parse_txt(["v=STSv1; id=abc123"]) == "abc123"
    assert mta_sts.parse_txt(["v=STSv1; id=a", "v=STSv1; id=b"]) is None
    with pytest.raises(mta_sts.PolicyError):
        mta_sts.parse_policy(DOMAIN, "a1", "version: STSv1\nmode: enforce\nmax_age: 1\n")


@pytest.mark.django_db
def test_enforce_with_a_matching_mx_delivers_verified(
    sts, dns_settings, sink_factory, ca, tmp_path, smtp_port
):
    sink = sink_factory(A, tls=True, certificate=certificate(ca, tmp_path, MX))
    publish(dns_settings, sts, "id1", "enforce", f"*.{DOMAIN}")
    batch, _ = run_round(smtp_port)
    (res,) = batch.results
    assert res.outcome == "delivered", res.text
    assert (res.tls_verified, res.tls_policy) == ("mta-sts", "mta-sts")
    assert sts.requests == [f"mta-sts.{DOMAIN}{mta_sts.WELL_KNOWN}"]
    row = MtaStsPolicy.objects.get(domain=DOMAIN)
    assert (row.policy_id, row.mode, row.mx, row.max_age) == (
        "id1",
        "enforce",
        ["*.sts.test"],
        86400,
    )
    assert row.expires_at - row.fetched_at == timedelta(days=1)
    # cached: the same id is not fetched again; a new id is
    run_round(smtp_port)
    assert len(sts.requests) == 1
    publish(dns_settings, sts, "id2", "enforce", f"*.{DOMAIN}")
    run_round(smtp_port)
    assert len(sts.requests) == 2
    assert MtaStsPolicy.objects.get(domain=DOMAIN).policy_id == "id2"
    assert len(sink.messages) == 3


@pytest.mark.django_db
def test_enforce_with_a_mismatching_mx_is_deferred(
    sts, dns_settings, sink_factory, ca, tmp_path, smtp_port
):
    sink = sink_factory(A, tls=True, certificate=certificate(ca, tmp_path, MX))
    publish(dns_settings, sts, "id1", "enforce", "mail.other.test")
    batch, _ = run_round(smtp_port)
    (res,) = batch.results
    assert (res.outcome, res.enhanced) == ("deferred", "4.7.5")
    assert f"MX host {MX} does not match the MTA-STS policy of {DOMAIN}" in res.text
    assert sink.connections == 0


@pytest.mark.django_db
def test_enforce_with_a_certificate_that_does_not_verify_is_deferred(
    sts, dns_settings, sink_factory, tmp_path, smtp_port
):
    sink = sink_factory(A, tls=True, certificate=certificate(trustme.CA(), tmp_path, MX))
    publish(dns_settings, sts, "id1", "enforce", MX)
    (res,) = run_round(smtp_port)[0].results
    assert (res.outcome, res.enhanced) == ("deferred", "4.7.5")
    assert "TLS required (mta-sts)" in res.text
    assert sink.wait_idle()
    assert not sink.messages and "MAIL" not in sink.verbs()


@pytest.mark.django_db
def test_testing_mode_delivers_and_reports(sts, dns_settings, sink_factory, smtp_port):
    sink = sink_factory(A)  # no TLS at all
    publish(dns_settings, sts, "id1", "testing", "mail.other.test")
    batch, reports = run_round(smtp_port)
    assert batch.results[0].outcome == "delivered"
    assert reports and "delivered anyway" in reports[0]
    assert batch.results[0].tls_report == f"{MX} offered no STARTTLS"
    assert len(sink.messages) == 1


@pytest.mark.django_db
def test_no_record_or_a_failed_fetch_means_no_policy(sts, dns_settings, sink_factory, smtp_port):
    sink = sink_factory(A)
    (res,) = run_round(smtp_port)[0].results  # no _mta-sts TXT
    assert res.outcome == "delivered" and res.tls_policy == "may"
    dns_settings.txt(f"_mta-sts.{DOMAIN}", "v=STSv1; id=id9;")
    sts.text = "not a policy"
    (res,) = run_round(smtp_port)[0].results
    assert res.outcome == "delivered"
    assert not MtaStsPolicy.objects.filter(domain=DOMAIN).exists()
    assert len(sink.messages) == 2


@pytest.mark.django_db
def test_testing_mode_failures_become_events_before_the_round(sts, dns_settings, smtp_port):
    from delivery.deliver import _with_tls
    from delivery.routing import DNS_MX
    from queues.models import Event, Link
    from tests.test_smtp_client import config as client_config

    hop = NextHop(MX, smtp_port)
    link = Link.objects.create(
        name=f"{MX}:{smtp_port}",
        delivery_type=DNS_MX,
        hosts=[hop.as_json()],
        created_at=clock.now(),
    )
    publish(dns_settings, sts, "id1", "testing", "mail.other.test")
    planned = _with_tls(
        link, [hop], [message(f"rcpt@{DOMAIN}")], [Target(MX, A, smtp_port)], client_config()
    )
    assert planned.tls_for(Target(MX, A, smtp_port)).level == "may"
    (event,) = Event.objects.filter(kind="mta_sts")
    assert event.level == "warning" and f"MX host {MX} does not match" in event.text


@pytest.mark.django_db
@pytest.mark.parametrize("trusted", [True, False])
def test_testing_mode_checks_tls_after_the_fact(
    sts, dns_settings, sink_factory, ca, tmp_path, smtp_port, trusted
):
    from delivery.deliver import _report_tls
    from queues.models import Event

    issuer = ca if trusted else trustme.CA()
    sink = sink_factory(A, tls=True, certificate=certificate(issuer, tmp_path, MX))
    publish(dns_settings, sts, "id1", "testing", MX)
    batch, reports = run_round(smtp_port)
    (res,) = batch.results
    assert res.outcome == "delivered" and sink.messages[0].tls and not reports
    _report_tls(batch)
    events = list(Event.objects.filter(kind="mta_sts").values_list("text", flat=True))
    if trusted:
        assert (res.tls_verified, res.tls_report, events) == ("mta-sts", "", [])
    else:
        assert res.tls_verified == "none"
        assert f"certificate of {MX} does not verify" in res.tls_report
        assert len(events) == 1 and "delivered anyway" in events[0]
