"""The DSN builder (queues/bounce/dsn.py): every report is parsed back with the
standard ``email`` package and checked field by field. Pure: no database."""

from __future__ import annotations

import email
import re
from datetime import UTC, datetime, timedelta
from email import policy
from email.message import EmailMessage

import pytest

from queues.bounce.dsn import (
    DELAY,
    FAILURE,
    SUCCESS,
    DsnOriginal,
    DsnRecipient,
    DsnTransport,
    build_dsn,
    diagnostic_code,
    dsn_transport,
    dsn_wanted,
    header_block_in,
    is_dsn,
    returns_full,
    truncated_header_block,
)

NOW = datetime(2025, 3, 4, 17, 6, 7, tzinfo=UTC)
ARRIVED = NOW - timedelta(hours=5)
TRIED = NOW - timedelta(minutes=3)
UNTIL = ARRIVED + timedelta(days=2)
MTA = "relay.example.net"
BIG = 10 * 1024 * 1024

HEADERS = (
    b"Received: from client.example.org ([192.0.2.7]) by relay.example.net\r\n"
    b"From: Alice <alice@example.org>\r\n"
    b"To: bob@example.com, carol@example.com\r\n"
    b"Subject: quarterly numbers\r\n"
    b"Message-ID: <m1@example.org>\r\n"
)
BODY = b"Hello Bob,\r\n\r\nthe numbers are attached.\r\n"
DATA = HEADERS + b"\r\n" + BODY


def original(**changes) -> DsnOriginal:
    values = dict(
        qid="Q7K2M9",
        mail_from="alice@example.org",
        envid="",
        ret="",
        received_at=ARRIVED,
        data=DATA,
        smtputf8=False,
    )
    values.update(changes)
    return DsnOriginal(**values)


def failed(address: str = "bob@example.com", **changes) -> DsnRecipient:
    values = dict(
        address=address,
        orcpt="",
        action="failed",
        status="5.1.1",
        remote_mta="mx.example.com [198.51.100.25]",
        diagnostic_code="550 5.1.1 <bob@example.com>: Recipient address rejected",
        last_attempt_at=TRIED,
    )
    values.update(changes)
    return DsnRecipient(**values)


def delayed(address: str = "carol@example.com", **changes) -> DsnRecipient:
    values = dict(
        address=address,
        orcpt="",
        action="delayed",
        status="4.4.1",
        remote_mta="mx.example.com",
        diagnostic_code="451 4.4.1 try again later",
        last_attempt_at=TRIED,
        will_retry_until=UNTIL,
    )
    values.update(changes)
    return DsnRecipient(**values)


def delivered(address: str = "dave@example.com", **changes) -> DsnRecipient:
    values = dict(
        address=address,
        orcpt="",
        action="relayed",
        status="2.0.0",
        remote_mta="mx.example.com",
        diagnostic_code="250 2.0.0 Ok: queued as 4Xy",
        last_attempt_at=TRIED,
    )
    values.update(changes)
    return DsnRecipient(**values)


def build(kind: str, recipients, **changes) -> bytes:
    orig = changes.pop("orig", None) or original()
    options = dict(reporting_mta=MTA, now=NOW, max_dsn_size=BIG)
    options.update(changes)
    return build_dsn(kind, orig, recipients, **options)


def parse(dsn: bytes) -> EmailMessage:
    return email.message_from_bytes(dsn, policy=policy.default)


def parts(dsn: bytes) -> list[EmailMessage]:
    return list(parse(dsn).iter_parts())


def status_blocks(dsn: bytes) -> list[dict[str, str]]:
    """The delivery-status blocks as dicts: per-message first, then one per recipient."""
    part = parts(dsn)[1]
    if part.get_content_type() == "message/delivery-status":
        return [dict(block.items()) for block in part.get_payload()]
    # message/global-delivery-status is parsed as an ordinary message: the
    # per-message fields are its header, the per-recipient blocks its body.
    # Its fields may be UTF-8 (RFC 6533), which the email package reads from text.
    part = list(email.message_from_string(dsn.decode("utf-8"), policy=policy.default).iter_parts())[
        1
    ]
    (inner,) = part.get_payload()
    blocks = [dict(inner.items())]
    for chunk in inner.get_payload().split("\n\n"):
        if chunk.strip():
            blocks.append(dict(email.message_from_string(chunk, policy=policy.default).items()))
    return blocks


