"""Delivery status notifications (RFC 3461, 3464, 6522, 6533): build them, decide
whether one is owed, and recognise them.

Pure: no ORM, no settings, no clock. The caller reads the message and
recipient rows, the reporting host name, ``MAILRELAY_MAX_DSN_SIZE`` and the
time, and passes them in; it gets the bytes of a complete message to queue
from the null sender ``<>`` to the original envelope sender.

Choices made here (and why):

- **Kinds.** ``FAILURE`` (an NDR: permanent failure or expiry), ``DELAY``
  (the one "still trying" warning) and ``SUCCESS`` (``delivered`` or
  ``relayed`` to a next hop that does not take DSN itself). The kind names
  are the NOTIFY keywords, lower-cased.
- **What is returned (RFC 3461 §4.3).** RET only governs DSNs that report a
  failure: a failure DSN returns the full message for RET=FULL and for no
  RET at all (our choice where the RFC leaves it open, as Postfix does: the
  sender who gets an NDR usually wants the text back), only the headers for
  RET=HDRS. Delay and success DSNs always return only the headers ("only the
  headers of the message SHOULD be returned"). A message larger than
  ``max_dsn_size`` octets is never returned in full (Exchange's MaxDSNSize).
- **Only what is returned is read.** ``returns_full`` answers before any
  body is read, so a caller reads either the whole original or only its
  header block (``header_block_in`` tells when a prefix holds all of it) and
  passes that, with the whole message's ``size``, in ``DsnOriginal``. A
  returned body is copied once, into the finished report.
- **8-bit and UTF-8 (RFC 6152, 6532, 6533).** An original that was sent with
  SMTPUTF8 (or any non-ASCII envelope address) gets the internationalised
  report: ``report-type=global-delivery-status``, a
  ``message/global-delivery-status`` part whose addresses may be raw UTF-8
  (address type ``utf-8``), and the original as ``message/global`` or
  ``message/global-headers``. Those media types may carry UTF-8 header
  fields in an 8bit body, so the report itself needs only 8BITMIME, not
  SMTPUTF8, unless the sender's own address (our ``To:``) is non-ASCII.
  A plain 8BITMIME original stays ``message/rfc822`` / ``text/rfc822-headers``
  with ``Content-Transfer-Encoding: 8bit`` declared on that part and on the
  report (a message/* or multipart entity may not be base64-encoded, RFC
  2045 §6.4 and RFC 2046 §5.2.1, so declaring 8bit is the only way that keeps
  the returned bytes exact). ``dsn_transport`` tells the caller which of
  BODY=8BITMIME and SMTPUTF8 the report needs.
- **Diagnostics are data from strangers.** A remote reply text is stripped of
  CR, LF and other control characters before it reaches a header-style
  field (no field injection), folded to sensible lines, and reduced to
  ASCII outside the internationalised report.
- **Deterministic.** Message-ID and boundary derive from the queue id, the
  time and the recipients, so building the same report twice gives the same
  bytes (a retried DSN task does not produce a different message).
"""

from __future__ import annotations

import hashlib
import re
import textwrap
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from email.parser import BytesHeaderParser
from email.utils import format_datetime

# Kinds, named after the NOTIFY keywords (RFC 3461 §4.1); who is owed which:
# queues.lib (dsn_wanted).
from queues.lib import DEFAULT_NOTIFY, dsn_wanted, header_block  # noqa: F401
from queues.lib import DSN_DELAY as DELAY  # noqa: F401
from queues.lib import DSN_FAILURE as FAILURE  # noqa: F401
from queues.lib import DSN_KINDS as KINDS  # noqa: F401
from queues.lib import DSN_SUCCESS as SUCCESS  # noqa: F401

# RFC 3464 §2.3.3 actions each kind may report.
ACTIONS_BY_KIND: dict[str, frozenset[str]] = {
    FAILURE: frozenset({"failed"}),
    DELAY: frozenset({"delayed"}),
    SUCCESS: frozenset({"delivered", "relayed", "expanded"}),
}

SUBJECT_BY_KIND = {
    FAILURE: "Undelivered Mail Returned to Sender",
    DELAY: "Delayed Mail (still being retried)",
    SUCCESS: "Successful Mail Delivery Report",
}

