"""MTA-STS (RFC 8461): the policy from a loopback HTTPS server found through
the DNS fixture, cached in the database, enforced against real peers."""

from __future__ import annotations

import asyncio
import ssl
import threading
import time
from collections.abc import Iterator
from datetime import timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from ipaddress import ip_address
from pathlib import Path

import pytest
import trustme

from delivery.route.dns import make_resolver
from delivery.route.routing import NextHop
from delivery.smtp import https_fetch, mta_sts
from delivery.smtp.client import deliver, plan
from delivery.smtp.types import BatchResult
from queues.lib import clock, seconds
from queues.models import MtaStsPolicy
from tests.test_smtp_client import A, Target, config, message
from tests.test_tls_policy import certificate

DOMAIN = "sts.test"
MX = f"mx.{DOMAIN}"
POLICY = "version: STSv1\nmode: {mode}\nmx: {mx}\nmax_age: 86400\n"


class PolicyServer:
    """HTTPS on 127.0.0.1 serving ``text`` at /.well-known/mta-sts.txt; or, when
    ``raw`` is set, those bytes as the whole response, ``piece`` bytes every
    ``pace`` seconds (a hostile server trickling its answer)."""

    def __init__(self, cert: Path, key: Path) -> None:
        self.text = ""
        self.raw: bytes | None = None
        self.piece, self.pace = 65536, 0.0
        self.requests: list[str] = []
        owner = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 - http.server's name
                owner.requests.append(f"{self.headers['Host']}{self.path}")
                if owner.raw is not None:
                    self.trickle(owner.raw)
                    return
                body = owner.text.encode()
                status = 200 if self.path == mta_sts.WELL_KNOWN else 404
                self.send_response(status)
                self.send_header("Content-Type", "text/plain")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def trickle(self, data: bytes) -> None:
                self.close_connection = True
                try:
                    for i in range(0, len(data), owner.piece):
                        self.wfile.write(data[i : i + owner.piece])
                        time.sleep(owner.pace)
                except OSError:
                    pass  # the client hung up: what a cut fetch does

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
    settings.MAILRELAY_MTA_STS_ALLOW_PRIVATE = True  # the policy server is on loopback
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
    from delivery.route.routing import DNS_MX
    from delivery.smtp.deliver import _with_tls
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
    from delivery.smtp.deliver import _report_tls
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


# --- a hostile policy server (issue #20) ---------------------------------------------


def http_response(body: bytes, *headers: bytes) -> bytes:
    head = [b"HTTP/1.1 200 OK", b"Content-Type: text/plain", *headers]
    return b"\r\n".join(head) + b"\r\n\r\n" + body


def sized(text: str) -> bytes:
    body = text.encode()
    return http_response(body, b"Content-Length: %d" % len(body))


@pytest.mark.django_db
def test_a_trickling_policy_server_is_cut_at_the_fetch_deadline(
    sts, dns_settings, sink_factory, smtp_port, settings
):
    """Every few bytes come well within the timeout, the whole answer would take
    about 6 s: the fetch ends at its deadline (1 s) and the round goes on without
    the policy (which would have deferred it)."""
    settings.MAILRELAY_MTA_STS_FETCH_TIMEOUT = timedelta(seconds=1)
    sink = sink_factory(A)
    publish(dns_settings, sts, "id1", "enforce", "mail.other.test")
    sts.raw = sized(sts.text).replace(b"\r\n\r\n", b"\r\nX-Pad: " + b"a" * 100 + b"\r\n\r\n")
    sts.piece, sts.pace = 4, 0.1
    started = time.monotonic()
    (res,) = run_round(smtp_port)[0].results
    assert time.monotonic() - started < 2.5
    assert res.outcome == "delivered", res.text
    assert not MtaStsPolicy.objects.exists()
    assert len(sts.requests) == 1 and len(sink.messages) == 1


@pytest.mark.django_db
def test_the_headers_of_a_policy_response_are_capped(sts, dns_settings):
    """Each line is under http.client's 64 KiB line limit; together they are far
    more than any policy server sends."""
    publish(dns_settings, sts, "id1", "enforce", MX)
    pads = [b"X-Pad-%d: %s" % (i, b"a" * 30_000) for i in range(4)]
    sts.raw = sized(sts.text).replace(b"\r\n\r\n", b"\r\n" + b"\r\n".join(pads) + b"\r\n\r\n")
    with pytest.raises(mta_sts.PolicyError, match="headers larger than"):
        mta_sts.fetch_text(make_resolver(), DOMAIN)


@pytest.mark.django_db
def test_the_body_of_a_policy_response_is_capped_with_its_framing(sts, dns_settings):
    """A 70-byte policy sent one byte per chunk, each chunk-size line padded with
    a 20 KB extension: 1.4 MB on the wire for a small policy."""
    publish(dns_settings, sts, "id1", "enforce", MX)
    ext = b";x=" + b"a" * 20_000
    chunks = b"".join(b"1%s\r\n%s\r\n" % (ext, bytes([c])) for c in sts.text.encode())
    sts.raw = http_response(chunks + b"0\r\n\r\n", b"Transfer-Encoding: chunked")
    with pytest.raises(mta_sts.PolicyError, match="larger than"):
        mta_sts.fetch_text(make_resolver(), DOMAIN)
    # the same policy in a few plain chunks is read
    plain = b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in sts.text.encode().split(b"\n"))
    sts.raw = http_response(plain + b"0\r\n\r\n", b"Transfer-Encoding: chunked")
    assert mta_sts.fetch_text(make_resolver(), DOMAIN) == sts.text.replace("\n", "")


