"""DKIM signing at accept (queues.dkim): what reaches the next hop verifies.

Keys are made by ``manage.py dkim generate`` (a file in MAILRELAY_DKIM_KEYS_DIR
for RSA, a ``DkimKey`` row for Ed25519); the TXT record it prints is served by
the loopback DNS server, and dkimpy verifies the message a real sink received,
looking the key up over DNS on loopback, as a receiving MTA would.
"""

from __future__ import annotations

import io
import re
from datetime import timedelta

import dkim as dkimpy
import dns.resolver
import pytest
from django.core.management import call_command

from queues import dkim
from queues.accept import IncomingEnvelope, IncomingRecipient, message_accept, reset_key_store
from queues.lib import clock
from queues.models import DkimKey, Event, Message, MessageState, Recipient, RecipientState
from queues.services import accounts, actions
from tests.support.dns import DNSTestServer
from tests.support.pipeline import drain

pytestmark = pytest.mark.django_db

BODY = (
    b"From: Alice <alice@example.com>\r\n"
    b"To: Bob <bob@example.net>\r\n"
    b"Subject: signed\r\n"
    b"Date: Tue, 24 Nov 2026 04:00:00 +0000\r\n"
    b"Message-ID: <m1@example.com>\r\n"
    b"\r\n"
    b"Hello Bob,\r\n"
    b".a line that the client dot-stuffs\r\n"
    b"trailing blanks   \r\n"
)


@pytest.fixture(autouse=True)
def _fresh_keys():
    """Keys are cached per process: each test starts and ends with none loaded."""
    reset_key_store()
    yield
    reset_key_store()


@pytest.fixture
def relay(dns_settings, settings, smtp_port, tmp_path):
    settings.MAILRELAY_REMOTE_SMTP_PORT = smtp_port
    settings.MAILRELAY_SMTP_CONNECT_TIMEOUT = timedelta(seconds=2)
    settings.MAILRELAY_SMTP_CLIENT_TIMEOUT = timedelta(seconds=5)
    settings.MAILRELAY_DKIM_KEYS_DIR = str(tmp_path / "dkim")
    settings.MAILRELAY_DKIM_SIGNING_DOMAIN = ""
    settings.MAILRELAY_DKIM_HEADERS = []
    dns_settings.mx("example.net", [(10, "mx.example.net")])
    dns_settings.a("mx.example.net", "127.0.0.2")
    return dns_settings


def txt_lookup(server: DNSTestServer):
    """dkimpy's ``dnsfunc``: the TXT record, asked of the loopback DNS server."""
    resolver = dns.resolver.Resolver(configure=False)
    resolver.nameservers = [server.address]
    resolver.port = server.port

    def lookup(name: bytes | str, timeout: float = 5) -> bytes:
        qname = name.decode() if isinstance(name, bytes) else name
        answer = resolver.resolve(qname, "TXT", lifetime=timeout)
        return b"".join(answer[0].strings)

    return lookup


def generate(domain: str, selector: str, *options: str) -> str:
    """``manage.py dkim generate``; returns its standard output (the zone line)."""
    out = io.StringIO()
    call_command("dkim", "generate", domain, "--selector", selector, *options, stdout=out)
    return out.getvalue().strip()


def publish(server: DNSTestServer, zone_line: str) -> str:
    """Serve a zone line ``name. IN TXT "a" "b"``; returns the record it holds."""
    match = re.fullmatch(r"(\S+)\.\s+IN\s+TXT\s+((?:\"[^\"]*\"\s*)+)", zone_line)
    assert match, zone_line
    record = "".join(re.findall(r"\"([^\"]*)\"", match.group(2)))
    server.txt(match.group(1), record)
    return record


def accept(body: bytes = BODY, sender: str = "alice@example.com") -> Message:
    env = IncomingEnvelope(
        mail_from=sender,
        recipients=[IncomingRecipient("bob@example.net")],
        client_address="127.0.0.1",
        client_helo="client.test",
        dkim_sign=True,  # as the ingress says for a relay-network client
    )
    return message_accept(env, body)