CRLF = "\r\n"
_STATUS = re.compile(r"[245]\.\d{1,3}\.\d{1,3}\Z")
_XTEXT_HEX = re.compile(r"\+([0-9A-Fa-f]{2})")
_UNITEXT = re.compile(r"\\x\{([0-9A-Fa-f]{1,6})\}")
# Control characters (C0, DEL, C1) and lone surrogates never reach a field.
_CONTROLS = re.compile(r"[\x00-\x1f\x7f-\x9f\ud800-\udfff]")
_HOST_WITH_IP = re.compile(r"^(\S+?)\s*\[[^\]]*\]$")
_LINE_ENDS = re.compile(rb"\r\n|\r|\n")
_BCHARS = re.compile(r"[^0-9A-Za-z'()+_,\-./:=?]")
_FOLD_AT = 78  # preferred line length for fields and text (RFC 5322 §2.1.1)
_WORD_MAX = 200  # a longer "word" is cut, so no line nears 998 octets in UTF-8

# RFC 3463 (and RFC 7505 for x.1.10) subject.detail, for the human-readable part.
STATUS_TEXT = {
    "0.0": "other undefined status",
    "1.0": "other address status",
    "1.1": "bad destination mailbox address",
    "1.2": "bad destination system address",
    "1.3": "bad destination mailbox address syntax",
    "1.4": "destination mailbox address ambiguous",
    "1.6": "destination mailbox has moved",
    "1.7": "bad sender's mailbox address syntax",
    "1.8": "bad sender's system address",
    "1.10": "recipient domain accepts no mail (null MX)",
    "2.0": "other or undefined mailbox status",
    "2.1": "mailbox disabled, not accepting messages",
    "2.2": "mailbox full",
    "2.3": "message length exceeds administrative limit",
    "2.4": "mailing list expansion problem",
    "3.0": "other or undefined mail system status",
    "3.1": "mail system full",
    "3.2": "system not accepting network messages",
    "3.3": "system not capable of selected features",
    "3.4": "message too big for system",
    "4.0": "other or undefined network or routing status",
    "4.1": "no answer from host",
    "4.2": "bad connection",
    "4.3": "directory server failure",
    "4.4": "unable to route",
    "4.5": "mail system congestion",
    "4.6": "routing loop detected",
    "4.7": "delivery time expired",
    "5.0": "other or undefined protocol status",
    "5.1": "invalid command",
    "5.2": "syntax error",
    "5.3": "too many recipients",
    "5.4": "invalid command arguments",
    "6.0": "other or undefined media error",
    "6.7": "non-ASCII addresses not permitted",
    "7.0": "other or undefined security status",
    "7.1": "delivery not authorized, message refused",
}


@dataclass(frozen=True)
class DsnOriginal:
    """The message a report is about.

    ``envid`` and ``ret`` are the MAIL parameters as received (ENVID still
    xtext-encoded, RET ``"FULL"``/``"HDRS"``/``""``); ``mail_from`` is ``""``
    for the null sender; ``data`` the stored bytes (a ``memoryview`` from the
    database is accepted too).

    ``size`` is for an original whose body was not read: ``data`` then holds
    only its header block and ``size`` the length of the whole stored
    message, which decides (with RET and the kind) what the report returns;
    building a report that would return the full message from such an
    original is an error. ``None``: ``data`` is the whole message.
    """

    qid: str
    mail_from: str
    envid: str
    ret: str
    received_at: datetime
    data: bytes
    smtputf8: bool = False
    size: int | None = None


@dataclass(frozen=True)
class DsnRecipient:
    """One recipient's line in a report.

    - ``orcpt``: the ORCPT parameter as received (``"rfc822;user+2Bx@ex"``), or "".
    - ``action``: RFC 3464 ``failed``, ``delayed``, ``delivered``, ``relayed``.
    - ``status``: RFC 3463 ``"5.1.1"``.
    - ``remote_mta``: the host that answered (``"mx.example.com"``; a
      ``" [192.0.2.1]"`` suffix as in ``Recipient.last_host`` is allowed and
      kept out of the Remote-MTA field), or "".
    - ``diagnostic_code``: the remote reply, ``"550 5.1.1 no such user"``
      (see ``diagnostic_code``), or "" when the decision was ours.
    - ``reason``: human text for the first part, for decisions taken without
      a remote reply ("message expired after 2 days in the queue"); optional.
    """

    address: str
    orcpt: str
    action: str
    status: str
    remote_mta: str = ""
    diagnostic_code: str = ""
    last_attempt_at: datetime | None = None
    will_retry_until: datetime | None = None
    reason: str = ""