# Top level ----------------------------------------------------------------------------


def test_it_writes_the_report_headers_of_a_failure_dsn():
    msg = parse(build(FAILURE, [failed()]))

    assert msg["From"] == "Mail Delivery System <MAILER-DAEMON@relay.example.net>"
    assert msg["From"].addresses[0].addr_spec == "MAILER-DAEMON@relay.example.net"
    assert msg["To"].addresses[0].addr_spec == "alice@example.org"
    assert msg["Subject"] == "Undelivered Mail Returned to Sender"
    assert msg["Date"].datetime == NOW
    assert re.fullmatch(r"<[^<>@\s]+@relay\.example\.net>", msg["Message-ID"])
    assert msg["Auto-Submitted"] == "auto-replied"
    assert msg["MIME-Version"] == "1.0"
    assert msg.get_content_type() == "multipart/report"
    assert msg["Content-Type"].params["report-type"] == "delivery-status"
    assert msg["Content-Transfer-Encoding"] == "7bit"
    assert msg.defects == []


@pytest.mark.parametrize(
    ("kind", "recipient", "subject"),
    [
        (FAILURE, failed(), "Undelivered Mail Returned to Sender"),
        (DELAY, delayed(), "Delayed Mail (still being retried)"),
        (SUCCESS, delivered(), "Successful Mail Delivery Report"),
        (SUCCESS, delivered(action="delivered"), "Successful Mail Delivery Report"),
    ],
)
def test_it_has_three_parts_and_a_subject_for_each_kind(kind, recipient, subject):
    dsn = build(kind, [recipient])
    msg = parse(dsn)

    assert msg["Subject"] == subject
    types = [p.get_content_type() for p in parts(dsn)]
    assert types[:2] == ["text/plain", "message/delivery-status"]
    assert types[2] in ("message/rfc822", "text/rfc822-headers")
    assert all(not p.defects for p in msg.walk())


def test_every_line_ends_in_crlf_and_none_is_too_long():
    long_reply = "550 5.7.1 " + " ".join(["policy"] * 300) + " " + "x" * 1500
    dsn = build(
        FAILURE,
        [failed(diagnostic_code=long_reply)],
        orig=original(data=DATA.replace(b"\r\n", b"\n")),
    )

    assert b"\n" not in dsn.replace(b"\r\n", b"")
    assert b"\r" not in dsn.replace(b"\r\n", b"")
    assert max(len(line) for line in dsn.split(b"\r\n")) <= 998
    # Folding loses nothing but the line breaks.
    code = status_blocks(dsn)[1]["Diagnostic-Code"]
    assert code.replace(" ", "") == ("smtp; " + long_reply).replace(" ", "")


def test_the_same_input_gives_the_same_bytes():
    assert build(FAILURE, [failed()]) == build(FAILURE, [failed()])


def test_two_reports_for_one_message_have_different_message_ids():
    first = parse(build(FAILURE, [failed("bob@example.com")]))
    second = parse(build(FAILURE, [failed("carol@example.com")]))
    assert first["Message-ID"] != second["Message-ID"]


# Part 1: the human-readable text --------------------------------------------------------


def test_the_text_part_names_each_failed_recipient_and_the_remote_reply():
    text = parts(
        build(
            FAILURE,
            [
                failed(),
                failed(
                    "erin@example.net",
                    status="5.1.10",
                    remote_mta="",
                    diagnostic_code="",
                    reason="domain example.net accepts no mail (null MX)",
                ),
            ],
            postmaster="postmaster@example.net",
        )
    )[0]

    assert text.get_content_type() == "text/plain"
    assert text.get_content_charset() == "us-ascii"
    body = " ".join(text.get_content().split())
    assert "This is the mail system at host relay.example.net." in body
    assert "could not be delivered" in body
    assert (
        "<bob@example.com>: host mx.example.com [198.51.100.25] said: "
        "550 5.1.1 <bob@example.com>: Recipient address rejected"
    ) in body
    assert "<erin@example.net>: domain example.net accepts no mail (null MX)" in body
    assert "postmaster@example.net" in body
    assert "Your message is attached below." in body


