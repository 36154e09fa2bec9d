"""The cost of a header-heavy message is bounded (issue #20, item 10).

dkimpy signed every occurrence of To/Cc and folded its ``h=`` list in
quadratic time: a 5.8 MB header-heavy message took 30 s to sign, in a
committer thread, while other sessions' messages waited behind it for their
250. Now the header is capped at DATA (Postfix's ``header_size_limit`` and a
field count, ``552 5.3.4``), each field name is signed once, and signing runs
before the message joins a group commit, in the session's database thread.
"""

from __future__ import annotations

import concurrent.futures
import re
import threading
import time

import dkim as dkimpy
import pytest

from queues import accept, dkim
from queues.models import Message

pytestmark = pytest.mark.django_db(transaction=True)

FROM = b"From: Alice <alice@example.com>\r\n"
TAIL = b"Subject: heavy\r\n\r\nbody\r\n"


def with_fields(count: int) -> bytes:
    """A message of ``count`` header fields (From, Subject and To fields)."""
    return FROM + b"To: r@example.net\r\n" * (count - 2) + TAIL


def with_field_of(size: int) -> bytes:
    """A message whose To field is ``size`` bytes long (folded, without its final CRLF)."""
    line = b"To: " + b"a" * 60
    while len(line) + 66 < size:
        line += b",\r\n " + b"b" * 60
    line += b"c" * (size - len(line))
    assert len(line) == size
    return FROM + line + b"\r\n" + TAIL


def test_more_header_fields_than_the_limit_get_552_at_data(ingress):
    assert ingress.send(with_fields(1000))[0] == 250  # MAILRELAY_SMTP_MAX_HEADER_FIELDS
    code, text = ingress.send(with_fields(1001))
    assert (code, text[:5]) == (552, "5.3.4")
    assert "header fields" in text and "1000" in text
    assert Message.objects.count() == 1


def test_a_header_field_over_the_size_limit_gets_552_at_data(ingress):
    assert ingress.send(with_field_of(102400))[0] == 250  # MAILRELAY_SMTP_MAX_HEADER_SIZE
    code, text = ingress.send(with_field_of(102401))
    assert (code, text[:5]) == (552, "5.3.4")
    assert "header field" in text and "102400" in text
    assert Message.objects.count() == 1


def test_the_header_limits_come_from_settings(settings, start_ingress):
    settings.MAILRELAY_SMTP_MAX_HEADER_FIELDS = 5
    settings.MAILRELAY_SMTP_MAX_HEADER_SIZE = 300
    ingress = start_ingress()
    assert ingress.send(with_fields(5))[0] == 250
    assert ingress.send(with_fields(6))[0] == 552
    assert ingress.send(with_field_of(300))[0] == 250
    assert ingress.send(with_field_of(301))[0] == 552


def ed25519_key() -> tuple[dkim.SigningKey, bytes]:
    private = dkim.generate_private_key(dkim.ED25519_SHA256)
    algorithm, key = dkim.normalize_private_key(private)
    return dkim.SigningKey("example.com", "s1", algorithm, key, "test"), dkim.dns_record(
        private
    ).encode()


def signed_fields(signature: bytes) -> list[str]:
    unfolded = re.sub(rb"\r?\n[ \t]+", b" ", signature).decode()
    match = re.search(r"\bh=([^;]*);", unfolded)
    assert match, unfolded[:500]
    return [name.strip() for name in match.group(1).split(":")]


def test_signing_signs_each_field_name_once_in_linear_time(settings):
    """200,000 To fields (3.4 MB, far past the SMTP limits): each name is
    signed once (From twice), and it takes a fraction of a second (it took
    6 s, and the signature itself was 1 MB of ``h=to : to : ...``)."""
    settings.MAILRELAY_DKIM_HEADERS = []
    key, record = ed25519_key()
    message = FROM + b"To: a@b.example\r\n" * 200_000 + b"Cc: c@d.example\r\n" + TAIL
    started = time.perf_counter()
    signature = dkim.sign(message, key)
    elapsed = time.perf_counter() - started
    assert signed_fields(signature) == ["from", "to", "cc", "subject", "from"]
    assert len(signature) < 1000
    assert dkimpy.verify(signature + message, dnsfunc=lambda name, timeout=5: record)
    assert elapsed < 2, elapsed


