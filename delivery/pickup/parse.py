"""Pickup and replay files → an envelope and the bytes to store. Pure: no I/O, no settings.

A file that cannot be made into a message raises ``BadFile`` with a reason an
administrator can act on; the watcher renames such a file ``.bad`` beside a
``.bad.txt`` carrying that reason.

- **Pickup** (Exchange's Pickup directory): a plain RFC 5322 message. The
  envelope sender is the Sender address, else the only From address; the
  recipients are every address of To, Cc and Bcc (duplicates once). Bcc
  fields are removed from the stored copy and a missing Date is added.
  Envelope addresses get their domain in its one form (IDNA 2008 + UTS #46,
  A-labels: ``policy.parse_mailbox``); the header fields are not changed.
  Exchange's limits: header size and recipients per message.
- **Replay** (Exchange's Replay directory): leading ``X-Sender:`` /
  ``X-Receiver:`` lines carry the envelope with its ESMTP/DSN parameters
  (``queues.replay``); they are removed and the rest is stored as is.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from datetime import datetime
from email.utils import format_datetime, getaddresses

from delivery.smtpd import policy
from queues.accept import IncomingEnvelope, IncomingRecipient
from queues.models import MessageSource
from queues.replay import X_RECEIVER, X_SENDER, split_injected

# RFC 5322 3.6.8: a field name is printable ASCII but the colon; obsolete
# syntax (4.5.8) allows white space before the colon.
_FIELD = re.compile(rb"([!-9;-~]+)[ \t]*:")
_LINE_ENDING = re.compile(rb"\r\n|\r|\n")
# X-Sender parameters that say nothing about delivery: dropped, not refused.
_IGNORED_MAIL_PARAMETERS = ("AUTH", "SIZE")


class BadFile(Exception):  # noqa: N818 - it is a verdict on a file, not an error of ours
    """The file cannot be submitted; ``reason`` says why (written to ``*.bad.txt``)."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


@dataclass(frozen=True)
class PickupLimits:
    max_header_size: int = 64 * 1024  # bytes; 0: no limit
    max_recipients: int = 100  # 0: no limit


@dataclass
class Submission:
    envelope: IncomingEnvelope
    data: bytes  # what message_accept stores (it prepends our Received header)


# --------------------------------------------------------------------------- headers


def normalize_line_endings(data: bytes) -> bytes:
    """CRLF everywhere: files written on Unix end lines with LF, SMTP needs CRLF."""
    if b"\r" not in data:
        return data.replace(b"\n", b"\r\n")
    return _LINE_ENDING.sub(b"\r\n", data)


def header_fields(data: bytes) -> tuple[list[tuple[str, bytes]], bytes]:
    """Split CRLF data into header fields and the rest.

    Returns ([(lower-case name, raw bytes of the field with its folded lines
    and CRLFs)], the rest from the empty line on — b"" when there is no body).
    """
    if data.startswith(b"\r\n") or not data:
        raise BadFile("the file has no header (it is empty or starts with an empty line)")
    end = data.find(b"\r\n\r\n")
    if end < 0:
        block, rest = (data if data.endswith(b"\r\n") else data + b"\r\n"), b""
    else:
        block, rest = data[: end + 2], data[end + 2 :]
    fields: list[tuple[str, bytes]] = []
    for number, line in enumerate(block.splitlines(keepends=True), start=1):
        if line[:1] in (b" ", b"\t"):
            if not fields:
                raise BadFile("the header starts with a folded (indented) line")
            name, raw = fields[-1]
            fields[-1] = (name, raw + line)
            continue
        match = _FIELD.match(line)
        if match is None:
            shown = line.rstrip(b"\r\n")[:80].decode("utf-8", "replace")
            raise BadFile(f"header line {number} is not a header field: {shown!r}")
        fields.append((match.group(1).decode("ascii").lower(), line))
    return fields, rest


def field_value(raw: bytes) -> str:
    """The unfolded value of a raw field (UTF-8; undecodable bytes kept as surrogates)."""
    value = raw.split(b":", 1)[1].replace(b"\r\n", b"").strip()
    return value.decode("utf-8", "surrogateescape")


# --------------------------------------------------------------------------- pickup


