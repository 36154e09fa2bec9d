"""AUTH to a next hop (delivery.smtp.auth; its credentials: delivery.smtp.client.load_auth) and
implicit TLS on port 465, against real aiosmtpd peers on loopback."""

from __future__ import annotations

import asyncio

import pytest
import trustme
from django.core.exceptions import ImproperlyConfigured

from delivery.checks import validate_routing_settings
from delivery.route.routing import NextHop
from delivery.smtp.client import deliver, load_auth, plan, requirement
from delivery.smtp.clientconfig import ClientConfig
from delivery.smtp.connection import IMPLICIT_TLS_PORT
from delivery.smtp.tls import Credentials, lookup_auth
from delivery.smtp.types import BatchResult
from tests.test_smtp_client import A, Target, config, message
from tests.test_tls_policy import certificate

HOP = "smtp.provider.test"
USERS = {"relay@example.com": "s3cret:with:colons"}
GOOD = Credentials("relay@example.com", "s3cret:with:colons")


def send(port: int, creds: Credentials | None, **kw) -> BatchResult:
    cfg = config(auth_for=lambda _peer: creds, **kw)
    return asyncio.run(deliver([Target(HOP, A, port)], [message("rcpt@far.test")], cfg))


def test_credentials_file(settings, tmp_path):
    path = tmp_path / "smtp_auth"
    path.write_text(
        "# next hop   user:password   flags\n"
        "[smtp.provider.test]:587  relay@example.com:s3cret:with:colons\n"
        "10.0.0.5 relay:pw allow-cleartext\n"
    )
    settings.MAILRELAY_SMTP_AUTH = str(path)
    table = load_auth()
    assert lookup_auth(table, ["[smtp.provider.test]:587"]) == GOOD
    assert lookup_auth(table, ["[10.0.0.5]:25", "10.0.0.5"]).allow_cleartext
    assert "s3cret" not in repr(table)  # never in logs
    # a mounted secret (MAILRELAY_SMTP_AUTH_FILE) gives the content itself
    settings.MAILRELAY_SMTP_AUTH = "[h]:25 u:p\nh2 u2:p2\n"
    assert set(load_auth()) == {"[h]:25", "h2"}
    # a bad line stops start-up, naming it
    path.write_text("[h]:25 u:p\nh2 nocolon\n")
    settings.MAILRELAY_SMTP_AUTH = str(path)
    with pytest.raises(ImproperlyConfigured, match="MAILRELAY_SMTP_AUTH: line 2"):
        validate_routing_settings()


def test_plan_finds_credentials_by_next_hop(settings, tmp_path):
    path = tmp_path / "smtp_auth"
    path.write_text(f"[{HOP}]:587 relay@example.com:s3cret:with:colons\n")
    settings.MAILRELAY_SMTP_AUTH = str(path)
    target = Target(HOP, A, 587)
    rnd = plan([NextHop(HOP, 587, literal=True)], False, ["far.test"], [target], None)
    assert rnd.auth_for(target) == GOOD
    assert rnd.auth_for(Target("other", A, 25)) is None


@pytest.fixture(scope="module")
def ca() -> trustme.CA:
    return trustme.CA()


@pytest.fixture
def verified(ca, tmp_path) -> dict:
    """A sink certificate for HOP from ``ca``, and the client's ``verify`` policy trusting it."""
    ca_file = tmp_path / "ca.pem"
    ca.cert_pem.write_to_path(str(ca_file))
    return {
        "certificate": certificate(ca, tmp_path, HOP),
        "tls_for": lambda _peer: requirement("verify", str(ca_file)),
    }


@pytest.mark.parametrize("mechanism", ["PLAIN", "LOGIN"])
def test_auth_over_starttls_to_a_hop_that_requires_it(sink_factory, smtp_port, mechanism, verified):
    sink = sink_factory(
        A,
        tls=True,
        auth=USERS,
        auth_required=True,
        auth_mechanisms=(mechanism,),
        certificate=verified["certificate"],
    )
    batch = send(smtp_port, GOOD, tls_for=verified["tls_for"])
    (res,) = batch.results
    assert res.outcome == "delivered", res.text
    assert res.auth_used == mechanism and res.tls_version and res.tls_verified == "ca"
    assert sink.auth_attempts == [(mechanism, "relay@example.com", True)]


@pytest.mark.parametrize("level", ["may", "encrypt"])
def test_credentials_are_not_sent_over_tls_that_is_not_verified(sink_factory, smtp_port, level):
    sink = sink_factory(A, tls=True, auth=USERS, auth_required=True)  # self-signed
    batch = send(smtp_port, GOOD, tls_for=lambda _peer: requirement(level))
    (res,) = batch.results
    assert (res.outcome, res.scope, res.enhanced) == ("deferred", "connection", "4.7.5")
    assert "refusing to send AUTH credentials" in res.text and "not verified" in res.text
    assert res.tls_version and res.tls_verified == "none"
    assert batch.host_failures[-1].error == "tls_required"
    assert sink.wait_idle()
    assert sink.auth_attempts == [] and not sink.messages


