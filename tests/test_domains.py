"""One form of a domain (issue #9): normalised once at accept, used everywhere.

Unit tables for ``queues.lib``; the parsers that apply it at accept
(SMTP paths, pickup, replay) and the settings that are parsed with it; and
real parts: 553 at RCPT/MAIL over a socket, and a message for
``user@ｅｘａｍｐｌｅ.test`` from an untrusted client carried over SMTP,
categorized and delivered to the transport map's next hop (a real sink on
loopback), never to the smart host.
"""

from __future__ import annotations

import ipaddress
import os
import subprocess
import sys
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from django.core.exceptions import ImproperlyConfigured

from delivery.pickup.parse import BadFile, PickupLimits, parse_pickup, parse_replay
from delivery.smtpd import policy
from queues.accept import recipient_domain
from queues.lib import DomainError, domain_key, domain_keys, envelope_domain
from queues.models import DeliveryType, Message, RecipientState
from tests.support.pipeline import drain

ROOT = Path(__file__).resolve().parent.parent
NOW = datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC)

# --- the normaliser (pure) -------------------------------------------------------


@pytest.mark.parametrize(
    ("given", "key", "envelope"),
    [
        # ASCII: the key in lower case without the final dot; the envelope as given
        ("example.test", "example.test", "example.test"),
        ("Example.TEST", "example.test", "Example.TEST"),
        ("Example.TEST.", "example.test", "Example.TEST."),
        ("mail_host.corp.test", "mail_host.corp.test", "mail_host.corp.test"),
        ("ab--cd.test", "ab--cd.test", "ab--cd.test"),  # IDNA's hyphen rules: IDN labels only
        # full-width letters, digits and stops (UTS #46 mapping)
        ("ｅｘａｍｐｌｅ.test", "example.test", "example.test"),
        ("ＥＸＡＭＰＬＥ．ＴＥＳＴ", "example.test", "example.test"),
        ("ｍｘ１.example.test", "mx1.example.test", "mx1.example.test"),
        # ideographic full stop U+3002 and the half-width one U+FF61, also as the final dot
        ("example\u3002test", "example.test", "example.test"),
        ("example\uff61test\u3002", "example.test", "example.test"),
        # mixed case U-labels → A-labels (the envelope keeps U-labels, mapped)
        ("exämple.com", "xn--exmple-cua.com", "exämple.com"),
        ("EXÄMPLE.Com", "xn--exmple-cua.com", "exämple.com"),
        ("Bücher.DE.", "xn--bcher-kva.de", "bücher.de"),
        ("ｂüｃｈｅｒ。de", "xn--bcher-kva.de", "bücher.de"),
        ("fass.de", "fass.de", "fass.de"),
        ("faß.de", "xn--fa-hia.de", "faß.de"),  # non-transitional: ß stays ß
        ("ﬀ.test", "ff.test", "ff.test"),  # compatibility ligature
        ("a\u0308b.test", "xn--b-zfa.test", "äb.test"),  # NFC
        ("пример.испытание", "xn--e1afmkfd.xn--80akhbyknj4f", "пример.испытание"),
        # A-labels given as ASCII: checked, and lower-cased in the key
        ("xn--exmple-cua.com", "xn--exmple-cua.com", "xn--exmple-cua.com"),
        ("XN--EXMPLE-CUA.com", "xn--exmple-cua.com", "XN--EXMPLE-CUA.com"),
        # address literals are not names
        ("[192.0.2.1]", "[192.0.2.1]", "[192.0.2.1]"),
        ("[IPv6:2001:DB8::1]", "[ipv6:2001:db8::1]", "[IPv6:2001:DB8::1]"),
    ],
)
def test_a_domain_has_one_key_and_one_envelope_form(given, key, envelope):
    assert domain_key(given) == key
    assert envelope_domain(given) == envelope
    # idempotent: the forms are forms of themselves
    assert domain_key(envelope) == key
    assert domain_key(key) == key