def _header_mailboxes(
    fields: list[tuple[str, bytes]], name: str
) -> list[tuple[policy.Mailbox, str]]:
    """The mailboxes of every ``name`` field, each with the address as written."""
    label = {"bcc": "Bcc", "cc": "Cc"}.get(name, name.capitalize())
    found: list[tuple[policy.Mailbox, str]] = []
    for field_name, raw in fields:
        if field_name != name:
            continue
        value = field_value(raw)
        addresses = [addr for _, addr in getaddresses([value]) if addr]
        if not addresses and "@" in value:
            raise BadFile(f"{label}: no address can be read in {value!r}")
        for addr in addresses:
            try:
                mailbox = policy.parse_mailbox(addr, utf8=True)
            except policy.BadDomain as exc:
                raise BadFile(
                    f"{label}: {addr!r}: the domain is not a valid domain name ({exc})"
                ) from None
            except (policy.PathSyntaxError, policy.NeedsSMTPUTF8):
                raise BadFile(f"{label}: {addr!r} is not a valid address") from None
            if mailbox is None:
                continue
            if not mailbox.domain:
                raise BadFile(f"{label}: {addr!r} has no domain (user@domain)")
            found.append((mailbox, addr))
    return found


def _envelope_sender(fields: list[tuple[str, bytes]]) -> tuple[policy.Mailbox, str]:
    if any(name == "sender" for name, _ in fields):
        senders = _header_mailboxes(fields, "sender")
        if len(senders) != 1:
            raise BadFile(f"Sender must hold exactly one address (it holds {len(senders)})")
        return senders[0]
    froms = _header_mailboxes(fields, "from")
    if not froms:
        raise BadFile("no sender: the header has no Sender and no From address")
    if len(froms) > 1:
        raise BadFile("From holds several addresses and there is no Sender field to choose one")
    return froms[0]


def parse_pickup(raw: bytes, limits: PickupLimits, now: datetime) -> Submission:
    """A pickup file → its submission.

    Steps:
    1. CRLF line endings; split the header (every line a field or a folded line);
       a replay file (leading X-Sender/X-Receiver) is refused;
    2. the header within MAILRELAY_PICKUP_MAX_HEADER_SIZE;
    3. the sender from Sender (one address), else From (one address);
    4. the recipients from every To, Cc and Bcc, each address once, at most
       MAILRELAY_PICKUP_MAX_RECIPIENTS_PER_MESSAGE of them — more is a bad
       file, as Exchange makes it badmail rather than send to a cut list;
    5. Bcc fields removed; a Date field added when there is none.
    """
    data = normalize_line_endings(raw)
    fields, rest = header_fields(data)
    if fields[0][0] in (X_SENDER, X_RECEIVER):
        # Its X-Receiver lines would show every recipient, Bcc too, to all of them.
        raise BadFile(
            "this is a replay file (it starts with X-Sender/X-Receiver): "
            "put it in the replay folder"
        )
    header_size = sum(len(r) for _, r in fields)
    if limits.max_header_size and header_size > limits.max_header_size:
        raise BadFile(
            f"the header is {header_size} bytes, over the limit of {limits.max_header_size} "
            "(MAILRELAY_PICKUP_MAX_HEADER_SIZE)"
        )
    sender, sender_given = _envelope_sender(fields)
    recipients: list[policy.Mailbox] = []
    given = [sender_given]
    seen: set[str] = set()
    for name in ("to", "cc", "bcc"):
        for mailbox, written in _header_mailboxes(fields, name):
            # One form: "u@ｅｘａｍｐｌｅ.test" and "u@Example.test" are one recipient.
            key = f"{mailbox.local}@{mailbox.domain_key}"
            if key not in seen:
                seen.add(key)
                recipients.append(mailbox)
                given.append(written)
    if not recipients:
        raise BadFile("no recipient: To, Cc and Bcc hold no address")
    if limits.max_recipients and len(recipients) > limits.max_recipients:
        raise BadFile(
            f"{len(recipients)} recipients, over the limit of {limits.max_recipients} "
            "(MAILRELAY_PICKUP_MAX_RECIPIENTS_PER_MESSAGE)"
        )
    for mailbox in recipients:
        if mailbox.routes_by_sender:
            raise BadFile(f"<{mailbox.address}>: sender-specified routing is not relayed")
    kept = [r for name, r in fields if name != "bcc"]
    if not any(name == "date" for name, _ in fields):
        kept.append(f"Date: {format_datetime(now)}\r\n".encode("ascii"))
    stored = b"".join(kept) + rest
    envelope = IncomingEnvelope(
        mail_from=sender.address,
        recipients=[IncomingRecipient(m.address) for m in recipients],
        body_type="" if stored.isascii() else "8BITMIME",
        # As written, not normalised: a header that names a U-label is UTF-8 (RFC 6532).
        smtputf8=not all(a.isascii() for a in given),
        protocol="local",
        source=MessageSource.PICKUP,
        dkim_sign=True,  # written by a local program: vouched for, as relay networks are
    )
    return Submission(envelope, stored)