def test_the_operator_may_allow_credentials_over_unverified_tls(sink_factory, smtp_port):
    sink = sink_factory(A, tls=True, auth=USERS, auth_required=True)  # self-signed
    res = send(smtp_port, GOOD, auth_over_unverified_tls=True).results[0]
    assert res.outcome == "delivered", res.text
    assert (res.auth_used, res.tls_verified) == ("PLAIN", "none")
    assert sink.auth_attempts == [("PLAIN", "relay@example.com", True)]


def test_the_setting_reaches_the_client_config(settings):
    assert not ClientConfig.from_settings().auth_over_unverified_tls
    settings.MAILRELAY_SMTP_AUTH_ALLOW_UNVERIFIED_TLS = True
    assert ClientConfig.from_settings().auth_over_unverified_tls


def test_without_credentials_the_hop_refuses_mail(sink_factory, smtp_port):
    sink_factory(A, tls=True, auth=USERS, auth_required=True)
    res = send(smtp_port, None).results[0]
    assert res.code == 530 and res.auth_used == ""


def test_535_is_auth_failed_for_that_hop(sink_factory, smtp_port, verified):
    sink = sink_factory(A, tls=True, auth=USERS, auth_required=True, **verified_sink(verified))
    batch = send(smtp_port, Credentials("relay@example.com", "wrong"), tls_for=verified["tls_for"])
    (res,) = batch.results
    assert (res.outcome, res.scope, res.code) == ("deferred", "connection", 535)
    failure = batch.host_failures[-1]
    assert failure.error == "auth_failed"
    assert "(in reply to AUTH PLAIN)" in batch.connection_error
    assert sink.wait_idle()
    assert sink.connections == 1 and not sink.messages  # not tried again this round


def test_credentials_are_never_sent_in_cleartext(sink_factory, smtp_port):
    sink = sink_factory(A, auth=USERS, auth_require_tls=False)  # AUTH offered, no TLS
    batch = send(smtp_port, GOOD)
    (res,) = batch.results
    assert (res.outcome, res.enhanced) == ("deferred", "4.7.5")
    assert "refusing to send AUTH credentials" in res.text
    assert batch.host_failures[-1].error == "tls_required"
    assert sink.wait_idle()
    assert sink.auth_attempts == [] and not sink.messages


@pytest.mark.filterwarnings("ignore:Requiring AUTH while not requiring TLS")
def test_allow_cleartext_sends_them_anyway(sink_factory, smtp_port):
    sink = sink_factory(A, auth=USERS, auth_require_tls=False, auth_required=True)
    creds = Credentials(GOOD.username, GOOD.password, allow_cleartext=True)
    res = send(smtp_port, creds).results[0]
    assert res.outcome == "delivered" and res.auth_used == "PLAIN" and res.tls_version == ""
    assert len(sink.messages) == 1


@pytest.mark.filterwarnings("ignore:Requiring AUTH while not requiring TLS")
def test_implicit_tls_on_port_465(sink_factory, verified):
    host = "127.0.0.7"  # 465 on an address of its own: other tests use 127.0.0.1
    sink = sink_factory(
        host,
        IMPLICIT_TLS_PORT,
        implicit_tls=True,
        auth=USERS,
        auth_required=True,
        certificate=verified["certificate"],
    )
    cfg = config(auth_for=lambda _peer: GOOD, tls_for=verified["tls_for"])
    target = Target(HOP, host, IMPLICIT_TLS_PORT)
    batch = asyncio.run(deliver([target], [message("rcpt@far.test")], cfg))
    (res,) = batch.results
    assert res.outcome == "delivered", res.text
    assert res.tls_version.startswith("TLSv1") and res.auth_used == "PLAIN"
    assert "STARTTLS" not in sink.verbs()
    assert sink.messages[0].tls


def verified_sink(verified: dict) -> dict:
    return {"certificate": verified["certificate"]}


@pytest.mark.django_db
def test_535_is_visible_on_the_queue(dns_settings, settings, sink_factory, smtp_port, tmp_path):
    from queues.models import Attempt, Queue
    from tests.support.pipeline import drain
    from tests.test_pipeline import accept

    settings.MAILRELAY_SMART_HOST = f"[{A}]:{smtp_port}"
    path = tmp_path / "smtp_auth"
    path.write_text(f"[{A}]:{smtp_port} relay@example.com:wrong\n")
    settings.MAILRELAY_SMTP_AUTH = str(path)
    settings.MAILRELAY_SMTP_AUTH_ALLOW_UNVERIFIED_TLS = True  # the sink's certificate: self-signed
    sink_factory(A, tls=True, auth=USERS, auth_required=True)
    accept("u@far.test")
    drain()
    attempt = Attempt.objects.get()
    assert (attempt.outcome, attempt.code, attempt.enhanced) == ("deferred", 535, "5.7.8")
    assert attempt.text.startswith("authentication failed (auth_failed)")
    assert attempt.tls_version and attempt.auth_used == ""
    queue = Queue.objects.get(name="far.test")
    assert "auth_failed" in queue.last_error