def test_the_text_part_of_a_delay_says_it_is_a_warning_and_until_when():
    body = " ".join(parts(build(DELAY, [delayed()]))[0].get_content().split())

    assert "THIS IS A WARNING ONLY" in body
    assert "will keep trying until Thu, 06 Mar 2025 12:06:07 +0000" in body
    assert "<carol@example.com>: host mx.example.com said: 451 4.4.1 try again later" in body


def test_the_text_part_explains_a_status_when_there_is_no_other_reason():
    recipient = failed(status="5.2.2", remote_mta="", diagnostic_code="")
    body = " ".join(parts(build(FAILURE, [recipient]))[0].get_content().split())
    assert "<bob@example.com>: failed (5.2.2, mailbox full)" in body


# Part 2: the delivery-status fields ------------------------------------------------------


def test_the_per_message_fields():
    dsn = build(FAILURE, [failed()], orig=original(envid="QQ314159+2Bab"))
    per_message = status_blocks(dsn)[0]

    assert per_message == {
        "Reporting-MTA": "dns; relay.example.net",
        "X-Mailrelay-Queue-ID": "Q7K2M9",
        # ENVID travels as xtext (RFC 3461 §4.4); the report carries it decoded.
        "Original-Envelope-Id": "QQ314159+ab",
        "Arrival-Date": "Tue, 04 Mar 2025 12:06:07 +0000",
    }


def test_there_is_no_original_envelope_id_without_envid():
    assert "Original-Envelope-Id" not in status_blocks(build(FAILURE, [failed()]))[0]


def test_the_per_recipient_fields_of_a_failure():
    recipient = failed(orcpt="rfc822;Bob+2BSales@Example.COM")
    block = status_blocks(build(FAILURE, [recipient]))[1]

    assert list(block) == [
        "Original-Recipient",
        "Final-Recipient",
        "Action",
        "Status",
        "Remote-MTA",
        "Diagnostic-Code",
        "Last-Attempt-Date",
    ]
    assert block["Original-Recipient"] == "rfc822;Bob+Sales@Example.COM"
    assert block["Final-Recipient"] == "rfc822; bob@example.com"
    assert block["Action"] == "failed"
    assert block["Status"] == "5.1.1"
    # The IP that deliver.py puts in last_host stays out of the dns-typed field.
    assert block["Remote-MTA"] == "dns; mx.example.com"
    assert block["Diagnostic-Code"] == (
        "smtp; 550 5.1.1 <bob@example.com>: Recipient address rejected"
    )
    assert block["Last-Attempt-Date"] == "Tue, 04 Mar 2025 17:03:07 +0000"


def test_original_recipient_keeps_the_address_type_given():
    block = status_blocks(build(FAILURE, [failed(orcpt="x400;c=us+3Ba=att")]))[1]
    assert block["Original-Recipient"] == "x400;c=us;a=att"


def test_a_local_decision_has_no_remote_mta_and_no_diagnostic_code():
    recipient = failed(remote_mta="", diagnostic_code="", last_attempt_at=None, status="5.4.4")
    block = status_blocks(build(FAILURE, [recipient]))[1]
    assert block == {
        "Final-Recipient": "rfc822; bob@example.com",
        "Action": "failed",
        "Status": "5.4.4",
    }


def test_a_delay_dsn_has_will_retry_until():
    block = status_blocks(build(DELAY, [delayed()]))[1]

    assert block["Action"] == "delayed"
    assert block["Status"] == "4.4.1"
    assert block["Diagnostic-Code"] == "smtp; 451 4.4.1 try again later"
    assert block["Will-Retry-Until"] == "Thu, 06 Mar 2025 12:06:07 +0000"


@pytest.mark.parametrize(
    ("kind", "recipient"),
    [
        (FAILURE, failed(will_retry_until=UNTIL)),
        (SUCCESS, delivered(will_retry_until=UNTIL)),
    ],
)
def test_only_a_delay_has_will_retry_until(kind, recipient):
    block = status_blocks(build(kind, [recipient]))[1]
    assert "Will-Retry-Until" not in block