@dataclass(frozen=True)
class DsnTransport:
    """What the report needs from the SMTP hop that carries it."""

    body_type: str  # "7BIT" or "8BITMIME"
    smtputf8: bool


# Deciding --------------------------------------------------------------------------


def is_dsn(data: bytes) -> bool:
    """Whether ``data`` is a delivery status report (ours or anyone's).

    Looks only at the top-level Content-Type: ``multipart/report`` with
    ``report-type`` ``delivery-status`` or ``global-delivery-status``. A
    report never gets a report back, even when a broken system sent it from a
    non-null sender; the caller also checks ``mail_from == ""``.
    """
    headers = BytesHeaderParser().parsebytes(_header_block(bytes(data)))
    if headers.get_content_type() != "multipart/report":
        return False
    report_type = str(headers.get_param("report-type", "") or "").strip().lower()
    return report_type in ("delivery-status", "global-delivery-status")


def diagnostic_code(code: int | None, text: str) -> str:
    """The Diagnostic-Code text for a remote reply (``Recipient.last_code`` and
    ``last_text``), or "" when there was no reply (our own decision)."""
    if code is None:
        return ""
    return f"{code} {text}".strip()


def dsn_transport(dsn: bytes) -> DsnTransport:
    """BODY and SMTPUTF8 for queuing a built report: 8BITMIME when any octet
    is 8-bit; SMTPUTF8 only when its own header fields are (a UTF-8 ``To:``)."""
    return DsnTransport(
        body_type="7BIT" if dsn.isascii() else "8BITMIME",
        smtputf8=not _header_block(dsn).isascii(),
    )


def returns_full(kind: str, ret: str, size: int, max_dsn_size: int) -> bool:
    """Whether a ``kind`` report about a stored message of ``size`` octets with
    this RET returns the full message (else only its header block). Asked
    before reading the body, so that a report that returns only the headers
    never reads it."""
    return _returns_full(kind, ret, size, max_dsn_size)[0]


def header_block_in(prefix: bytes, *, whole: bool) -> bytes | None:
    """The header block of a message (as a report returns it: line ends made
    CRLF, without the empty line that ends it) from its first bytes.

    ``whole``: ``prefix`` is the entire message. Otherwise None when the
    prefix ends before the empty line that ends the headers (read more). A
    lone CR or LF counts as a line end here as everywhere in a report, so
    the answer from a prefix is the answer from the whole message.
    """
    data = _crlf(bytes(prefix))
    if whole or data.startswith(b"\r\n") or b"\r\n\r\n" in data:
        return _header_block(data)
    return None


def truncated_header_block(prefix: bytes) -> bytes:
    """A header block too long to read whole: the complete lines of ``prefix``
    (the caller caps how much of a header it reads)."""
    data = _crlf(bytes(prefix))
    end = data.rfind(b"\r\n")
    return data[: end + 2] if end >= 0 else b""


# Building --------------------------------------------------------------------------


def _check_input(kind: str, original: DsnOriginal, recipients: Sequence[DsnRecipient]) -> None:
    if kind not in KINDS:
        raise ValueError(f"unknown DSN kind {kind!r}")
    if not recipients:
        raise ValueError("a DSN needs at least one recipient")
    if original.mail_from.strip() in ("", "<>"):
        raise ValueError("no DSN is ever sent to the null sender")
    for rcpt in recipients:
        if rcpt.action not in ACTIONS_BY_KIND[kind]:
            raise ValueError(f"action {rcpt.action!r} does not belong in a {kind} DSN")
        if not _STATUS.match(rcpt.status):
            raise ValueError(f"status {rcpt.status!r} is not an RFC 3463 code")


def _report_header(
    kind: str,
    original: DsnOriginal,
    recipients: Sequence[DsnRecipient],
    host: str,
    now: datetime,
    utf8: bool,
    boundary: str,
    parts: Sequence[tuple[bytes, bytes]],
) -> bytes:
    """The report's top-level header (step 7 of ``build_dsn``)."""
    has_8bit = any(not piece.isascii() for part in parts for piece in part)
    report_type = "global-delivery-status" if utf8 else "delivery-status"
    header = [
        f"From: Mail Delivery System <MAILER-DAEMON@{host}>",
        f"To: <{_clean(original.mail_from, utf8=utf8)}>",
        f"Subject: {SUBJECT_BY_KIND[kind]}",
        f"Date: {_date(now)}",
        f"Message-ID: {_message_id(kind, original.qid, now, host, recipients)}",
        # RFC 3834 §5: an automatic message; well-behaved responders stay quiet.
        "Auto-Submitted: auto-replied",
        "MIME-Version: 1.0",
        f"Content-Type: multipart/report; report-type={report_type};",
        f'\tboundary="{boundary}"',
        f"Content-Transfer-Encoding: {'8bit' if has_8bit else '7bit'}",
    ]
    return CRLF.join(header).encode("utf-8")