@pytest.mark.parametrize(
    ("headers", "signed"),
    [
        ([], ["from", "to", "subject", "from"]),
        (["To", "Subject", "X-Tag"], ["to", "subject", "x-tag", "from"]),
    ],
    ids=["usual", "configured"],
)
@pytest.mark.parametrize("line_end", [b"\r\n", b"\n"], ids=["crlf", "bare-lf"])
def test_folded_and_repeated_fields_are_signed_as_a_verifier_reads_them(
    settings, headers, signed, line_end
):
    """The header is parsed here, not by dkimpy: what it signs (the last field
    of each name, folded lines and all) is what dkimpy's verifier hashes."""
    settings.MAILRELAY_DKIM_HEADERS = headers
    key, record = ed25519_key()
    message = (
        b"From: Alice\r\n  <alice@example.com>\r\n"
        b"To: one@example.net\r\nX-Tag: a\r\nTo: two@example.net,\r\n\tthree@example.net\r\n"
        b"X-Tag:   b   \r\n  c\r\nSubject: folded\r\n subject\r\n\r\nbody\r\n"
    ).replace(b"\r\n", line_end)
    prefix = b"Received: from x\r\n\tby y; now\r\n"
    signature = dkim.sign(message, key, prefix=prefix)
    assert signed_fields(signature) == signed
    assert dkimpy.verify(signature + prefix + message, dnsfunc=lambda name, timeout=5: record)
    # A signed field changed after signing (the last To: the one signed) fails it.
    changed = message.replace(b"three@", b"four@")
    assert not dkimpy.verify(signature + prefix + changed, dnsfunc=lambda name, timeout=5: record)


def test_a_slow_signature_does_not_hold_up_another_session_s_250(
    settings, tmp_path, start_ingress, monkeypatch
):
    """Two header-heavy messages are being signed (held, as a 30 s signature
    would be); a small message from another session still gets its 250 at
    once. Signing used to run inside the group commit, in the committer
    threads: both were busy and the small message waited for them."""
    folder = tmp_path / "dkim"
    folder.mkdir()
    (folder / dkim.key_file_name("example.com", "s1")).write_bytes(
        dkim.generate_private_key(dkim.ED25519_SHA256)
    )
    settings.MAILRELAY_DKIM_KEYS_DIR = str(folder)
    settings.MAILRELAY_DKIM_HEADERS = []
    accept.reset_key_store()
    entered = threading.Semaphore(0)
    release = threading.Event()
    real_sign = dkim.sign

    def held_sign(data, key, prefix=b""):
        if b"Subject: heavy" in data:
            entered.release()
            assert release.wait(20)
        return real_sign(data, key, prefix=prefix)

    monkeypatch.setattr(dkim, "sign", held_sign)
    ingress = start_ingress(db_threads=4)  # two committer threads (the default)
    assert ingress.server.commit_threads == 2
    heavy = with_fields(1000)
    small = FROM + b"Subject: small\r\n\r\nhi\r\n"
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        try:
            heavies = []
            for _ in range(2):  # one after the other: each has a thread of its own
                heavies.append(pool.submit(ingress.send, heavy))
                assert entered.acquire(timeout=10)
            started = time.monotonic()
            quick = pool.submit(ingress.send, small)
            assert quick.result(timeout=5)[0] == 250
            assert time.monotonic() - started < 5
            assert not any(h.done() for h in heavies)
        finally:
            release.set()
        assert [h.result(timeout=20)[0] for h in heavies] == [250, 250]
    accept.reset_key_store()
    signatures = [bytes(s) for s in Message.objects.values_list("signature", flat=True)]
    assert len(signatures) == 3 and all(s.startswith(b"DKIM-Signature:") for s in signatures)