def test_a_success_dsn_reports_relayed():
    dsn = build(SUCCESS, [delivered(orcpt="rfc822;dave@example.com")])
    block = status_blocks(dsn)[1]

    assert block["Action"] == "relayed"
    assert block["Status"] == "2.0.0"
    assert block["Remote-MTA"] == "dns; mx.example.com"
    assert block["Original-Recipient"] == "rfc822;dave@example.com"
    text = " ".join(parts(dsn)[0].get_content().split())
    assert "<dave@example.com>: relayed to host mx.example.com" in text


def test_only_the_given_recipients_are_listed():
    dsn = build(FAILURE, [failed("bob@example.com"), failed("frank@example.com")])
    blocks = status_blocks(dsn)

    finals = [b["Final-Recipient"] for b in blocks[1:]]
    assert finals == ["rfc822; bob@example.com", "rfc822; frank@example.com"]
    text = parts(dsn)[0].get_content()
    assert "carol@example.com" not in text.split("The mail system")[1]


def test_a_reply_text_cannot_inject_fields():
    evil = "550 5.1.1 no\r\nAction: delivered\r\n\r\nFinal-Recipient: rfc822; x@y\x00"
    blocks = status_blocks(build(FAILURE, [failed(diagnostic_code=evil)]))

    assert len(blocks) == 2
    assert blocks[1]["Action"] == "failed"
    assert blocks[1]["Diagnostic-Code"] == (
        "smtp; 550 5.1.1 no Action: delivered Final-Recipient: rfc822; x@y"
    )


# Part 3: the original ------------------------------------------------------------------


def test_a_failure_returns_the_full_message_by_default():
    part = parts(build(FAILURE, [failed()]))[2]

    assert part.get_content_type() == "message/rfc822"
    assert part["Content-Transfer-Encoding"] == "7bit"
    returned = part.get_content()
    assert returned["Message-ID"] == "<m1@example.org>"
    assert returned["Subject"] == "quarterly numbers"
    assert returned.as_bytes(policy=policy.SMTP) == DATA


def test_ret_full_returns_the_full_message():
    part = parts(build(FAILURE, [failed()], orig=original(ret="FULL")))[2]
    assert part.get_content_type() == "message/rfc822"
    assert part.get_content().as_bytes(policy=policy.SMTP) == DATA


def test_ret_hdrs_returns_only_the_headers():
    dsn = build(FAILURE, [failed()], orig=original(ret="HDRS"))
    part = parts(dsn)[2]

    assert part.get_content_type() == "text/rfc822-headers"
    assert part.get_content().encode() == HEADERS
    assert b"the numbers are attached" not in dsn
    assert "Only the headers of your message are attached (RET=HDRS)" in " ".join(
        parts(dsn)[0].get_content().split()
    )


@pytest.mark.parametrize(("kind", "recipient"), [(DELAY, delayed()), (SUCCESS, delivered())])
def test_delay_and_success_return_only_headers_even_with_ret_full(kind, recipient):
    dsn = build(kind, [recipient], orig=original(ret="FULL"))
    part = parts(dsn)[2]

    assert part.get_content_type() == "text/rfc822-headers"
    assert part.get_content().encode() == HEADERS
    assert b"the numbers are attached" not in dsn


def test_a_message_at_max_dsn_size_is_returned_in_full():
    part = parts(build(FAILURE, [failed()], orig=original(ret="FULL"), max_dsn_size=len(DATA)))[2]
    assert part.get_content_type() == "message/rfc822"


def test_a_message_above_max_dsn_size_returns_only_headers_even_with_ret_full():
    dsn = build(FAILURE, [failed()], orig=original(ret="FULL"), max_dsn_size=len(DATA) - 1)
    part = parts(dsn)[2]

    assert part.get_content_type() == "text/rfc822-headers"
    assert part.get_content().encode() == HEADERS
    assert b"the numbers are attached" not in dsn
    text = " ".join(parts(dsn)[0].get_content().split())
    assert f"larger than {len(DATA) - 1} bytes" in text


# An original read without its body (queues.bounce.notify) ------------------------------


@pytest.mark.parametrize(
    ("kind", "ret", "size", "full"),
    [
        (FAILURE, "", 100, True),
        (FAILURE, "FULL", 100, True),
        (FAILURE, "hdrs", 100, False),
        (FAILURE, "", 101, False),
        (DELAY, "FULL", 1, False),
        (SUCCESS, "", 1, False),
    ],
)
def test_returns_full_decides_before_the_body_is_read(kind, ret, size, full):
    assert returns_full(kind, ret, size, 100) is full


