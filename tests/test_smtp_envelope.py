"""The envelope builder (``delivery.smtp.connection.build_envelope``), table-tested
without a socket."""

from __future__ import annotations

import pytest

from delivery.smtp.connection import (
    Envelope,
    build_envelope,
    needs_smtputf8,
    sender_refusal,
    size_limit,
)
from delivery.smtp.outcome import BAD_RECIPIENT, BAD_SENDER, MAIL, Refusal
from delivery.smtp.types import OutboundMessage, OutboundRecipient

HOST = "mx.example.com"
BODY = b"From: s@example.org\r\nSubject: hi\r\n\r\nbody\r\n"
# What hello() makes of a generous peer's EHLO reply.
ALL = {"SIZE": "1000000", "8BITMIME": "", "SMTPUTF8": "", "DSN": "", "PIPELINING": ""}


def rcpt(address: str = "a@example.com", rid: int = 1, **kw) -> OutboundRecipient:
    return OutboundRecipient(rid, address, **kw)


def msg(*recipients: OutboundRecipient, mail_from: str = "s@example.org", **kw) -> OutboundMessage:
    return OutboundMessage(7, mail_from, BODY, list(recipients) or [rcpt()], **kw)


def mail_of(m: OutboundMessage, extensions: dict[str, str], data: bytes = BODY) -> bytes:
    envelope = build_envelope(m, data, extensions, HOST)
    assert isinstance(envelope, Envelope), envelope
    return envelope.mail


# --- MAIL ------------------------------------------------------------------------------


FROM = "MAIL FROM:<s@example.org>"
SIZE = f" SIZE={len(BODY)}"


@pytest.mark.parametrize(
    ("message", "extensions", "line"),
    [
        # no extension: no parameter at all (an RFC 821 peer after HELO)
        (msg(), {}, FROM),
        (msg(mail_from=""), {}, "MAIL FROM:<>"),
        # SIZE: the exact byte count of the body as stored
        (msg(), {"SIZE": ""}, FROM + SIZE),
        (msg(), {"SIZE": "100"}, FROM + " SIZE=42"),
        # BODY: 7BIT and 8BITMIME, in any case, only to a peer offering 8BITMIME
        (msg(body_type="8BITMIME"), {"8BITMIME": ""}, FROM + " BODY=8BITMIME"),
        (msg(body_type="7bit"), {"8BITMIME": ""}, FROM + " BODY=7BIT"),
        (msg(body_type="8BITMIME"), {}, FROM),
        (msg(body_type="BINARYMIME"), {"8BITMIME": ""}, FROM),
        (msg(body_type=""), {"8BITMIME": ""}, FROM),
        # SMTPUTF8: declared or needed, and offered
        (msg(smtputf8=True), {"SMTPUTF8": ""}, FROM + " SMTPUTF8"),
        (msg(smtputf8=True), {}, FROM),  # all ASCII: goes to a peer without it
        (
            msg(mail_from="josé@example.org"),
            {"SMTPUTF8": ""},
            "MAIL FROM:<josé@example.org> SMTPUTF8",
        ),
        (msg(), {"SMTPUTF8": ""}, FROM),
        # RET and ENVID: only with DSN, and only when set
        (msg(ret="HDRS", envid="QQ314159"), {"DSN": ""}, FROM + " RET=HDRS ENVID=QQ314159"),
        (msg(ret="FULL"), {"DSN": ""}, FROM + " RET=FULL"),
        (msg(envid="QQ1"), {"DSN": ""}, FROM + " ENVID=QQ1"),
        (msg(ret="HDRS", envid="QQ314159"), {"SIZE": ""}, FROM + SIZE),
        # everything at once, in this order
        (
            msg(body_type="8bitmime", smtputf8=True, ret="HDRS", envid="X"),
            ALL,
            FROM + SIZE + " BODY=8BITMIME SMTPUTF8 RET=HDRS ENVID=X",
        ),
    ],
)
def test_mail_line(message, extensions, line):
    assert mail_of(message, extensions) == line.encode() + b"\r\n"


