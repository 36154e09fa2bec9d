"""DKIM signs only mail mailrelay vouches for (issue #20, item 1).

A DKIM signature says "this domain stands behind this message". The relay
gives one to mail from its relay networks, from authenticated accounts (whose
header From and Sender must be addresses the account may use: else 550 5.7.1
at DATA), from the pickup folder and to its own DSNs; never to a message an
anonymous internet client hands in for an accepted domain, whatever its From
claims, and not to replayed files (they may hold mail received from anyone).
Everything goes through the real ingress on loopback, as a client reaches it.
"""

from __future__ import annotations

import ipaddress
import smtplib
from datetime import timedelta
from pathlib import Path

import dkim as dkimpy
import pytest

from delivery.pickup import FolderConfig, FolderWatcher
from queues import accept, dkim
from queues.accept import IncomingEnvelope, IncomingRecipient, message_accept
from queues.bounce import dsn
from queues.bounce.notify import notify
from queues.models import Message
from queues.services import accounts

pytestmark = pytest.mark.django_db(transaction=True)

PASSWORD = "correct horse battery staple"


@pytest.fixture
def keys(settings, tmp_path) -> dict[str, bytes]:
    """Ed25519 keys (files) for our domain, a tenant's and a victim's; their DNS records."""
    folder = tmp_path / "dkim"
    folder.mkdir()
    settings.MAILRELAY_DKIM_KEYS_DIR = str(folder)
    settings.MAILRELAY_DKIM_SIGNING_DOMAIN = ""
    settings.MAILRELAY_DKIM_HEADERS = []
    records = {}
    for domain in ("example.com", "tenant-a.example", "victim.example", "relay.test"):
        key = dkim.generate_private_key(dkim.ED25519_SHA256)
        (folder / dkim.key_file_name(domain, "s1")).write_bytes(key)
        records[f"s1._domainkey.{domain}"] = dkim.dns_record(key).encode()
    accept.reset_key_store()
    yield records
    accept.reset_key_store()


def verifies(message: Message, records: dict[str, bytes]) -> bool:
    stored = Message.objects.get(pk=message.pk)
    sent = bytes(stored.signature) + bytes(stored.data)
    return dkimpy.verify(sent, dnsfunc=lambda name, timeout=5: records[name.decode().rstrip(".")])


def signing_domain(message: Message) -> str | None:
    signature = bytes(Message.objects.get(pk=message.pk).signature)
    if not signature:
        return None
    unfolded = signature.replace(b"\r\n", b"").decode()
    return unfolded.split(" d=", 1)[1].split(";", 1)[0]


def body(from_line: str, extra: str = "") -> bytes:
    return (
        f"From: {from_line}\r\n{extra}To: someone@example.com\r\nSubject: hello\r\n\r\nhi\r\n"
    ).encode()


# ------------------------------------------------------------ anonymous and trusted


def test_an_anonymous_client_gets_no_signature_for_mail_claiming_our_domain(
    keys, settings, start_ingress
):
    """The spoof: from the internet, to an accepted domain, From: ceo@<our domain>.
    Neither the From domain's key nor the configured signing domain's signs it."""
    settings.MAILRELAY_RELAY_NETWORKS = [ipaddress.ip_network("192.0.2.0/24")]
    settings.MAILRELAY_ACCEPTED_DOMAINS = ["example.com"]
    settings.MAILRELAY_DKIM_SIGNING_DOMAIN = "relay.test"
    ingress = start_ingress()
    for from_line in ("CEO <ceo@example.com>", "x@no-key.example"):
        code, _ = ingress.send(
            body(from_line), mail_from="spoofer@elsewhere.example", rcpt_to=["staff@example.com"]
        )
        assert code == 250
    assert [bytes(s) for s in Message.objects.values_list("signature", flat=True)] == [b"", b""]