@pytest.mark.parametrize(
    ("kind", "recipient", "ret"), [(FAILURE, failed(), "HDRS"), (DELAY, delayed(), "")]
)
def test_a_report_from_the_header_block_and_size_equals_one_from_the_whole_message(
    kind, recipient, ret
):
    whole = build(kind, [recipient], orig=original(ret=ret))
    headers_only = original(ret=ret, data=HEADERS, size=len(DATA))
    assert build(kind, [recipient], orig=headers_only) == whole


def test_the_size_given_decides_against_max_dsn_size():
    dsn = build(FAILURE, [failed()], orig=original(data=HEADERS, size=BIG + 1))
    assert parts(dsn)[2].get_content_type() == "text/rfc822-headers"
    assert f"larger than {BIG} bytes" in " ".join(parts(dsn)[0].get_content().split())


def test_a_header_block_cannot_stand_for_a_message_returned_in_full():
    with pytest.raises(ValueError, match="full message"):
        build(FAILURE, [failed()], orig=original(data=HEADERS, size=len(DATA)))


@pytest.mark.parametrize(
    ("prefix", "whole", "expected"),
    [
        (DATA[:20], False, None),  # the headers go on: read more
        (HEADERS, False, None),  # the empty line is not in it yet
        (HEADERS + b"\r\n", False, HEADERS),
        (DATA, True, HEADERS),
        (HEADERS[:-2], True, HEADERS),  # a message of headers only, no final line end
        (b"\r\nbody", False, b""),
        (b"A: 1\nB: 2\n\nbody", False, b"A: 1\r\nB: 2\r\n"),
        (b"A: 1\r\n\r", False, b"A: 1\r\n"),  # a lone CR ends a line, as in a report
    ],
)
def test_header_block_in_a_prefix(prefix, whole, expected):
    assert header_block_in(prefix, whole=whole) == expected


def test_a_truncated_header_block_keeps_complete_lines_only():
    assert truncated_header_block(HEADERS + b"X-Long: abc") == HEADERS
    assert truncated_header_block(b"X-Long: abc") == b""


def test_the_original_may_contain_the_boundary():
    first = build(FAILURE, [failed()])
    boundary = parse(first).get_boundary()
    sneaky = DATA + b"--" + boundary.encode() + b"--\r\nmore\r\n"

    dsn = build(FAILURE, [failed()], orig=original(data=sneaky))

    assert parse(dsn).get_boundary() != boundary
    returned = parts(dsn)[2].get_content()
    assert returned.as_bytes(policy=policy.SMTP) == sneaky


def test_bare_line_feeds_in_the_original_become_crlf():
    dsn = build(FAILURE, [failed()], orig=original(data=DATA.replace(b"\r\n", b"\n")))
    assert parts(dsn)[2].get_content().as_bytes(policy=policy.SMTP) == DATA


def test_data_from_the_database_may_be_a_memoryview():
    assert build(FAILURE, [failed()], orig=original(data=memoryview(DATA))) == build(
        FAILURE, [failed()]
    )


# 8-bit and SMTPUTF8 ----------------------------------------------------------------------

DATA_8BIT = (
    b"From: alice@example.org\r\n"
    b"Subject: Gruesse\r\n"
    b"Content-Type: text/plain; charset=utf-8\r\n"
    b"Content-Transfer-Encoding: 8bit\r\n"
    b"\r\n" + "Grüße aus Köln\r\n".encode()
)


def test_an_8bit_original_is_returned_with_8bit_declared():
    dsn = build(FAILURE, [failed()], orig=original(data=DATA_8BIT))
    msg = parse(dsn)
    text, status, returned = parts(dsn)

    assert msg["Content-Type"].params["report-type"] == "delivery-status"
    assert msg["Content-Transfer-Encoding"] == "8bit"
    assert text["Content-Transfer-Encoding"] == "7bit"
    assert status.get_content_type() == "message/delivery-status"
    assert returned.get_content_type() == "message/rfc822"
    assert returned["Content-Transfer-Encoding"] == "8bit"
    assert returned.get_content().get_content() == "Grüße aus Köln\r\n"
    assert dsn_transport(dsn) == DsnTransport(body_type="8BITMIME", smtputf8=False)