# --- RCPT ------------------------------------------------------------------------------


DSN_RCPT = rcpt(notify="SUCCESS,FAILURE", orcpt="rfc822;Orig@example.com")


TO = "RCPT TO:<a@example.com>"
DSN_PARAMS = " NOTIFY=SUCCESS,FAILURE ORCPT=rfc822;Orig@example.com"


@pytest.mark.parametrize(
    ("recipient", "extensions", "line"),
    [
        (rcpt(), {}, TO),
        (DSN_RCPT, {}, TO),
        (DSN_RCPT, {"SIZE": "", "8BITMIME": ""}, TO),
        (DSN_RCPT, {"DSN": ""}, TO + DSN_PARAMS),
        (rcpt(notify="NEVER"), {"DSN": ""}, TO + " NOTIFY=NEVER"),
        (rcpt(orcpt="rfc822;x@example.com"), {"DSN": ""}, TO + " ORCPT=rfc822;x@example.com"),
        (rcpt("josé@example.com"), {"SMTPUTF8": ""}, "RCPT TO:<josé@example.com>"),
    ],
)
def test_rcpt_line(recipient, extensions, line):
    envelope = build_envelope(msg(recipient), BODY, extensions, HOST)
    assert isinstance(envelope, Envelope)
    assert envelope.rcpts == (recipient,)
    assert envelope.rcpt_lines == (line.encode() + b"\r\n",)
    assert envelope.refused == ()


def test_recipients_keep_their_order():
    recipients = [rcpt(f"r{i}@example.com", i) for i in range(5)]
    envelope = build_envelope(msg(*recipients), BODY, ALL, HOST)
    assert isinstance(envelope, Envelope)
    assert envelope.rcpts == tuple(recipients)
    assert [line.split(b">")[0] for line in envelope.rcpt_lines] == [
        f"RCPT TO:<r{i}@example.com".encode() for i in range(5)
    ]


# --- refusals --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "fields",
    [
        {"mail_from": "s@example.org\r\nRCPT TO:<evil@example.com>"},
        {"mail_from": "s@example.org\n"},
        {"mail_from": "s@exa\0mple.org"},
        {"envid": "QQ1\r\nDATA"},
        {"ret": "HDRS\n"},
        {"ret": "\0"},
    ],
)
def test_unsafe_sender_or_mail_parameter_refuses_the_message(fields):
    m = msg(**fields)
    assert sender_refusal(m) is BAD_SENDER
    # before anything else, even a size the peer would refuse too
    assert build_envelope(m, BODY * 100, {"SIZE": "10"}, HOST) is BAD_SENDER
    # whether or not the peer would have sent the parameter (no DSN here)
    assert build_envelope(m, BODY, {}, HOST) is BAD_SENDER


@pytest.mark.parametrize(
    "fields",
    [
        {"address": "a@example.com\r\nRCPT TO:<evil@example.com>"},
        {"address": "a@example.com\n"},
        {"notify": "SUCCESS\rX"},
        {"orcpt": "rfc822;a@example.com\0"},
    ],
)
def test_unsafe_recipient_is_refused_alone(fields):
    bad = rcpt(**{"address": "bad@example.com", "rid": 2, **fields})
    good1, good2 = rcpt("one@example.com", 1), rcpt("two@example.com", 3)
    envelope = build_envelope(msg(good1, bad, good2), BODY, {}, HOST)
    assert isinstance(envelope, Envelope)
    assert envelope.rcpts == (good1, good2)
    assert envelope.rcpt_lines == (
        b"RCPT TO:<one@example.com>\r\n",
        b"RCPT TO:<two@example.com>\r\n",
    )
    assert envelope.refused == (bad,)
    assert sender_refusal(msg(good1, bad, good2)) is None