def test_a_relay_network_client_is_signed_with_its_from_domain_s_key(keys, settings, ingress):
    code, _ = ingress.send(body("Alice <alice@example.com>"), mail_from="alice@example.com")
    assert code == 250
    message = Message.objects.get()
    assert signing_domain(message) == "example.com" and verifies(message, keys)


# ------------------------------------------------------------ authenticated accounts


@pytest.fixture
def submission(keys, settings, tls_files, start_ingress):
    """Submission with AUTH; loopback is not a relay network and no domain is accepted."""
    settings.PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]
    settings.MAILRELAY_RELAY_NETWORKS = [ipaddress.ip_network("192.0.2.0/24")]
    settings.MAILRELAY_ACCEPTED_DOMAINS = []
    accounts.create_account("alice", PASSWORD, allowed_senders=["alice@tenant-a.example"])
    accounts.create_account("team", PASSWORD, allowed_senders=["tenant-a.example"])
    return start_ingress(submission=True)


def submit(ingress, tls_files, data: bytes, user: str = "alice") -> tuple[int, bytes]:
    with smtplib.SMTP(ingress.host, ingress.submission_port, "client.test", timeout=10) as client:
        client.ehlo()
        client.starttls(context=tls_files.client_context())
        client.ehlo()
        client.login(user, PASSWORD)
        assert client.mail("alice@tenant-a.example")[0] == 250
        assert client.rcpt("bob@anywhere.example")[0] == 250
        return client.data(data)


@pytest.mark.parametrize(
    "data",
    [
        body("Boss <boss@victim.example>"),
        body("boss@victim.example"),
        body("Alice <alice@tenant-a.example>", "Sender: boss@victim.example\r\n"),
        body("alice@tenant-a.example, boss@victim.example"),
        body('"alice@tenant-a.example" <boss@victim.example>'),
        body("alice@tenant-a.example", "From: boss@victim.example\r\n"),  # a second From
        body("Boss\r\n <boss@victim.example>"),  # folded
        body("bob@tenant-a.example"),  # the right domain, not the account's address
    ],
    ids=[
        "from",
        "bare-from",
        "sender",
        "two-addresses",
        "display-name",
        "second-field",
        "folded",
        "other-local-part",
    ],
)
def test_an_account_cannot_send_a_header_from_it_may_not_use(submission, tls_files, data):
    """An account allowed only alice@tenant-a.example, MAIL FROM its own address,
    header From (or Sender) someone else's: 550 5.7.1 at DATA, nothing stored
    (it was 250 and signed d=victim.example)."""
    code, text = submit(submission, tls_files, data)
    assert (code, text[:5]) == (550, b"5.7.1")
    assert b"alice" in text and b"not allowed" in text
    assert not Message.objects.exists()


def test_an_account_s_own_header_from_is_signed_and_verifies(submission, tls_files, keys):
    code, _ = submit(submission, tls_files, body("Alice <alice@tenant-a.example>"))
    assert code == 250
    # A domain entry allows every address of it, in From and in Sender.
    data = body("Bob <bob@Tenant-A.example>", "Sender: alice@tenant-a.example\r\n")
    code, _ = submit(submission, tls_files, data, user="team")
    assert code == 250
    messages = list(Message.objects.order_by("id"))
    assert [signing_domain(m) for m in messages] == ["tenant-a.example", "tenant-a.example"]
    assert all(verifies(m, keys) for m in messages)


def test_an_account_s_message_without_a_from_field_is_accepted_unsigned(submission, tls_files):
    """No From: nothing claimed, and nothing to sign (RFC 6376 5.4 needs From)."""
    code, _ = submit(submission, tls_files, b"Subject: no from\r\n\r\nhi\r\n")
    assert code == 250
    assert bytes(Message.objects.get().signature) == b""


# ------------------------------------------------------------ pickup, replay, DSN


def drop(folder: Path, name: str, data: bytes) -> None:
    (folder / f".{name}.part").write_bytes(data)
    (folder / f".{name}.part").rename(folder / name)