@pytest.mark.parametrize(
    ("options", "algorithm", "record_start"),
    [
        ((), "rsa-sha256", "v=DKIM1; k=rsa; p=MIIBIjAN"),  # a 2048-bit key's SPKI
        (("--ed25519", "--database"), "ed25519-sha256", "v=DKIM1; k=ed25519; p="),
    ],
    ids=["rsa-file", "ed25519-database"],
)
def test_a_message_accepted_over_smtp_leaves_signed_and_verifies(
    relay, ingress, sink_factory, options, algorithm, record_start
):
    record = publish(relay, generate("example.com", "s1", *options))
    assert record.startswith(record_start)
    sink = sink_factory("127.0.0.2")

    code, _ = ingress.send(BODY, mail_from="alice@example.com", rcpt_to=["bob@example.net"])
    assert code == 250
    drain()

    assert len(sink.messages) == 1
    sent = sink.messages[0].data
    assert sent.startswith(b"DKIM-Signature: v=1; a=" + algorithm.encode())
    assert b"c=relaxed/relaxed; d=example.com;" in sent
    assert dkimpy.verify(sent, dnsfunc=txt_lookup(relay))
    assert relay.queried("s1._domainkey.example.com", "TXT")
    # Stored bytes stay as received; the signature is kept apart and sent first.
    stored = Message.objects.get()
    data, signature = bytes(stored.data), bytes(stored.signature)
    assert data.endswith(BODY) and b"DKIM-Signature" not in data
    assert sent == signature + data
    # The export offers both forms.
    assert actions.message_export(stored) == data
    assert actions.message_export(stored, form="sent") == sent
    assert actions.message_export_size(stored, form="sent") == len(sent)


@pytest.mark.django_db(transaction=True)  # the deletions and the records at real COMMITs
def test_a_key_and_an_account_deleted_while_mail_flows_cost_no_delivery_record(relay, sink_factory):
    """#22: the database key that signed a queued message and the SMTP account
    that sent it are deleted before its round. The signature was made at
    accept: the message leaves signed, is recorded delivered once, and tracked."""
    from tests.support.history import history

    publish(relay, generate("example.com", "s1", "--ed25519", "--database"))
    accounts.create_account("alice", "correct horse battery staple")
    sink = sink_factory("127.0.0.2")
    envelope = IncomingEnvelope(
        mail_from="alice@example.com",
        recipients=[IncomingRecipient("bob@example.net")],
        client_address="127.0.0.1",
        client_helo="client.test",
        auth_account="alice",
        dkim_sign=True,
    )
    qid = message_accept(envelope, BODY).qid
    DkimKey.objects.all().delete()
    reset_key_store()  # as a worker that reads the keys again would see it
    accounts.delete_account("alice")
    drain()
    assert len(sink.messages) == 1
    assert dkimpy.verify(sink.messages[0].data, dnsfunc=txt_lookup(relay))
    stored = Message.objects.get(qid=qid)
    assert (stored.state, stored.auth_account) == (MessageState.DONE, "alice")
    assert Recipient.objects.get(message=stored).state == RecipientState.DELIVERED
    assert len(history(qid=qid, event="delivered")) == 1
    clock.advance(timedelta(minutes=5))
    drain()
    assert len(sink.messages) == 1  # exactly once


def test_a_message_whose_from_domain_has_no_key_leaves_unsigned(relay, sink_factory):
    generate("example.com", "s1", "--ed25519")
    sink = sink_factory("127.0.0.2")
    body = BODY.replace(b"alice@example.com", b"carol@other.org")
    message = accept(body, sender="carol@other.org")
    drain()
    assert bytes(Message.objects.get(pk=message.pk).signature) == b""
    assert sink.messages[0].data == bytes(Message.objects.get(pk=message.pk).data)
    assert b"DKIM-Signature" not in sink.messages[0].data


def test_a_key_in_the_database_signs_without_a_keys_folder(relay, settings):
    """No MAILRELAY_DKIM_KEYS_DIR: the keys the database holds (``dkim
    generate --database``, the UI's) sign all the same."""
    settings.MAILRELAY_DKIM_KEYS_DIR = ""
    publish(relay, generate("example.com", "s1", "--ed25519", "--database"))
    reset_key_store()
    message = accept()
    sent = bytes(message.signature) + bytes(Message.objects.get(pk=message.pk).data)
    assert sent.startswith(b"DKIM-Signature: v=1; a=ed25519-sha256;")
    assert dkimpy.verify(sent, dnsfunc=txt_lookup(relay))


def test_a_subdomain_sender_and_the_signing_domain_use_their_keys(relay, settings):
    publish(relay, generate("example.com", "s1", "--ed25519"))
    publish(relay, generate("relay.test", "r1", "--ed25519"))
    settings.MAILRELAY_DKIM_SIGNING_DOMAIN = "relay.test"
    lookup = txt_lookup(relay)
    # news.example.com has no key of its own: its parent's key signs (aligned).
    sub = accept(BODY.replace(b"alice@example.com", b"alice@news.example.com"))
    sub_sent = bytes(sub.signature) + bytes(Message.objects.get(pk=sub.pk).data)
    assert b"d=example.com;" in sub_sent and dkimpy.verify(sub_sent, dnsfunc=lookup)
    # other.org has none: the configured signing domain signs.
    other = accept(BODY.replace(b"alice@example.com", b"carol@other.org"))
    other_sent = bytes(other.signature) + bytes(Message.objects.get(pk=other.pk).data)
    assert b"d=relay.test;" in other_sent and dkimpy.verify(other_sent, dnsfunc=lookup)