def build_dsn(
    kind: str,
    original: DsnOriginal,
    recipients: Sequence[DsnRecipient],
    *,
    reporting_mta: str,
    now: datetime,
    max_dsn_size: int,
    postmaster: str | None = None,
) -> bytes:
    """Build a ``multipart/report`` delivery status notification.

    ``recipients`` are the ones this report is about, and only those (an NDR
    lists only the failed recipients). ``postmaster`` is the address named in
    the explanation for help; without it, "the postmaster" of this system.

    Steps:
    1. check the input: a known kind, at least one recipient, each action
       allowed for the kind, each status an RFC 3463 code, never a report to
       the null sender;
    2. choose the flavour: internationalised (RFC 6533) when the original
       was SMTPUTF8 or an address is non-ASCII, else plain RFC 3464;
    3. choose what to return (``_returns_full``): the full message or only
       its header block, the original's line ends made CRLF;
    4. write part 1, the human-readable text: what happened, then one line
       per recipient with the remote reply or our reason;
    5. write part 2, the ``message/delivery-status`` fields: per message
       (Reporting-MTA, Original-Envelope-Id, Arrival-Date) and per recipient
       (Original-Recipient, Final-Recipient, Action, Status, Remote-MTA,
       Diagnostic-Code, Last-Attempt-Date, Will-Retry-Until for delays);
    6. write part 3, the original or its headers, with the right media type
       and transfer encoding;
    7. pick a boundary found in no part, then write the top-level header
       (From MAILER-DAEMON, To the sender, Subject, Date, Message-ID,
       Auto-Submitted, MIME) and join the parts, every line ending in CRLF.
    """
    _check_input(kind, original, recipients)  # 1. input
    now = _aware(now)
    data = _crlf(bytes(original.data))
    size = len(data) if original.size is None else original.size
    host = _clean(reporting_mta, utf8=False).strip() or "localhost"

    # 2. flavour
    utf8 = (
        original.smtputf8
        or not original.mail_from.isascii()
        or any(not r.address.isascii() for r in recipients)
    )

    # 3. what to return
    full, why_headers = _returns_full(kind, original.ret, size, max_dsn_size)
    if full and original.size is not None:
        raise ValueError("this report returns the full message: pass all of it, not its headers")
    returned = data if full else _header_block(data)

    # 4-6. the parts, each (header, body): the original's body is joined into
    # the report once, at the end, and never copied on the way
    text = _human_text(kind, recipients, host, full, why_headers, postmaster, utf8)
    status = _delivery_status(original, recipients, host, utf8)
    parts = [
        _part(_text_headers(text), text.encode("utf-8")),
        _part(_status_headers(status, utf8), status.encode("utf-8")),
        _part(_original_headers(returned, full, utf8), returned),
    ]

    # 7. boundary, header, assembly
    boundary = _boundary(original.qid, now, host, parts)
    header = _report_header(kind, original, recipients, host, now, utf8, boundary, parts)
    out = [header, b"\r\n\r\n"]
    # The preamble is for MIME-unaware readers only.
    out.append(b"This is a MIME-encapsulated message.\r\n\r\n")
    for head, body in parts:
        out += [b"--", boundary.encode("ascii"), b"\r\n", head, body, b"\r\n"]
    out += [b"--", boundary.encode("ascii"), b"--\r\n"]
    return b"".join(out)


def _returns_full(kind: str, ret: str, size: int, max_dsn_size: int) -> tuple[bool, str]:
    """(full message?, why only headers) per RFC 3461 §4.3 and MaxDSNSize."""
    if kind != FAILURE:
        # RET only speaks for failure reports; the others SHOULD carry headers only.
        return False, ""
    if ret.strip().upper() == "HDRS":
        return False, "RET=HDRS"
    if size > max_dsn_size:
        return False, f"larger than {max_dsn_size} bytes"
    return True, ""