def test_every_spelling_of_a_name_has_the_same_key():
    spellings = [
        "bücher.example",
        "BÜCHER.EXAMPLE",
        "ｂｕ\u0308ｃｈｅｒ\u3002ｅｘａｍｐｌｅ",
        "xn--bcher-kva.example.",
        "XN--BCHER-KVA.Example",
    ]
    assert {domain_key(s) for s in spellings} == {"xn--bcher-kva.example"}


@pytest.mark.parametrize(
    ("given", "why"),
    [
        ("", "empty"),
        (".", "empty"),
        ("a..test", "empty label"),
        ("\u3002example.test", "empty label"),  # a leading ideographic stop
        ("exa mple.test", "letters, digits and hyphens"),
        ("-example.test", "letters, digits and hyphens"),
        ("example-.test", "letters, digits and hyphens"),
        ("ex@mple.test", "letters, digits and hyphens"),
        ("-ü.test", "IDNA 2008"),  # leading hyphen in an IDN label
        ("ab--ü.test", "IDNA 2008"),  # hyphens in 3rd and 4th position
        ("☃.test", "IDNA 2008"),  # a symbol: not PVALID in IDNA 2008
        ("\u0308a.test", "IDNA 2008"),  # a leading combining mark
        ("a\u200db.test", "IDNA 2008"),  # ZWJ out of context
        ("\u2488.test", "not allowed"),  # ⒈ (UTS #46: disallowed)
        ("xn--zz.test", "IDNA 2008"),  # not Punycode
        ("xn--n3h.test", "IDNA 2008"),  # ☃ as an A-label
        ("xn--abc-.test", "IDNA 2008"),  # a fake A-label
        ("XN--Exmple-cua-.test", "IDNA 2008"),
        ("a" * 64 + ".test", "longer than 63"),
        ("ü" * 60 + ".test", "IDNA 2008"),  # its A-label is over 63 octets
        (".".join(["a" * 63] * 4) + ".test", "longer than 253"),
        (".".join(["ü" * 20] * 10), "longer than 253"),  # short in U-labels, not in A-labels
    ],
)
def test_a_domain_without_a_form_is_refused_saying_why(given, why):
    with pytest.raises(DomainError, match=why):
        domain_key(given)
    with pytest.raises(DomainError):
        envelope_domain(given)


def test_the_longest_names_still_have_a_form():
    name = ".".join(["a" * 63] * 3 + ["b" * 61])  # 253 octets
    assert domain_key(name) == name
    assert domain_key(name + ".") == name


def test_recipient_domain_is_the_routing_key_of_any_address():
    assert recipient_domain("victim@ｅｘａｍｐｌｅ.test") == "example.test"
    assert recipient_domain("B@Example.NET.") == "example.net"
    assert recipient_domain("jörg@EXÄMPLE.org") == "xn--exmple-cua.org"
    assert recipient_domain("u@[IPv6:2001:DB8::1]") == "[ipv6:2001:db8::1]"
    # no form: kept (lower case), for routing to refuse with 5.1.3
    assert recipient_domain("u@XN--ZZ.test") == "xn--zz.test"


def test_a_domain_list_setting_is_normalised_and_a_bad_entry_named():
    keys = domain_keys(
        "MAILRELAY_ACCEPTED_DOMAINS", ["ＥＸＡＭＰＬＥ.test", "example.TEST.", "Bücher.de"]
    )
    assert keys == ["example.test", "xn--bcher-kva.de"]
    with pytest.raises(ImproperlyConfigured, match=r"MAILRELAY_ACCEPTED_DOMAINS: 'xn--zz\.de'"):
        domain_keys("MAILRELAY_ACCEPTED_DOMAINS", ["example.test", "xn--zz.de"])