def test_a_signing_failure_stores_the_message_unsigned_and_says_so(relay, monkeypatch):
    generate("example.com", "s1", "--ed25519")

    def broken(data: bytes, key: dkim.SigningKey, prefix: bytes = b"") -> bytes:
        raise dkim.DkimError("the key is on fire")

    monkeypatch.setattr(dkim, "sign", broken)
    message = accept()
    stored = Message.objects.get(pk=message.pk)
    assert bytes(stored.signature) == b"" and bytes(stored.data).endswith(BODY)
    event = Event.objects.get(kind="dkim_sign_failed")
    assert event.message_id == message.pk and "the key is on fire" in event.text


def test_keys_are_read_once_not_per_message(relay, monkeypatch):
    generate("example.com", "s1")  # a file
    accept()
    reads = []
    monkeypatch.setattr(dkim, "load_keys", lambda *a, **k: reads.append(a) or {})
    for _ in range(3):
        assert accept().signature
    assert reads == []


def test_generate_refuses_to_replace_a_key_and_list_shows_them(relay):
    generate("example.com", "s1")
    generate("example.com", "e1", "--ed25519", "--database")
    with pytest.raises(Exception, match="exists"):
        generate("example.com", "s1")
    out = io.StringIO()
    call_command("dkim", "list", stdout=out)
    lines = out.getvalue().splitlines()
    assert any(
        line.startswith("e1._domainkey.example.com  ed25519-sha256  signing") for line in lines
    )
    assert any(line.startswith("s1._domainkey.example.com  rsa-sha256  enabled") for line in lines)


@pytest.mark.parametrize(
    "text",
    [b"", b"not a key", b"-----BEGIN PRIVATE KEY-----\nAAAA\n-----END PRIVATE KEY-----\n"],
)
def test_it_refuses_what_is_not_a_key(text):
    with pytest.raises(dkim.DkimError):
        dkim.normalize_private_key(text)


def signed_fields(signature: bytes) -> list[str]:
    unfolded = re.sub(rb"\r?\n[ \t]+", b" ", signature).decode()
    match = re.search(r"\bh=([^;]*);", unfolded)
    assert match, unfolded
    return [name.strip() for name in match.group(1).split(":")]


def test_it_signs_the_usual_fields_or_the_configured_ones(settings):
    algorithm, private = dkim.normalize_private_key(dkim.generate_private_key("ed25519-sha256"))
    key = dkim.SigningKey("example.com", "s1", algorithm, private, "test")
    message = b"Received: from x\r\n\tby y; now\r\n" + BODY
    settings.MAILRELAY_DKIM_HEADERS = []
    assert signed_fields(dkim.sign(message, key)) == [
        "from", "to", "subject", "date", "message-id", "from",
    ]  # fmt: skip
    settings.MAILRELAY_DKIM_HEADERS = ["Subject", "Received", "List-Id"]
    assert signed_fields(dkim.sign(message, key)) == ["subject", "list-id", "from"]


def test_the_api_and_ui_export_the_received_and_the_sent_form(relay):
    from django.test import Client

    from tests.support.operator_factories import api_client, make_user

    generate("example.com", "s1", "--ed25519")
    message = Message.objects.get(pk=accept().pk)
    data, signature = bytes(message.data), bytes(message.signature)
    assert signature.startswith(b"DKIM-Signature: ")
    user = make_user("operator", "olga")
    web = Client()
    web.force_login(user)
    for client, url in (
        (api_client(user), f"/api/v1/messages/{message.pk}/export/"),
        (web, f"/messages/{message.pk}/export/"),
    ):
        for query, expected, name in (
            ("", data, f"{message.qid}.eml"),
            ("?form=sent", signature + data, f"{message.qid}.sent.eml"),
        ):
            response = client.get(url + query, HTTP_ACCEPT="message/rfc822")
            assert response.status_code == 200, (url, response.status_code)
            assert b"".join(response.streaming_content) == expected
            assert response["Content-Length"] == str(len(expected))
            assert response["Content-Disposition"] == f'attachment; filename="{name}"'