def test_a_plain_report_carries_no_8bit_outside_the_original():
    recipient = failed(diagnostic_code="550 5.1.1 Benutzer unbekannt: Müller")
    dsn = build(FAILURE, [recipient])

    assert dsn.isascii()
    assert status_blocks(dsn)[1]["Diagnostic-Code"] == "smtp; 550 5.1.1 Benutzer unbekannt: M?ller"
    assert dsn_transport(dsn) == DsnTransport(body_type="7BIT", smtputf8=False)


UTF8_DATA = (
    "From: Jürgen <jürgen@bücher.example>\r\n"
    "To: 用户@example.net\r\n"
    "Subject: Grüße\r\n"
    "Message-ID: <u1@bücher.example>\r\n"
    "\r\n"
    "Hallo!\r\n"
).encode()


def utf8_original(**changes) -> DsnOriginal:
    values = dict(mail_from="jürgen@bücher.example", data=UTF8_DATA, smtputf8=True)
    values.update(changes)
    return original(**values)


def test_an_smtputf8_original_gets_an_internationalised_report():
    recipient = failed(
        "用户@example.net",
        orcpt="utf-8;\\x{7528}\\x{6237}@example.net",
        diagnostic_code="550 5.1.1 Benutzer unbekannt: 用户",
    )
    dsn = build(FAILURE, [recipient], orig=utf8_original())
    # RFC 6532: header fields in UTF-8; read them as text, bodies as bytes.
    msg = email.message_from_string(dsn.decode("utf-8"), policy=policy.default)
    text, status, returned = msg.iter_parts()
    text_body = " ".join(parts(dsn)[0].get_content().split())

    assert msg["To"].addresses[0].addr_spec == "jürgen@bücher.example"
    assert msg["Content-Type"].params["report-type"] == "global-delivery-status"
    assert msg["Content-Transfer-Encoding"] == "8bit"
    assert text.get_content_charset() == "utf-8"
    assert (
        "<用户@example.net>: host mx.example.com [198.51.100.25] said: "
        "550 5.1.1 Benutzer unbekannt: 用户"
    ) in text_body
    assert status.get_content_type() == "message/global-delivery-status"
    assert status["Content-Transfer-Encoding"] == "8bit"
    assert returned.get_content_type() == "message/global"
    assert returned["Content-Transfer-Encoding"] == "8bit"
    inner = returned.get_payload()[0]
    assert inner["Subject"] == "Grüße"
    assert inner["Message-ID"] == "<u1@bücher.example>"

    blocks = status_blocks(dsn)
    assert blocks[1]["Original-Recipient"] == "utf-8;用户@example.net"
    assert blocks[1]["Final-Recipient"] == "utf-8; 用户@example.net"
    assert blocks[1]["Diagnostic-Code"] == "smtp; 550 5.1.1 Benutzer unbekannt: 用户"
    # The sender's address is in our To:, so this report needs SMTPUTF8 itself.
    assert dsn_transport(dsn) == DsnTransport(body_type="8BITMIME", smtputf8=True)


def test_an_smtputf8_report_to_an_ascii_sender_needs_only_8bitmime():
    dsn = build(FAILURE, [failed()], orig=utf8_original(mail_from="alice@example.org"))

    assert parts(dsn)[2].get_content_type() == "message/global"
    assert dsn_transport(dsn) == DsnTransport(body_type="8BITMIME", smtputf8=False)


def test_an_smtputf8_original_returns_global_headers_when_only_headers_go_back():
    dsn = build(DELAY, [delayed()], orig=utf8_original())
    part = email.message_from_string(dsn.decode("utf-8"), policy=policy.default)
    returned = list(part.iter_parts())[2]

    assert returned.get_content_type() == "message/global-headers"
    assert returned.get_payload()[0]["Subject"] == "Grüße"
    assert "Hallo!" not in dsn.decode("utf-8")


def test_a_utf8_orcpt_stays_encoded_in_a_plain_report():
    # RFC 6533 §3: utf-8-addr-xtext is the ASCII form a plain report carries.
    recipient = failed(orcpt="utf-8;j\\x{FC}rgen@example.com")
    block = status_blocks(build(FAILURE, [recipient]))[1]
    assert block["Original-Recipient"] == "utf-8;j\\x{FC}rgen@example.com"