# Part 1: for people -------------------------------------------------------------------

_INTRO = {
    FAILURE: (
        "Your message could not be delivered to one or more recipients. "
        "The mail system has given up on the recipients listed below."
    ),
    DELAY: (
        "THIS IS A WARNING ONLY. YOU DO NOT NEED TO RESEND YOUR MESSAGE.\n\n"
        "Your message has not yet been delivered to the recipients listed below. "
        "The mail system will keep trying{until}."
    ),
    SUCCESS: (
        "Your message was delivered to the destinations listed below. "
        'A destination marked "relayed" passed it on to a system that does not '
        "send delivery notifications, so you will hear no more about it from there."
    ),
}


def _human_text(
    kind: str,
    recipients: Sequence[DsnRecipient],
    host: str,
    full: bool,
    why_headers: str,
    postmaster: str | None,
    utf8: bool,
) -> str:
    paragraphs = [f"This is the mail system at host {host}."]
    until = [r.will_retry_until for r in recipients if r.will_retry_until]
    intro = _INTRO[kind].format(until=f" until {_date(max(until))}" if until else "")
    paragraphs += intro.split("\n\n")
    if kind == FAILURE:
        if full:
            paragraphs.append("Your message is attached below.")
        else:
            paragraphs.append(f"Only the headers of your message are attached ({why_headers}).")
        helper = _clean(postmaster, utf8=utf8) if postmaster else "the postmaster"
        paragraphs.append(f"For further help, please write to {helper} and include this report.")
    else:
        paragraphs.append("The headers of your message are attached below.")
    lines: list[str] = []
    for para in paragraphs:
        lines += textwrap.wrap(para, _FOLD_AT - 6, break_on_hyphens=False) + [""]
    lines.append("                   The mail system")
    lines.append("")
    for rcpt in recipients:
        lines += textwrap.wrap(
            _recipient_line(rcpt, utf8),
            _FOLD_AT - 6,
            subsequent_indent="    ",
            break_on_hyphens=False,
        )
    return CRLF.join(lines) + CRLF


def _recipient_line(rcpt: DsnRecipient, utf8: bool) -> str:
    who = f"<{_clean(rcpt.address, utf8)}>"
    orcpt = _orcpt_address(rcpt.orcpt)
    if orcpt and orcpt.lower() != rcpt.address.lower():
        who += f" (original recipient <{_clean(orcpt, utf8)}>)"
    said = []
    peer = _clean(rcpt.remote_mta, utf8).strip()
    if rcpt.action in ("delivered", "relayed") and peer:
        said.append(f"{rcpt.action} to host {peer}")
    if rcpt.diagnostic_code:
        where = f"host {peer}" if peer else "the remote server"
        said.append(f"{where} said: {_clean(rcpt.diagnostic_code, utf8)}")
    if rcpt.reason:
        said.append(_clean(rcpt.reason, utf8))
    if not said:
        detail = STATUS_TEXT.get(rcpt.status.split(".", 1)[1], "")
        said.append(f"{rcpt.action} ({rcpt.status}{', ' + detail if detail else ''})")
    return f"{who}: {'; '.join(said)}"


# Part 2: for programs -------------------------------------------------------------------


def _delivery_status(
    original: DsnOriginal, recipients: Sequence[DsnRecipient], host: str, utf8: bool
) -> str:
    """The message/(global-)delivery-status body: one per-message block, then
    one block per recipient, blocks separated by an empty line."""
    per_message = [_field("Reporting-MTA", f"dns; {host}")]
    # An extension field (RFC 3464 §3) so a report leads an operator to the queue entry.
    per_message.append(_field("X-Mailrelay-Queue-ID", _clean(original.qid, False)))
    if original.envid:
        per_message.append(_field("Original-Envelope-Id", _decoded(original.envid, utf8)))
    per_message.append(_field("Arrival-Date", _date(original.received_at)))
    blocks = [per_message]
    for rcpt in recipients:
        block = []
        if rcpt.orcpt:
            block.append(_field("Original-Recipient", _original_recipient(rcpt.orcpt, utf8)))
        addr_type = "rfc822" if rcpt.address.isascii() else "utf-8"
        block.append(_field("Final-Recipient", f"{addr_type}; {_clean(rcpt.address, utf8)}"))
        block.append(_field("Action", rcpt.action))
        block.append(_field("Status", rcpt.status))
        remote = _remote_host(rcpt.remote_mta)
        if remote:
            block.append(_field("Remote-MTA", f"dns; {remote}"))
        if rcpt.diagnostic_code:
            block.append(_field("Diagnostic-Code", f"smtp; {_clean(rcpt.diagnostic_code, utf8)}"))
        if rcpt.last_attempt_at:
            block.append(_field("Last-Attempt-Date", _date(rcpt.last_attempt_at)))
        # RFC 3464 §2.3.9: only meaningful, and only sent, for "delayed".
        if rcpt.action == "delayed" and rcpt.will_retry_until:
            block.append(_field("Will-Retry-Until", _date(rcpt.will_retry_until)))
        blocks.append(block)
    return CRLF.join(CRLF.join(block) + CRLF for block in blocks)