def test_the_message_page_and_the_cli_offer_the_sent_form_of_a_signed_message(relay, tmp_path):
    from django.core.management import call_command
    from django.test import Client

    from tests.support.operator_factories import make_user

    generate("example.com", "s1", "--ed25519")
    signed = Message.objects.get(pk=accept().pk)
    other = BODY.replace(b"alice@example.com", b"bob@nokey.example")  # signed by From
    unsigned = Message.objects.get(pk=accept(other, sender="bob@nokey.example").pk)
    web = Client()
    web.force_login(make_user("operator", "otto"))
    page = web.get(f"/messages/{signed.pk}/").content.decode()
    assert 'id="export-sent-link"' in page and "signed when accepted" in page
    page = web.get(f"/messages/{unsigned.pk}/").content.decode()
    assert 'id="export-sent-link"' not in page and "not signed" in page
    out = tmp_path / "sent.eml"
    call_command("message", "export", signed.qid, "--form", "sent", "-o", str(out))
    assert out.read_bytes() == bytes(signed.signature) + bytes(signed.data)


def test_openssl_makes_the_same_rsa_signature_as_dkimpy_does_in_python():
    import hashlib

    from dkim.crypto import RSASSA_PKCS1_v1_5_sign, parse_pem_private_key

    assert dkimpy.RSASSA_PKCS1_v1_5_sign is dkim.openssl_rsa_sign  # installed
    _, pem = dkim.normalize_private_key(dkim.generate_private_key("rsa-sha256"))
    parsed = parse_pem_private_key(pem)
    for text in (b"", b"header hash input", BODY):
        assert dkim.openssl_rsa_sign(hashlib.sha256(text), parsed) == RSASSA_PKCS1_v1_5_sign(
            hashlib.sha256(text), parsed
        )


def tag(signature: bytes, name: str) -> str:
    unfolded = re.sub(rb"\r?\n[ \t]+", b"", signature).decode()
    match = re.search(rf"\b{name}=([^;]*)", unfolded)
    assert match, unfolded
    return match.group(1).strip()


@pytest.mark.parametrize(
    "data",
    [
        BODY,
        BODY + b"\r\n\r\n\r\n",  # empty lines at the end: not part of the relaxed body
        BODY + b"no final line end",
        BODY.replace(b"\r\n", b"\n"),  # bare LFs everywhere
        BODY + b"a bare\nLF inside\r\nand a lone \r CR\r\n",
        b"From: a@example.com\r\nSubject: no body\r\n",
        b"From: a@example.com\r\nSubject: no blank line",
        b"From: a@example.com\r\n\r\n",
        b"From: a@example.com\r\n\r\n\r\n.\r\n",
        b"From: a@example.com\r\nX-Folded: one\r\n two\r\n\r\n  spaced   out  \t\r\n",
    ],
)
def test_it_hashes_the_body_as_dkimpy_does_when_it_parses_the_whole_message(data):
    """sign() hands dkimpy the header block and the body apart (one copy of the
    body, not its lines): the body hash and the verdict are those of the whole."""
    algorithm, private = dkim.normalize_private_key(dkim.generate_private_key("ed25519-sha256"))
    key = dkim.SigningKey("example.com", "s1", algorithm, private, "test")
    prefix = b"Received: from x\r\n\tby y; now\r\n"
    ours = dkim.sign(data, key, prefix=prefix)
    whole = dkimpy.DKIM(prefix + data).sign(
        b"s1", b"example.com", private, signature_algorithm=b"ed25519-sha256",
        canonicalize=(b"relaxed", b"relaxed"),
    )  # fmt: skip
    assert tag(ours, "bh") == tag(whole, "bh")
    assert signed_fields(ours) == signed_fields(whole)
    record = dkim.dns_record(private).encode()
    assert dkimpy.verify(ours + prefix + data, dnsfunc=lambda name, timeout=5: record)


def kill_other_backends() -> int:
    from django.db import connection

    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT count(pg_terminate_backend(pid, 5000)) FROM pg_stat_activity "
            "WHERE datname = current_database() AND pid <> pg_backend_pid()"
        )
        return cursor.fetchone()[0]


def test_the_first_message_after_a_database_restart_is_signed(relay, start_ingress):
    publish(relay, generate("example.com", "e1", "--ed25519", "--database"))
    ingress = start_ingress(db_threads=1)  # every message on the same database thread
    assert ingress.send(BODY, mail_from="alice@example.com")[0] == 250
    assert kill_other_backends() >= 1  # the ingress thread's connection is dead now
    reset_key_store()  # a process just started: its first read of the keys meets it
    assert ingress.send(BODY.replace(b"signed", b"after"), mail_from="alice@example.com")[0] == 250
    after = Message.objects.get(subject="after")
    sent = bytes(after.signature) + bytes(after.data)
    assert dkimpy.verify(sent, dnsfunc=txt_lookup(relay))