def test_pickup_is_signed_and_replay_is_not(keys, settings, tmp_path):
    settings.MAILRELAY_PICKUP_DIR = str(tmp_path / "pickup")
    settings.MAILRELAY_REPLAY_DIR = str(tmp_path / "replay")
    for kind in ("pickup", "replay"):
        (tmp_path / kind).mkdir()
    drop(tmp_path / "pickup", "a.eml", body("alice@example.com").replace(b"hello", b"picked"))
    replay = b"X-Sender: <x@example.com>\r\nX-Receiver: <someone@example.net>\r\n"
    drop(tmp_path / "replay", "b.eml", replay + body("ceo@example.com"))
    for kind in ("pickup", "replay"):
        watcher = FolderWatcher(FolderConfig.from_settings(kind))
        watcher.poll()
        [outcome] = watcher.poll()
        assert outcome.qid
    picked = Message.objects.get(source="pickup")
    assert signing_domain(picked) == "example.com" and verifies(picked, keys)
    assert bytes(Message.objects.get(source="replay").signature) == b""


def test_our_own_dsn_is_signed(keys, settings):
    settings.MAILRELAY_HOSTNAME = "relay.test"
    original = message_accept(
        IncomingEnvelope("s@example.org", [IncomingRecipient("gone@example.net")]),
        body("s@example.org"),
    )
    assert bytes(original.signature) == b""  # an envelope vouches for nothing by default
    report = notify(dsn.FAILURE, original, list(original.recipients.all()), reason="gone")
    assert report is not None
    assert signing_domain(report) == "relay.test" and verifies(report, keys)


# ------------------------------------------------------------ where a message is prepared


def test_only_a_message_nothing_can_sign_is_prepared_on_the_ingress_loop(keys, settings):
    # accept.prepares_alone: the ingress prepares a message on its event loop
    # only when that needs neither the database nor a signature.
    unsigned = IncomingEnvelope("a@example.com", [IncomingRecipient("b@example.net")])
    signed = IncomingEnvelope("a@example.com", [IncomingRecipient("b@example.net")], dkim_sign=True)
    assert accept.prepares_alone(unsigned)
    assert not accept.prepares_alone(signed)  # the keys are not loaded yet: a reload
    assert accept.key_store().keys()
    assert not accept.prepares_alone(signed)  # keys to sign with: a database thread
    settings.MAILRELAY_DKIM_KEYS_DIR = ""
    accept.reset_key_store()
    assert accept.key_store().keys() == {}
    assert accept.prepares_alone(signed)  # no key at all, loaded: nothing to sign
    settings.MAILRELAY_DKIM_KEY_REFRESH = timedelta(0)
    accept.reset_key_store()
    accept.key_store().keys()
    assert not accept.prepares_alone(signed)  # due for a reload: a database thread


def test_a_message_prepared_on_the_loop_does_not_look_at_the_keys_again(keys, monkeypatch):
    # The loop's prepare_message(sign=False) is prepared as prepares_alone saw
    # the keys: were they due for a reload just then, the loop must not read
    # the database for them (it would, and fail, in the event loop).
    signed = IncomingEnvelope("a@example.com", [IncomingRecipient("b@example.net")], dkim_sign=True)

    def no_reload() -> dict:
        raise AssertionError("the key store was asked for its keys")

    monkeypatch.setattr(accept.key_store(), "keys", no_reload)
    prepared = accept.prepare_message(signed, b"From: a@example.com\r\n\r\nbody\r\n", sign=False)
    assert prepared.message.signature == b""
    assert prepared.dkim_error == ""
    # Without sign=False the keys are asked for (the failure is caught: unsigned, said why).
    again = accept.prepare_message(signed, b"From: a@example.com\r\n\r\nbody\r\n")
    assert "asked for its keys" in again.dkim_error