@pytest.mark.django_db
@pytest.mark.parametrize(
    ("qtype", "address"),
    [
        ("A", "127.0.0.1"),
        ("A", "169.254.169.254"),
        ("A", "10.1.2.3"),
        ("AAAA", "::ffff:7f00:1"),  # 127.0.0.1, IPv4-mapped
        ("AAAA", "64:ff9b::a9fe:a9fe"),  # 169.254.169.254 through NAT64
    ],
)
def test_a_policy_host_on_a_non_public_address_is_not_fetched(
    sts, dns_settings, sink_factory, smtp_port, settings, qtype, address
):
    """mta-sts.<domain> may point anywhere: by default the relay fetches only from
    public addresses (no request to itself, its network, or a metadata service)."""
    settings.MAILRELAY_MTA_STS_ALLOW_PRIVATE = False
    settings.MAILRELAY_MTA_STS_FETCH_TIMEOUT = timedelta(seconds=1)
    host = f"mta-sts.{DOMAIN}"
    dns_settings.remove(host)
    getattr(dns_settings, qtype.lower())(host, address)
    sink = sink_factory(A)
    publish(dns_settings, sts, "id1", "enforce", "mail.other.test")
    with pytest.raises(mta_sts.PolicyError, match=f"{address} is not a public address"):
        mta_sts.fetch_text(make_resolver(), DOMAIN)
    (res,) = run_round(smtp_port)[0].results
    assert res.outcome == "delivered", res.text
    assert sts.requests == [] and len(sink.messages) == 1


@pytest.mark.parametrize(
    "address",
    [
        "127.0.0.1",
        "10.0.0.1",
        "172.16.0.1",
        "192.168.1.1",
        "100.64.0.1",
        "169.254.169.254",
        "0.0.0.0",
        "224.0.0.1",
        "239.255.255.250",
        "255.255.255.255",
        "::",
        "::1",
        "fe80::1",
        "fd00::1",
        "ff02::1",
        "ff0e::1",
        "::ffff:127.0.0.1",
        "::ffff:169.254.169.254",
        "64:ff9b::a9fe:a9fe",
        "64:ff9b::7f00:1",
        "64:ff9b:1::808:808",
        "2002:7f00:1::1",
        "2002:a9fe:a9fe::1",
        "::7f00:1",
        "2001:db8::1",
    ],
)
def test_non_public_addresses(address):
    assert not https_fetch.is_public(ip_address(address))


@pytest.mark.parametrize(
    "address",
    ["8.8.8.8", "2001:4860:4860::8888", "::ffff:8.8.8.8", "64:ff9b::808:808", "2002:808:808::1"],
)
def test_public_addresses(address):
    assert https_fetch.is_public(ip_address(address))


@pytest.mark.django_db(transaction=True)
def test_a_slow_policy_fetch_does_not_outlive_the_round_claim(
    sts, dns_settings, sink_factory, smtp_port, settings
):
    """The policy server trickles a good answer over about 2 s (within the
    default fetch timeout); the lease is 0.6 s. The owner renews while it waits
    for the fetch, so the sweep takes nothing back, a second delivery task finds
    the link held, and the message goes once."""
    from delivery.qmgr.sweep import reclaim
    from delivery.qmgr.tasks import categorize_pending
    from delivery.smtp.deliver import deliver_link
    from queues.accept import IncomingEnvelope, IncomingRecipient, message_accept
    from queues.models import Attempt, Link, Recipient, RecipientState

    assert seconds(settings.MAILRELAY_MTA_STS_FETCH_TIMEOUT) >= 3
    settings.MAILRELAY_DELIVERY_LEASE = timedelta(seconds=0.6)
    settings.MAILRELAY_REMOTE_SMTP_PORT = smtp_port
    dns_settings.mx(DOMAIN, [(10, MX)])
    dns_settings.a(MX, A)
    sink = sink_factory(A)
    publish(dns_settings, sts, "id1", "testing", MX)
    sts.raw = sized(sts.text)
    sts.piece, sts.pace = 8, 2.0 / (len(sts.raw) / 8)
    envelope = IncomingEnvelope(
        mail_from="a@example.org",
        recipients=[IncomingRecipient(f"rcpt@{DOMAIN}")],
        client_address="127.0.0.1",
        client_helo="client.test",
    )
    message_accept(envelope, b"From: a@example.org\r\nSubject: t\r\n\r\nbody\r\n")
    while categorize_pending():
        pass
    link = Link.objects.get()
    stop = threading.Event()
    reclaimed: list[int] = []
    second: list[int] = []

    def sweeper() -> None:
        from django.db import connection

        try:
            while not stop.is_set():
                reclaimed.append(reclaim().recipients_reclaimed)
                time.sleep(0.1)
        finally:
            connection.close()

    def second_task() -> None:
        from django.db import connection

        try:
            time.sleep(1.0)  # the first owner's lease would have run out by now
            second.append(deliver_link(link.pk, "second-task"))
        finally:
            connection.close()

    threads = [threading.Thread(target=sweeper), threading.Thread(target=second_task)]
    for thread in threads:
        thread.start()
    try:
        started = time.monotonic()
        assert deliver_link(link.pk, "first-task") == 1
        assert time.monotonic() - started > 1.5  # the fetch outlived the lease
    finally:
        stop.set()
        for thread in threads:
            thread.join()
    assert len(sink.messages) == 1
    assert sum(reclaimed) == 0 and second == [0]
    assert list(Recipient.objects.values_list("state", flat=True)) == [RecipientState.DELIVERED]
    assert Attempt.objects.count() == 1
    assert MtaStsPolicy.objects.get(domain=DOMAIN).policy_id == "id1"