def _original_recipient(orcpt: str, utf8: bool) -> str:
    """``addr-type;address`` from an ORCPT value, keeping the type given.

    The address is decoded from xtext (RFC 3461 §4.2: it travels encoded),
    and for the ``utf-8`` type from utf-8-addr-xtext too when the report is
    internationalised (RFC 6533 §3). Where decoding would put what the field
    cannot carry (UTF-8 in a plain report, control characters), the encoded
    form stays: it is ASCII and still names the same address.
    """
    addr_type, sep, value = orcpt.partition(";")
    if not sep:
        # Malformed in storage; inbound validation makes this unreachable.
        return f"rfc822;{_clean(orcpt, utf8)}"
    addr_type = _clean(addr_type.strip(), False)
    unitext = addr_type.lower() == "utf-8"
    return f"{addr_type};{_decoded(value.strip(), utf8, unitext=unitext)}"


def _orcpt_address(orcpt: str) -> str:
    """The decoded address of an ORCPT value, for the human-readable text."""
    addr_type, sep, value = orcpt.partition(";")
    unitext = addr_type.strip().lower() == "utf-8"
    return _xtext_decode(value.strip(), unitext=unitext) if sep else ""


def _decoded(xtext: str, utf8: bool, *, unitext: bool = False) -> str:
    """Decode xtext (and, for the utf-8 address type, its ``\\x{HEX}``
    escapes); keep the encoded form when the decoded one cannot go in this
    report."""
    decoded = _xtext_decode(xtext, unitext=unitext)
    if _CONTROLS.search(decoded) or (not utf8 and not decoded.isascii()):
        return _clean(xtext, utf8)
    return decoded


def _xtext_decode(value: str, *, unitext: bool = False) -> str:
    """xtext (RFC 3461 §4) to text; "+C3+A9" are two octets of one UTF-8
    character, so octets are collected first. Undecodable input comes back
    as given."""
    octets = bytearray()
    pos = 0
    for match in _XTEXT_HEX.finditer(value):
        octets += value[pos : match.start()].encode("utf-8", "surrogateescape")
        octets.append(int(match.group(1), 16))
        pos = match.end()
    octets += value[pos:].encode("utf-8", "surrogateescape")
    try:
        text = octets.decode("utf-8")
    except UnicodeDecodeError:
        return value
    return _UNITEXT.sub(_chr_or_keep, text) if unitext else text


def _chr_or_keep(match: re.Match[str]) -> str:
    code = int(match.group(1), 16)
    if code > 0x10FFFF or 0xD800 <= code <= 0xDFFF:
        return match.group(0)
    return chr(code)


def _remote_host(remote_mta: str) -> str:
    """``mx.example.com`` from ``mx.example.com [192.0.2.1]`` (Recipient.last_host)."""
    value = _clean(remote_mta, False).strip()
    match = _HOST_WITH_IP.match(value)
    return match.group(1) if match else value


# Part 3: the original -------------------------------------------------------------------


def _original_headers(returned: bytes, full: bool, utf8: bool) -> list[str]:
    if utf8:
        ctype = "message/global" if full else "message/global-headers"
    else:
        ctype = "message/rfc822" if full else "text/rfc822-headers"
    description = "Undelivered message" if full else "Message headers"
    return [
        f"Content-Description: {description}",
        f"Content-Type: {ctype}",
        # Never base64: message/* may not be encoded (RFC 2046 §5.2.1), and the
        # sender should get back the octets they sent.
        f"Content-Transfer-Encoding: {'7bit' if returned.isascii() else '8bit'}",
    ]


