"""The SMTP envelope of one message for one peer: its MAIL and RCPT lines.

Pure (no socket, no clock, no database), so every rule is table-tested
without a peer (``tests/test_smtp_envelope.py``). What the peer offered
(its EHLO keywords) decides the parameters:

- MAIL: ``SIZE`` (SIZE), ``BODY`` (8BITMIME), ``SMTPUTF8`` (SMTPUTF8),
  ``RET`` and ``ENVID`` (DSN, RFC 3461), each only when offered;
- RCPT: ``NOTIFY`` and ``ORCPT`` (DSN), only when offered.

Some messages are refused here, before a command goes out: a CR, LF or NUL
in an address or parameter (it would smuggle a command), a message over the
peer's SIZE, and one that needs SMTPUTF8 from a peer without it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from delivery.smtp import retry
from delivery.smtp.types import OutboundMessage, OutboundRecipient
from queues.lib import header_end

CRLF = b"\r\n"
DATA_LINE = b"DATA\r\n"
# BODY values we pass on (RFC 6152); BINARYMIME would need CHUNKING.
_BODY_TYPES = ("7BIT", "8BITMIME")


@dataclass(frozen=True, slots=True)
class Refusal:
    """A decision taken without asking the peer, for a whole message
    (``phase`` MAIL) or for one recipient (``phase`` RCPT)."""

    phase: str
    enhanced: str
    text: str

    def classification(self) -> retry.Classification:
        return retry.classify_local(self.phase, self.enhanced)


BAD_SENDER = Refusal(retry.MAIL, "5.1.7", "invalid sender or MAIL parameters")
BAD_RECIPIENT = Refusal(retry.RCPT, "5.1.3", "invalid recipient or RCPT parameters")


@dataclass(frozen=True, slots=True)
class Envelope:
    """The commands of one transaction, each line with its CRLF."""

    mail: bytes
    # The recipients to send, in order, and their RCPT lines (same length).
    rcpts: tuple[OutboundRecipient, ...]
    rcpt_lines: tuple[bytes, ...]
    # Recipients never sent because of an unsafe value: ``BAD_RECIPIENT``.
    refused: tuple[OutboundRecipient, ...] = ()


def unsafe(value: str) -> bool:
    """A CR or LF (or NUL) inside an address or parameter would smuggle a command."""
    return "\r" in value or "\n" in value or "\0" in value


def sender_refusal(msg: OutboundMessage) -> Refusal | None:
    """``BAD_SENDER`` when the sender, RET or ENVID is unsafe. Needs no body,
    so the client checks it before reading one."""
    if unsafe(msg.mail_from) or unsafe(msg.envid) or unsafe(msg.ret):
        return BAD_SENDER
    return None


def size_limit(extensions: Mapping[str, str]) -> int:
    """The peer's SIZE limit in bytes; 0 when it declared none (or nonsense)."""
    value = extensions.get("SIZE", "")
    return int(value) if value.isdigit() else 0


def needs_smtputf8(msg: OutboundMessage, data: bytes) -> bool:
    """True when the message cannot go to a peer without SMTPUTF8: a non-ASCII
    envelope address, or a non-ASCII header in a message declared SMTPUTF8."""
    if not msg.mail_from.isascii():
        return True
    if any(not r.address.isascii() for r in msg.recipients):
        return True
    if msg.smtputf8:
        return not data[: header_end(data)].isascii()  # a copy of the header only
    return False


def build_envelope(
    msg: OutboundMessage, data: bytes, extensions: Mapping[str, str], host: str
) -> Envelope | Refusal:
    """The envelope of ``msg`` (body ``data``) for a peer named ``host`` that
    offered ``extensions`` (EHLO keywords in upper case → their parameters),
    or the refusal that decides the whole message without asking the peer.

    An envelope may have no recipient left to send (all refused): the
    message then needs no transaction at all.
    """
    refusal = sender_refusal(msg)
    if refusal is not None:
        return refusal
    limit = size_limit(extensions)
    if limit and len(data) > limit:
        text = f"message size {len(data)} exceeds size limit {limit} of {host}"
        return Refusal(retry.MAIL, "5.3.4", text)
    utf8 = needs_smtputf8(msg, data)
    if utf8 and "SMTPUTF8" not in extensions:
        text = f"{host} does not support SMTPUTF8, which this message needs"
        return Refusal(retry.MAIL, "5.6.7", text)
    mail = mail_line(msg, len(data), utf8 or msg.smtputf8, extensions)
    rcpts, lines, refused = rcpt_lines(msg.recipients, extensions)
    return Envelope(mail, rcpts, lines, refused)


def mail_line(
    msg: OutboundMessage, size: int, smtputf8: bool, extensions: Mapping[str, str]
) -> bytes:
    """``MAIL FROM:<...>`` with the parameters the peer offered. ``msg``'s
    values must be safe (``sender_refusal``)."""
    mail = "MAIL FROM:<" + msg.mail_from + ">"
    if "SIZE" in extensions:
        mail += f" SIZE={size}"
    body = msg.body_type.upper()
    if body in _BODY_TYPES and "8BITMIME" in extensions:
        mail += " BODY=" + body
    if smtputf8 and "SMTPUTF8" in extensions:
        mail += " SMTPUTF8"
    if "DSN" in extensions:
        if msg.ret:
            mail += " RET=" + msg.ret
        if msg.envid:
            mail += " ENVID=" + msg.envid
    return mail.encode() + CRLF


def rcpt_lines(
    recipients: list[OutboundRecipient], extensions: Mapping[str, str]
) -> tuple[tuple[OutboundRecipient, ...], tuple[bytes, ...], tuple[OutboundRecipient, ...]]:
    """(recipients to send, their ``RCPT TO:<...>`` lines, recipients refused
    for an unsafe address, NOTIFY or ORCPT)."""
    dsn = "DSN" in extensions
    sent: list[OutboundRecipient] = []
    lines: list[bytes] = []
    refused: list[OutboundRecipient] = []
    for rcpt in recipients:
        if unsafe(rcpt.address) or unsafe(rcpt.notify) or unsafe(rcpt.orcpt):
            refused.append(rcpt)
            continue
        line = "RCPT TO:<" + rcpt.address + ">"
        if dsn and rcpt.notify:
            line += " NOTIFY=" + rcpt.notify
        if dsn and rcpt.orcpt:
            line += " ORCPT=" + rcpt.orcpt
        sent.append(rcpt)
        lines.append(line.encode() + CRLF)
    return tuple(sent), tuple(lines), tuple(refused)