def test_every_recipient_unsafe_leaves_nothing_to_send():
    envelope = build_envelope(msg(rcpt("a@x\r\n", 1), rcpt("b@x\n", 2)), BODY, ALL, HOST)
    assert isinstance(envelope, Envelope)
    assert envelope.rcpts == envelope.rcpt_lines == ()
    assert len(envelope.refused) == 2


@pytest.mark.parametrize(
    ("declared", "size", "refused"),
    [
        ("1000", 1000, False),  # exactly at the limit
        ("1000", 1001, True),
        ("0", 10**6, False),  # SIZE 0: no limit declared (RFC 1870)
        ("", 10**6, False),  # SIZE without a number
        ("10MB", 10**6, False),  # nonsense: treated as no limit
    ],
)
def test_size_limit(declared, size, refused):
    data = b"x" * size
    got = build_envelope(msg(), data, {"SIZE": declared}, HOST)
    if refused:
        assert got == Refusal(
            MAIL, "5.3.4", f"message size {size} exceeds size limit {declared} of {HOST}"
        )
    else:
        assert isinstance(got, Envelope) and f"SIZE={size}".encode() in got.mail


def test_size_limit_parsing():
    assert size_limit({}) == 0
    assert size_limit({"SIZE": "52428800"}) == 52428800
    assert size_limit({"SIZE": "-1"}) == 0


@pytest.mark.parametrize(
    ("fields", "data", "needed"),
    [
        ({}, BODY, False),
        ({"mail_from": "josé@example.org"}, BODY, True),
        ({"recipients": [rcpt("josé@example.com")]}, BODY, True),
        ({"recipients": [rcpt(), rcpt("ü@example.com", 2)]}, BODY, True),
        # a non-ASCII header matters only in a message declared SMTPUTF8
        ({"smtputf8": True}, "Subject: café\r\n\r\nbody\r\n".encode(), True),
        ({}, "Subject: café\r\n\r\nbody\r\n".encode(), False),
        # a non-ASCII body does not (8BITMIME's business, not SMTPUTF8's)
        ({"smtputf8": True}, "Subject: hi\r\n\r\ncafé\r\n".encode(), False),
        # no blank line: all of it is header
        ({"smtputf8": True}, "Subject: café\r\n".encode(), True),
        ({"smtputf8": True}, BODY, False),
    ],
)
def test_needs_smtputf8(fields, data, needed):
    recipients = fields.pop("recipients", [rcpt()])
    m = OutboundMessage(7, fields.pop("mail_from", "s@example.org"), data, recipients, **fields)
    assert needs_smtputf8(m, data) is needed
    got = build_envelope(m, data, {}, HOST)
    if needed:
        assert got == Refusal(
            MAIL, "5.6.7", f"{HOST} does not support SMTPUTF8, which this message needs"
        )
    else:
        assert isinstance(got, Envelope)
    with_it = build_envelope(m, data, {"SMTPUTF8": ""}, HOST)
    assert isinstance(with_it, Envelope)
    assert with_it.mail.endswith(b" SMTPUTF8\r\n") is (needed or m.smtputf8)


def test_size_is_checked_before_smtputf8():
    m = msg(mail_from="josé@example.org")
    got = build_envelope(m, b"x" * 2000, {"SIZE": "1000"}, HOST)
    assert isinstance(got, Refusal) and got.enhanced == "5.3.4"


@pytest.mark.parametrize(
    ("refusal", "outcome", "scope"),
    [
        (BAD_SENDER, "failed", "message"),
        (BAD_RECIPIENT, "failed", "recipient"),
        (Refusal(MAIL, "5.3.4", "too big"), "failed", "message"),
        (Refusal(MAIL, "5.6.7", "no SMTPUTF8"), "failed", "message"),
        (Refusal(MAIL, "4.3.0", "cannot read the body"), "deferred", "message"),
    ],
)
def test_refusal_classification(refusal, outcome, scope):
    cls = refusal.classification()
    assert (cls.outcome, cls.scope, cls.enhanced) == (outcome, scope, refusal.enhanced)
