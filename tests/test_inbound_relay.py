"""Relay control on the wire: nothing but the domain part ever decides where mail goes."""

from __future__ import annotations

import ipaddress

import pytest

from queues.models import Message
from tests.support.ingress import SMTPRefused

pytestmark = pytest.mark.django_db(transaction=True)

RAW = b"From: a@example.org\r\nSubject: relay\r\n\r\nbody\r\n"
EXTERNAL = "nmap.scanme.org"
OURS = "relay.test"
IP = "[127.0.0.1]"

# nmap's smtp-open-relay probes, with our accepted domain as the server name.
NMAP_PROBES = [
    ("<>", f"<relaytest@{EXTERNAL}>"),
    (f"<antispam@{EXTERNAL}>", f"<relaytest@{EXTERNAL}>"),
    (f"<antispam@{OURS}>", f"<relaytest@{EXTERNAL}>"),
    (f"<antispam@{IP}>", f"<relaytest@{EXTERNAL}>"),
    (f"<antispam@{IP}>", f"<relaytest%{EXTERNAL}@{IP}>"),
    (f"<antispam@{IP}>", f"<relaytest%{EXTERNAL}@{OURS}>"),
    (f"<antispam@{IP}>", f'<"relaytest@{EXTERNAL}">'),
    (f"<antispam@{IP}>", f'<"relaytest%{EXTERNAL}">'),
    (f"<antispam@{IP}>", f"<relaytest@{EXTERNAL}@{IP}>"),
    (f"<antispam@{IP}>", f'<"relaytest@{EXTERNAL}"@{IP}>'),
    (f"<antispam@{IP}>", f"<relaytest@{EXTERNAL}@{OURS}>"),
    (f"<antispam@{IP}>", f"<@{IP}:relaytest@{EXTERNAL}>"),
    (f"<antispam@{IP}>", f"<@{OURS}:relaytest@{EXTERNAL}>"),
    (f"<antispam@{IP}>", f"<{EXTERNAL}!relaytest>"),
    (f"<antispam@{IP}>", f"<{EXTERNAL}!relaytest@{IP}>"),
    (f"<antispam@{IP}>", f"<{EXTERNAL}!relaytest@{OURS}>"),
]

# Sender-encoded routing, refused with 554 5.7.1 even for trusted clients.
ROUTING_TRICKS = [
    f"<user%{EXTERNAL}@{OURS}>",
    f"<user%{EXTERNAL}@{IP}>",
    f"<{EXTERNAL}!user>",
    f"<{EXTERNAL}!user@{OURS}>",
    f"<@{OURS}:user@{EXTERNAL}>",
    f"<@{IP},@{OURS}:user@{OURS}>",
    f'<"user@{EXTERNAL}"@{OURS}>',
    f'<"user@{EXTERNAL}">',
    f'<"user%{EXTERNAL}"@{OURS}>',
    f'<"user\\@{EXTERNAL}"@{OURS}>',
]


@pytest.fixture
def untrusted(settings, start_ingress):
    """A server that trusts no loopback client but accepts mail for relay.test."""
    settings.MAILRELAY_RELAY_NETWORKS = [ipaddress.ip_network("192.0.2.0/24")]
    settings.MAILRELAY_ACCEPTED_DOMAINS = [OURS]
    return start_ingress()


def test_it_rejects_relay_from_an_untrusted_client(untrusted):
    with pytest.raises(SMTPRefused) as refused:
        untrusted.send(RAW, rcpt_to=[f"relaytest@{EXTERNAL}"])
    assert (refused.value.code, refused.value.text) == (554, "5.7.1 Relay access denied")
    assert not Message.objects.exists()


def test_it_accepts_an_accepted_domain_from_an_untrusted_client(untrusted):
    code, _ = untrusted.send(RAW, rcpt_to=["postmaster@Relay.Test"])
    assert code == 250
    assert Message.objects.get().recipients.get().address == "postmaster@Relay.Test"


def test_no_nmap_open_relay_probe_gets_a_250_from_an_untrusted_client(untrusted):
    with untrusted.raw() as client:
        client.command("EHLO nmap.scanme.org")
        for mail_from, rcpt_to in NMAP_PROBES:
            assert client.command(f"MAIL FROM:{mail_from}")[0] == 250
            code, lines = client.command(f"RCPT TO:{rcpt_to}")
            assert code // 100 == 5, (rcpt_to, code, lines)
            assert client.command("RSET")[0] == 250
    assert not Message.objects.exists()


def test_it_refuses_every_sender_routing_trick_even_from_a_trusted_client(settings, start_ingress):
    settings.MAILRELAY_ACCEPTED_DOMAINS = [OURS]
    ingress = start_ingress()  # loopback is trusted by default
    with ingress.raw() as client:
        client.command("EHLO client.test")
        assert client.command("MAIL FROM:<a@example.org>")[0] == 250
        for trick in ROUTING_TRICKS:
            code, lines = client.command(f"RCPT TO:{trick}")
            assert f"{code} {lines[-1]}".startswith("554 5.7.1 "), (trick, code, lines)
        # the session goes on: a plain recipient is still relayed
        assert client.command(f"RCPT TO:<relaytest@{EXTERNAL}>")[0] == 250


def test_it_rejects_a_recipient_without_a_domain(ingress):
    with ingress.raw() as client:
        client.command("EHLO client.test")
        client.command("MAIL FROM:<a@example.org>")
        assert client.command("RCPT TO:<postmaster>") == (
            553,
            ["5.1.3 Recipient address must be fully qualified (user@domain)"],
        )