# Input checks --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kind", "recipients", "orig", "message"),
    [
        ("bounce", [failed()], original(), "unknown DSN kind"),
        (FAILURE, [], original(), "at least one recipient"),
        (FAILURE, [failed()], original(mail_from=""), "null sender"),
        (FAILURE, [delayed()], original(), "does not belong"),
        (DELAY, [failed()], original(), "does not belong"),
        (SUCCESS, [failed()], original(), "does not belong"),
        (FAILURE, [failed(status="550")], original(), "RFC 3463"),
    ],
)
def test_it_refuses_what_cannot_be_a_dsn(kind, recipients, orig, message):
    with pytest.raises(ValueError, match=message):
        build_dsn(kind, orig, recipients, reporting_mta=MTA, now=NOW, max_dsn_size=BIG)


def test_a_naive_now_is_taken_as_utc():
    naive = build(FAILURE, [failed()], now=NOW.replace(tzinfo=None))
    assert naive == build(FAILURE, [failed()])


# Whether a DSN is owed, and recognising one ------------------------------------------------


@pytest.mark.parametrize(
    ("notify", "failure", "delay", "success"),
    [
        ("", True, True, False),
        ("NEVER", False, False, False),
        ("never", False, False, False),
        ("SUCCESS", False, False, True),
        ("FAILURE", True, False, False),
        ("DELAY", False, True, False),
        ("FAILURE,DELAY", True, True, False),
        ("SUCCESS,FAILURE", True, False, True),
        ("SUCCESS,FAILURE,DELAY", True, True, True),
        ("success, delay", False, True, True),
    ],
)
def test_dsn_wanted_follows_notify(notify, failure, delay, success):
    assert dsn_wanted(FAILURE, notify, "alice@example.org") is failure
    assert dsn_wanted(DELAY, notify, "alice@example.org") is delay
    assert dsn_wanted(SUCCESS, notify, "alice@example.org") is success


@pytest.mark.parametrize("notify", ["", "SUCCESS,FAILURE,DELAY", "FAILURE"])
@pytest.mark.parametrize("kind", [FAILURE, DELAY, SUCCESS])
@pytest.mark.parametrize("sender", ["", "<>"])
def test_no_dsn_is_ever_wanted_for_the_null_sender(kind, notify, sender):
    assert dsn_wanted(kind, notify, sender) is False


def test_dsn_wanted_refuses_an_unknown_kind():
    with pytest.raises(ValueError):
        dsn_wanted("bounce", "", "alice@example.org")


@pytest.mark.parametrize(
    ("kind", "recipient", "orig"),
    [
        (FAILURE, failed(), original()),
        (DELAY, delayed(), original()),
        (SUCCESS, delivered(), original()),
        (FAILURE, failed(), utf8_original()),
    ],
)
def test_is_dsn_recognises_our_reports(kind, recipient, orig):
    assert is_dsn(build(kind, [recipient], orig=orig)) is True


@pytest.mark.parametrize(
    "data",
    [
        DATA,
        DATA_8BIT,
        b"",
        b"Content-Type: multipart/report; report-type=disposition-notification;"
        b" boundary=x\r\n\r\n--x--\r\n",
        b"Content-Type: multipart/mixed; boundary=x\r\n\r\n--x--\r\n",
    ],
)
def test_is_dsn_leaves_other_messages_alone(data):
    assert is_dsn(data) is False


def test_is_dsn_recognises_a_foreign_report_however_it_is_spelled():
    data = (
        b"From: MAILER-DAEMON@elsewhere.example\r\n"
        b'Content-Type: Multipart/Report;\r\n report-type="Delivery-Status"; boundary="b"\r\n'
        b"\r\n--b--\r\n"
    )
    assert is_dsn(data) is True


@pytest.mark.parametrize(
    ("code", "text", "expected"),
    [
        (550, "5.1.1 no such user", "550 5.1.1 no such user"),
        (451, "", "451"),
        (None, "connection refused", ""),
    ],
)
def test_diagnostic_code_comes_only_from_a_remote_reply(code, text, expected):
    assert diagnostic_code(code, text) == expected