def _settings_process(accepted: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "MAILRELAY_ACCEPTED_DOMAINS": accepted}
    code = "from django.conf import settings; print(settings.MAILRELAY_ACCEPTED_DOMAINS)"
    return subprocess.run(
        [sys.executable, "-c", f"import django; django.setup(); {code}"],
        cwd=ROOT,
        env={**env, "DJANGO_SETTINGS_MODULE": "mailrelay.settings"},
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_the_settings_parse_accepted_domains_into_their_form():
    done = _settings_process("ＥＸＡＭＰＬＥ.test, Bücher.DE.")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "['example.test', 'xn--bcher-kva.de']"
    bad = _settings_process("example.test,☃.test")
    assert bad.returncode != 0
    assert "MAILRELAY_ACCEPTED_DOMAINS: '☃.test' is not a domain" in bad.stderr


# --- at accept: the parsers (pure) ---------------------------------------------


def test_rcpt_stores_the_local_part_as_given_and_the_domain_in_its_form():
    recipient, _ = policy.parse_rcpt(
        "<Vic.Tim@ｅｘａｍｐｌｅ\u3002ＴＥＳＴ>", extended=True, utf8=True
    )
    assert (recipient.local, recipient.domain) == ("Vic.Tim", "example.test")
    assert recipient.address == "Vic.Tim@example.test"
    assert recipient.domain_key == "example.test"
    sender, _ = policy.parse_mail("<Jörg@EXÄMPLE.org> SMTPUTF8", extended=True, max_size=0)
    assert sender is not None
    assert sender.address == "Jörg@exämple.org"
    assert sender.domain_key == "xn--exmple-cua.org"


def test_a_full_width_accepted_domain_passes_relay_control_in_its_one_form():
    accepted = frozenset(domain_keys("MAILRELAY_ACCEPTED_DOMAINS", ["example.test"]))
    recipient, _ = policy.parse_rcpt("<victim@ｅｘａｍｐｌｅ.test>", extended=True, utf8=True)
    assert policy.recipient_refusal(recipient, trusted=False, accepted_domains=accepted) is None
    other, _ = policy.parse_rcpt("<victim@ｅｘａｍｐｌｅ.net>", extended=True, utf8=True)
    refusal = policy.recipient_refusal(other, trusted=False, accepted_domains=accepted)
    assert refusal is not None and refusal.startswith("554 5.7.1")


@pytest.mark.parametrize("domain", ["xn--zz.test", "☃.test", "a..test", "ab--ü.test", "ü" * 60])
def test_rcpt_and_mail_refuse_a_domain_without_a_form_with_553(domain):
    with pytest.raises(policy.Refused) as rcpt:
        policy.parse_rcpt(f"<u@{domain}>", extended=True, utf8=True)
    assert rcpt.value.reply.startswith("553 5.1.3 ")
    with pytest.raises(policy.Refused) as mail:
        policy.parse_mail(f"<u@{domain}> SMTPUTF8", extended=True, max_size=0)
    assert mail.value.reply.startswith("553 5.1.7 ")


def test_pickup_takes_every_address_in_its_form_and_names_a_bad_domain():
    data = (
        "From: Boss <boss@ＣＯＲＰ.test>\r\nTo: victim@ｅｘａｍｐｌｅ\u3002test\r\n"
        "Cc: Victim@Example.TEST, victim@example.test\r\n\r\nhi\r\n"
    ).encode()
    submission = parse_pickup(data, PickupLimits(), NOW)
    env = submission.envelope
    assert env.mail_from == "boss@corp.test"
    assert [r.address for r in env.recipients] == ["victim@example.test", "Victim@Example.TEST"]
    assert env.smtputf8 is True  # the header names them in UTF-8
    assert submission.data.startswith(b"From: Boss <boss@\xef\xbc\xa3")  # header unchanged
    with pytest.raises(BadFile, match="the domain is not a valid domain name"):
        parse_pickup(b"From: a@example.org\r\nTo: u@xn--zz.test\r\n\r\nhi\r\n", PickupLimits(), NOW)


def test_replay_takes_every_address_in_its_form_and_refuses_a_bad_domain():
    data = (
        "X-Sender: <a@ｅｘａｍｐｌｅ.org> SMTPUTF8\r\nX-Receiver: <victim@ｅｘａｍｐｌｅ.test>\r\n"
        "From: a@example.org\r\n\r\nhi\r\n"
    ).encode()
    env = parse_replay(data).envelope
    assert env.mail_from == "a@example.org"
    assert [r.address for r in env.recipients] == ["victim@example.test"]
    bad = b"X-Sender: <a@example.org>\r\nX-Receiver: <u@xn--zz.test>\r\nFrom: a@x.org\r\n\r\nhi\r\n"
    with pytest.raises(BadFile, match="553 5.1.3"):
        parse_replay(bad)


# --- real parts ------------------------------------------------------------------


@pytest.mark.django_db(transaction=True)
def test_rcpt_and_mail_get_553_over_a_real_socket(ingress):
    with ingress.raw() as client:
        assert client.command("EHLO client.test")[0] == 250
        code, lines = client.command("MAIL FROM:<a@xn--zz.org> SMTPUTF8")
        assert (code, lines[-1][:5]) == (553, "5.1.7")
        assert client.command("MAIL FROM:<a@example.org> SMTPUTF8")[0] == 250
        for domain in ("xn--zz.test", "☃.test", "ab--ü.test"):
            code, lines = client.command(f"RCPT TO:<u@{domain}>")
            assert (code, lines[-1][:5]) == (553, "5.1.3"), (domain, lines)
        assert client.command("RCPT TO:<u@ｅｘａｍｐｌｅ.test>")[0] == 250
    assert not Message.objects.exists()


@pytest.fixture
def full_width_relay(dns_settings, settings, smtp_port, sink_factory, start_ingress):
    """example.test accepted and mapped to a sink on 127.0.0.2; a smart host trap
    on 127.0.0.3 takes everything else; no loopback client is trusted."""
    settings.MAILRELAY_RELAY_NETWORKS = [ipaddress.ip_network("192.0.2.0/24")]
    settings.MAILRELAY_ACCEPTED_DOMAINS = ["example.test", "bücher.test"]
    settings.MAILRELAY_TRANSPORTS = (
        f"ＥＸＡＭＰＬＥ.test=[127.0.0.2]:{smtp_port},Bücher\u3002TEST=[127.0.0.2]:{smtp_port}"
    )
    settings.MAILRELAY_SMART_HOST = f"[127.0.0.3]:{smtp_port}"
    settings.MAILRELAY_REMOTE_SMTP_PORT = smtp_port
    settings.MAILRELAY_SMTP_CONNECT_TIMEOUT = timedelta(seconds=2)
    settings.MAILRELAY_SMTP_CLIENT_TIMEOUT = timedelta(seconds=5)
    mapped, trap = sink_factory("127.0.0.2"), sink_factory("127.0.0.3")
    return start_ingress(), mapped, trap


def test_a_full_width_accepted_domain_reaches_the_transport_maps_next_hop(
    full_width_relay, dns_server
):
    ingress, mapped, trap = full_width_relay
    body = b"From: a@example.org\r\nSubject: one form\r\n\r\nbody\r\n"
    code, _ = ingress.send(
        body,
        mail_from="a@example.org",
        rcpt_to=["user@ｅｘａｍｐｌｅ.test", "anna@BÜCHER\u3002test"],
        mail_options=["SMTPUTF8"],
    )
    assert code == 250
    message = Message.objects.get()
    stored = {r.address: r.domain for r in message.recipients.all()}
    assert stored == {
        "user@example.test": "example.test",
        "anna@bücher.test": "xn--bcher-kva.test",
    }
    drain()
    assert not trap.messages
    assert [m.rcpt_tos for m in mapped.messages] == [["user@example.test", "anna@bücher.test"]]
    assert mapped.messages[0].data.endswith(body)
    for recipient in message.recipients.select_related("queue"):
        assert recipient.state == RecipientState.DELIVERED
        assert recipient.queue.delivery_type == DeliveryType.TRANSPORT_MAP
    queues = {r.queue.name for r in message.recipients.select_related("queue")}
    assert queues == {"example.test", "xn--bcher-kva.test"}
    assert not dns_server.queries  # the transport map answered; DNS was never asked