def _header_block(data: bytes) -> bytes:
    """The header fields of a message, each line ending in CRLF (``data`` has
    CRLF line ends); the empty line that ends them is not included."""
    block = header_block(data)
    return block + b"\r\n" if block else b""


def _crlf(data: bytes) -> bytes:
    """Every line end as CRLF: a report mixes our lines with the original's."""
    crlf = data.count(b"\r\n")
    if data.count(b"\r") == crlf and data.count(b"\n") == crlf:
        return data  # already so (as stored mail is): no copy of a large body
    return _LINE_ENDS.sub(b"\r\n", data)


# Parts and fields ---------------------------------------------------------------------


def _text_headers(text: str) -> list[str]:
    ascii_only = text.isascii()
    return [
        "Content-Description: Notification",
        f"Content-Type: text/plain; charset={'us-ascii' if ascii_only else 'utf-8'}",
        f"Content-Transfer-Encoding: {'7bit' if ascii_only else '8bit'}",
    ]


def _status_headers(status: str, utf8: bool) -> list[str]:
    ctype = "message/global-delivery-status" if utf8 else "message/delivery-status"
    return [
        "Content-Description: Delivery report",
        f"Content-Type: {ctype}",
        f"Content-Transfer-Encoding: {'7bit' if status.isascii() else '8bit'}",
    ]


def _part(headers: Iterable[str], body: bytes) -> tuple[bytes, bytes]:
    """A body part without its boundary, as (header with its empty line, body):
    kept apart so a large body is copied only into the finished report. The
    CRLF written before the next boundary line belongs to that boundary (RFC
    2046 §5.1.1), so the body's own last CRLF survives and the returned
    message comes back whole."""
    return CRLF.join(headers).encode("utf-8") + b"\r\n\r\n", body


def _field(name: str, value: str) -> str:
    """``Name: value`` folded at spaces near 78 characters (RFC 5322 §2.2.3)."""
    words = value.split(" ")
    pieces: list[str] = []
    for word in words:
        # A word with no space to fold at is cut, so no line nears 998 octets.
        pieces += [word[i : i + _WORD_MAX] for i in range(0, len(word), _WORD_MAX)] or [""]
    lines = [f"{name}:"]
    for piece in pieces:
        if len(lines[-1]) + 1 + len(piece) > _FOLD_AT and lines[-1].strip():
            lines.append(" " + piece)
        else:
            lines[-1] += " " + piece
    return CRLF.join(lines)


def _clean(text: str, utf8: bool) -> str:
    """Text safe for one line of a field: no CR, LF or other controls; ASCII
    unless the report is internationalised."""
    text = _CONTROLS.sub(" ", text)
    if not utf8:
        text = text.encode("ascii", "replace").decode("ascii")
    return " ".join(text.split())


def _date(when: datetime) -> str:
    """RFC 5322 date-time (``Tue, 04 Mar 2025 05:06:07 +0000``)."""
    return format_datetime(_aware(when))


def _aware(when: datetime) -> datetime:
    # A naive datetime is taken as UTC, which is what Django stores.
    return when if when.tzinfo is not None else when.replace(tzinfo=UTC)


def _message_id(
    kind: str, qid: str, now: datetime, host: str, recipients: Sequence[DsnRecipient]
) -> str:
    # The recipients make two reports for one message in the same microsecond
    # (two failures from one delivery run) distinct.
    digest = _digest(*(r.address for r in recipients))[:8]
    stamp = now.astimezone(UTC).strftime("%Y%m%d%H%M%S.%f")
    local = _BCHARS.sub("", f"{stamp}.{qid}.{kind}.{digest}").replace("/", "")
    return f"<{local}@{host}>"


def _boundary(qid: str, now: datetime, host: str, parts: Sequence[tuple[bytes, bytes]]) -> str:
    """A boundary that no part contains, readable like Postfix's ``qid.time/host``.
    (A boundary has no CR or LF, so it cannot straddle a part's header and body.)"""
    base = _BCHARS.sub("", f"{qid}.{int(now.timestamp())}/{host}")[:60]
    candidate, n = base, 0
    while any(b"--" + candidate.encode("ascii") in piece for part in parts for piece in part):
        n += 1
        candidate = f"{base}.{_digest(base, str(n))[:10]}"
    return candidate


def _digest(*values: str) -> str:
    return hashlib.sha256("\0".join(values).encode("utf-8", "surrogatepass")).hexdigest()
