"""Reports, expiry and exports read only the bodies they need (issue #9, bounded memory).

Large messages are stored directly with the ORM; the paths under test run
against real PostgreSQL, and tracemalloc measures what Python holds at the
peak. A report reads its original with SUBSTRING (``queues.bounce.notify``),
so the SQL it sends is checked too: a headers-only report never selects the
whole ``data`` column.
"""

from __future__ import annotations

import base64
import email
import hashlib
import io
import os
import tracemalloc
import zipfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import timedelta
from email import policy
from typing import Any

import pytest
from django.db import connection
from django.db.models import Subquery
from django.test.utils import CaptureQueriesContext

from delivery.qmgr.sweep import sweep
from queues import bodies
from queues.bounce import dsn, notify
from queues.lib import clock
from queues.models import Message, MessageSource, MessageState, Recipient, RecipientState
from queues.services import actions
from queues.services.actions import Via
from tests.support.browser import make_user

pytestmark = pytest.mark.django_db

MB = 1024 * 1024
BODY_SIZE = 8 * MB


def message_bytes(size: int, subject: str = "big", header_lines: int = 0) -> bytes:
    """A message of about ``size`` octets: a header block, then base64 text
    (random, so PostgreSQL stores it uncompressed, as real attachments are)."""
    extra = "".join(f"X-Padding-{i}: {'p' * 70}\r\n" for i in range(header_lines))
    head = (
        f"From: alice@example.org\r\nTo: bob@example.net\r\nSubject: {subject}\r\n{extra}"
        "Content-Type: application/octet-stream\r\nContent-Transfer-Encoding: base64\r\n\r\n"
    ).encode()
    lines = base64.encodebytes(os.urandom(size * 3 // 4)).replace(b"\n", b"\r\n")
    return head + lines[: max(0, size - len(head))]


def store(
    data: bytes, *, expired: bool = False, ret: str = "", received_ago: timedelta | None = None
) -> Message:
    """A message waiting for the categorizer, inserted directly (no ingress copies)."""
    now = clock.now()
    received = now - (received_ago or timedelta(minutes=1))
    message = Message.objects.create(
        qid=f"M{Message.objects.count():08d}",
        state=MessageState.SUBMISSION,
        source=MessageSource.SMTP,
        mail_from="alice@example.org",
        ret=ret,
        data=data,
        size=len(data),
        received_at=received,
        expires_at=now - timedelta(seconds=1) if expired else now + timedelta(days=2),
        next_attempt_at=now + timedelta(days=1),  # not the categorizer's yet
    )
    Recipient.objects.create(
        message=message,
        address="bob@example.net",
        domain="example.net",
        state=RecipientState.SUBMITTED,
        next_attempt_at=now + timedelta(days=1),
        last_text="connection refused",
    )
    return message


def store_copies(data: bytes, count: int, **kw: Any) -> list[Message]:
    """``count`` messages with the same bytes, sent to PostgreSQL once and copied there."""
    first = store(data, **kw)
    others = [store(b"", **kw) for _ in range(count - 1)]
    same = Message.objects.filter(pk=first.pk).values("data")[:1]
    Message.objects.filter(pk__in=[m.pk for m in others]).update(
        data=Subquery(same), size=len(data)
    )
    return [first, *others]


@contextmanager
def peak_memory() -> Iterator[dict[str, int]]:
    """The peak of Python allocations in the block, in ``result["peak"]``."""
    result: dict[str, int] = {}
    tracemalloc.start()
    try:
        yield result
    finally:
        result["peak"] = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()


def reports() -> list[email.message.EmailMessage]:
    rows = Message.objects.filter(source=MessageSource.DSN).order_by("id")
    return [email.message_from_bytes(bytes(m.data), policy=policy.default) for m in rows]


def returned_part(report: email.message.EmailMessage) -> Any:
    return list(report.iter_parts())[2]


def reads_whole_bodies(queries: list[dict[str, str]]) -> list[str]:
    """The SELECTs of the data column other than through SUBSTRING (SUBSTR on SQLite)."""
    selects = [q["sql"] for q in queries if q["sql"].lstrip().upper().startswith("SELECT")]
    return [sql for sql in selects if '"data"' in sql and "SUBSTR" not in sql.upper()]


def ndr(message: Message, **kw: Any) -> Message | None:
    deferred = Message.objects.defer("data").get(pk=message.pk)
    recipients = list(deferred.recipients.all())
    result = notify.notify(dsn.FAILURE, deferred, recipients, **kw)
    # notify never touched the deferred field (which would have loaded the body).
    assert "data" in deferred.get_deferred_fields()
    return result


# Expiry: the sweep ----------------------------------------------------------------------


def test_the_sweep_expires_twenty_large_messages_without_holding_their_bodies(settings):
    settings.MAILRELAY_MAX_DSN_SIZE = 1 * MB  # so these come back as headers only
    store_copies(message_bytes(BODY_SIZE), 20, expired=True)

    with CaptureQueriesContext(connection) as queries, peak_memory() as memory:
        report = sweep()

    assert report.expired == 20
    # 160 MB of bodies; the sweep held a few hundred kilobytes at most.
    assert memory["peak"] < BODY_SIZE // 8, memory
    assert reads_whole_bodies(queries.captured_queries) == []
    ndrs = reports()
    assert len(ndrs) == 20
    for report_message in ndrs:
        part = returned_part(report_message)
        assert part.get_content_type() == "text/rfc822-headers"
        assert b"Subject: big" in part.get_payload(decode=True)
        assert len(part.get_payload(decode=True)) < 1024


def test_expiry_returning_large_originals_in_full_holds_one_at_a_time(settings):
    settings.MAILRELAY_MAX_DSN_SIZE = 10 * MB  # the default: these go back whole
    body_size = 4 * MB
    store_copies(message_bytes(body_size), 5, expired=True)

    with peak_memory() as memory:
        assert sweep().expired == 5

    # One original and its report at a time, not the 20 MB of all five.
    assert memory["peak"] < 3 * body_size, memory
    assert {returned_part(r).get_content_type() for r in reports()} == {"message/rfc822"}


def test_the_sweep_returns_a_small_expired_original_in_full_and_reads_only_that_one(settings):
    settings.MAILRELAY_MAX_DSN_SIZE = 1 * MB
    small = message_bytes(256 * 1024, subject="small")
    store(small, expired=True)
    store(message_bytes(2 * MB), expired=True)

    with CaptureQueriesContext(connection) as queries:
        assert sweep().expired == 2

    assert len(reads_whole_bodies(queries.captured_queries)) == 1  # the small one only
    parts = {returned_part(r).get_content_type(): returned_part(r) for r in reports()}
    full = parts["message/rfc822"].get_payload()[0].as_bytes(policy=policy.SMTP)
    assert full == small
    assert (
        parts["text/rfc822-headers"]
        .get_payload(decode=True)
        .endswith(b"Content-Transfer-Encoding: base64\r\n")
    )


def test_a_delay_notice_for_a_large_message_reads_only_its_headers(settings):
    message = store(message_bytes(BODY_SIZE), received_ago=timedelta(hours=5))
    Recipient.objects.filter(message=message).update(state=RecipientState.DEFERRED)

    with CaptureQueriesContext(connection) as queries, peak_memory() as memory:
        assert sweep().delay_dsns == 1

    assert memory["peak"] < BODY_SIZE // 8, memory
    assert reads_whole_bodies(queries.captured_queries) == []
    (report,) = reports()
    assert returned_part(report).get_content_type() == "text/rfc822-headers"


# notify on a message loaded without its body ------------------------------------------------


def test_an_ndr_above_max_dsn_size_carries_the_headers_only(settings):
    settings.MAILRELAY_MAX_DSN_SIZE = 1 * MB
    data = message_bytes(2 * MB)
    message = store(data, ret="FULL")

    with CaptureQueriesContext(connection) as queries:
        ndr(message)

    assert reads_whole_bodies(queries.captured_queries) == []
    (report,) = reports()
    part = returned_part(report)
    assert part.get_content_type() == "text/rfc822-headers"
    assert part.get_payload(decode=True) == data[: data.index(b"\r\n\r\n") + 2]
    explanation = " ".join(list(report.iter_parts())[0].get_content().split())
    assert "Only the headers of your message are attached (larger than 1048576 bytes)" in (
        explanation
    )


def test_an_ndr_at_or_below_max_dsn_size_carries_the_full_original(settings):
    data = message_bytes(512 * 1024)
    settings.MAILRELAY_MAX_DSN_SIZE = len(data)
    message = store(data)

    ndr(message)

    (report,) = reports()
    part = returned_part(report)
    assert part.get_content_type() == "message/rfc822"
    assert part.get_payload()[0].as_bytes(policy=policy.SMTP) == data


def test_ret_hdrs_reads_only_the_headers_of_a_small_message():
    message = store(message_bytes(64 * 1024), ret="HDRS")
    with CaptureQueriesContext(connection) as queries:
        ndr(message)
    assert reads_whole_bodies(queries.captured_queries) == []
    (report,) = reports()
    assert returned_part(report).get_content_type() == "text/rfc822-headers"


def test_a_foreign_report_from_a_real_sender_gets_no_report_back_and_no_body_read():
    data = (
        b"From: MAILER-DAEMON@elsewhere.example\r\n"
        b'Content-Type: multipart/report; report-type=delivery-status; boundary="b"\r\n\r\n'
        + b"x"
        * (2 * MB)
    )
    message = store(data, ret="HDRS")
    with CaptureQueriesContext(connection) as queries:
        assert ndr(message) is None
    assert reads_whole_bodies(queries.captured_queries) == []
    assert reports() == []


# Reading a header block in growing prefixes ---------------------------------------------


def test_a_header_block_longer_than_the_first_read_is_read_whole():
    data = message_bytes(3 * MB, header_lines=1000)  # about 75 KB of header fields
    message = store(data)
    block = notify.original_header_block(message.pk)
    assert len(block) > notify.HEADER_READ_FIRST
    assert block == data[: data.index(b"\r\n\r\n") + 2]


def test_a_header_block_past_the_cap_is_cut_at_a_line_end():
    data = message_bytes(3 * MB, header_lines=20_000)  # about 1.5 MB of header fields
    message = store(data)
    block = notify.original_header_block(message.pk)
    assert len(block) <= notify.HEADER_READ_CAP
    assert block.endswith(b"\r\n") and data.startswith(block)


@pytest.mark.parametrize(
    ("data", "expected"),
    [
        (b"Subject: a\r\n", b"Subject: a\r\n"),  # no body at all
        (b"Subject: a", b"Subject: a\r\n"),
        (b"\r\nbody only\r\n", b""),
        (b"Subject: a\nTo: b\n\nbody\n", b"Subject: a\r\nTo: b\r\n"),
    ],
)
def test_a_header_block_of_a_short_message_is_what_the_report_would_return(data, expected):
    message = store(data)
    assert notify.original_header_block(message.pk) == expected


# Zip export ------------------------------------------------------------------------------


def export_peak(run: Callable[[], Any]) -> tuple[Any, int]:
    with peak_memory() as memory:
        result = run()
    return result, memory["peak"]


def test_the_zip_export_reads_bodies_in_pieces_into_a_temporary_file():
    bodies = [message_bytes(4 * MB, subject=f"m{i}") for i in range(5)]
    messages = [store(b) for b in bodies]
    user = make_user("olga", "operator")
    qs = Message.objects.filter(id__in=[m.pk for m in messages])

    out, peak = export_peak(lambda: actions.messages_export_zip_file(qs, user, Via.API))

    # 20 MB of bodies; the export held about one piece and the zip's buffers.
    assert peak < 4 * actions.EXPORT_PIECE, peak
    with out, zipfile.ZipFile(out) as archive:
        assert {n: archive.read(n) for n in archive.namelist()} == {
            f"{m.qid}.eml": b for m, b in zip(messages, bodies, strict=True)
        }


def test_the_ui_zip_export_streams_a_correct_zip(client):
    bodies = [message_bytes(3 * MB, subject=f"m{i}") for i in range(3)]
    messages = [store(b) for b in bodies]
    client.force_login(make_user("olga", "operator"))
    # The first request imports the URL configuration and the views: not measured.
    warm_up = client.post("/messages/selected/", {"action": "export", "ids": [messages[0].pk]})
    b"".join(warm_up.streaming_content)

    response, peak = export_peak(
        lambda: client.post(
            "/messages/selected/", {"action": "export", "ids": [m.pk for m in messages]}
        )
    )

    assert response.status_code == 200
    assert response.streaming and response["Content-Type"] == "application/zip"
    # 9 MB of bodies; the request held about one piece and the zip's buffers.
    assert peak < 4 * actions.EXPORT_PIECE, peak
    archive = zipfile.ZipFile(io.BytesIO(b"".join(response.streaming_content)))
    assert [archive.read(f"{m.qid}.eml") for m in messages] == bodies


@pytest.mark.parametrize("size", [0, 1, 999, 1000, 1001, 3000])
def test_a_body_is_read_in_pieces_that_add_up_to_it(size):
    data = (b"Subject: s\r\n\r\n" + b"0123456789" * 300)[:size]
    message = store(data)
    pieces = list(bodies.body_pieces(message.pk, 1000))
    assert b"".join(pieces) == data
    assert all(len(p) == 1000 for p in pieces[:-1])


def test_a_message_removed_before_its_body_is_read_is_left_out_of_the_zip(monkeypatch):
    kept, gone = store(message_bytes(1024)), store(message_bytes(1024))
    qs = Message.objects.filter(id__in=[kept.pk, gone.pk])
    read = bodies.body_pieces

    def purged_meanwhile(message_id: int, piece: int) -> Iterator[bytes]:
        # Removed between the listing of the selection and the reading of its body.
        Message.objects.filter(pk=gone.pk).delete()
        return read(message_id, piece)

    monkeypatch.setattr(bodies, "body_pieces", purged_meanwhile)
    out = io.BytesIO()
    assert actions.messages_export_zip(qs, out, "tester", Via.CLI) == 1
    assert zipfile.ZipFile(out).namelist() == [f"{kept.qid}.eml"]


def test_a_prefix_and_the_size_of_a_body_are_read_without_the_rest():
    data = b"Subject: s\r\n\r\n" + b"x" * 5000
    message = store(data)
    assert bodies.body_prefix(message.pk, 16) == data[:16]
    assert bodies.body_prefix(message.pk, 10**6) == data
    assert bodies.body_size(message.pk) == len(data)
    Message.objects.filter(pk=message.pk).delete()
    assert bodies.body_size(message.pk) is None
    assert list(bodies.body_pieces(message.pk, 1000)) == []


# Single-message export ------------------------------------------------------------------


def drained_digest(response: Any) -> tuple[str, int]:
    """The sha256 and length of a streamed response, read piece by piece (the
    test holds no more of it than the view does)."""
    digest, length = hashlib.sha256(), 0
    for piece in response.streaming_content:
        digest.update(piece)
        length += len(piece)
    return digest.hexdigest(), length


@pytest.mark.parametrize("via", ["ui", "api"])
def test_exporting_an_eight_megabyte_message_streams_it_in_pieces(client, via):
    data = message_bytes(BODY_SIZE)
    expected = (hashlib.sha256(data).hexdigest(), len(data))
    message = store(data)
    del data
    client.force_login(make_user("olga", "operator"))
    url = (
        f"/messages/{message.pk}/export/"
        if via == "ui"
        else f"/api/v1/messages/{message.pk}/export/"
    )
    # The first request imports the URL configuration and the views: not measured.
    drained_digest(client.get(url, HTTP_ACCEPT="message/rfc822"))

    with peak_memory() as memory:
        response = client.get(url, HTTP_ACCEPT="message/rfc822")
        got = drained_digest(response)

    assert response.status_code == 200 and response.streaming
    assert response["Content-Type"] == "message/rfc822"
    assert response["Content-Length"] == str(BODY_SIZE)
    assert got == expected
    # 8 MB of body; the request held about one piece (and the driver's copy of it).
    assert memory["peak"] < 3 * actions.EXPORT_PIECE, memory["peak"]


def test_a_replay_export_streams_the_envelope_then_the_stored_bytes():
    data = message_bytes(3 * actions.EXPORT_PIECE + 17)
    message = store(data)
    pieces = list(
        actions.message_export_pieces(Message.objects.defer("data").get(pk=message.pk), "replay")
    )
    assert pieces[0] == b"X-Sender: <alice@example.org>\r\nX-Receiver: <bob@example.net>\r\n"
    assert b"".join(pieces[1:]) == data
    assert max(len(p) for p in pieces) == actions.EXPORT_PIECE
    assert actions.message_export_size(message, "replay") is None