# --------------------------------------------------------------------------- replay


def _path_and_parameters(value: str, line: str) -> tuple[str, list[str]]:
    """``"Name" <a@b> KEY=v`` → ("a@b", ["KEY=v"]); the display name is tolerated."""
    text = value.strip()
    if not text.startswith("<"):
        start = text.find("<")
        if start > 0 and not any(c in text[:start] for c in "=@"):
            text = text[start:]
    try:
        path, params, _ = policy.split_path(text)
    except policy.PathSyntaxError as exc:
        raise BadFile(f"{line}: {value!r}: {exc}") from None
    return path, params.split()


def _x_sender(value: str) -> tuple[policy.Mailbox | None, policy.MailParams]:
    path, params = _path_and_parameters(value, "X-Sender")
    kept = [p for p in params if p.partition("=")[0].upper() not in _IGNORED_MAIL_PARAMETERS]
    try:
        return policy.parse_mail(" ".join([f"<{path}>", *kept]), extended=True, max_size=0)
    except policy.Refused as refused:
        raise BadFile(f"X-Sender: {value!r}: {refused.reply}") from None


def _x_receiver(value: str, utf8: bool) -> IncomingRecipient:
    path, params = _path_and_parameters(value, "X-Receiver")
    fixed = []
    for param in params:
        key, eq, arg = param.partition("=")
        # Exchange writes ORCPT=user@example.com; RFC 3461 wants an address type.
        if key.upper() == "ORCPT" and eq and ";" not in arg:
            param = f"{key}=rfc822;{arg}"
        fixed.append(param)
    try:
        mailbox, rparams = policy.parse_rcpt(
            " ".join([f"<{path}>", *fixed]), extended=True, utf8=utf8
        )
    except policy.Refused as refused:
        raise BadFile(f"X-Receiver: {value!r}: {refused.reply}") from None
    refusal = policy.recipient_refusal(mailbox, trusted=True, accepted_domains=frozenset())
    if refusal is not None:
        raise BadFile(f"X-Receiver: {value!r}: {refusal}")
    return IncomingRecipient(mailbox.address, orcpt=rparams.orcpt, notify=rparams.notify)


def parse_replay(raw: bytes) -> Submission:
    """A replay file → its submission with exactly the envelope of its X- lines.

    Steps:
    1. CRLF line endings; split the header;
    2. the leading envelope lines (``split_injected``): exactly one X-Sender,
       at least one X-Receiver, each parsed as MAIL FROM / RCPT TO with their
       parameters (BODY, SMTPUTF8, RET, ENVID; NOTIFY, ORCPT);
    3. the message is what follows them, byte for byte.
    """
    data = normalize_line_endings(raw)
    fields, rest = header_fields(data)
    count = split_injected(fields)
    injected, message_fields = fields[:count], fields[count:]
    senders = [field_value(r) for name, r in injected if name == X_SENDER]
    receivers = [field_value(r) for name, r in injected if name == X_RECEIVER]
    if len(senders) != 1:
        raise BadFile(
            f"a replay file starts with exactly one X-Sender line (found {len(senders)}); "
            "plain messages go to the pickup folder"
        )
    if not receivers:
        raise BadFile("no X-Receiver line: a replay file names its recipients in X-Receiver")
    if not message_fields:
        raise BadFile("no message after the X-Sender/X-Receiver lines")
    sender, params = _x_sender(senders[0])
    recipients = [_x_receiver(value, params.smtputf8) for value in receivers]
    envelope = IncomingEnvelope(
        mail_from=sender.address if sender else "",
        recipients=recipients,
        body_type=params.body,
        smtputf8=params.smtputf8,
        ret=params.ret,
        envid=params.envid,
        protocol="local",
        source=MessageSource.REPLAY,
        # Not signed: a replay file may hold any message, one received from the
        # internet too (an export); a signature it was sent with is kept (form=sent).
        dkim_sign=False,
    )
    return Submission(envelope, b"".join(r for _, r in message_fields) + rest)
