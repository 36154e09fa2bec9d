"""message_accept: the one way a message enters the queue store."""

from __future__ import annotations

import secrets
import time
from dataclasses import dataclass, field
from email.utils import format_datetime

from django.conf import settings

from queues import clock
from queues.bulk import insert_with_children
from queues.headers import inspect_headers
from queues.models import Message, MessageSource, MessageState, Recipient, RecipientState

_B32 = "0123456789BCDFGHJKLMNPQRSTVWXYZ"  # no vowels: ids never spell words


@dataclass
class IncomingRecipient:
    address: str
    orcpt: str = ""
    notify: str = ""


@dataclass
class IncomingEnvelope:
    mail_from: str
    recipients: list[IncomingRecipient]
    body_type: str = ""
    smtputf8: bool = False
    ret: str = ""
    envid: str = ""
    declared_size: int | None = None
    client_address: str | None = None
    client_helo: str = ""
    client_name: str = ""
    protocol: str = "ESMTP"  # RFC 3848 with-keyword: SMTP, ESMTP, ESMTPS, UTF8SMTPS...
    source: str = MessageSource.SMTP
    extra: dict[str, str] = field(default_factory=dict)


def new_qid() -> str:
    """A 14-character queue id: 45 bits of milliseconds, then 25 random bits."""
    value = ((int(time.time() * 1000) & (2**45 - 1)) << 25) | secrets.randbits(25)
    chars = []
    for _ in range(14):
        value, digit = divmod(value, len(_B32))
        chars.append(_B32[digit])
    return "".join(reversed(chars))


def printable(text: str) -> str:
    """Client-supplied text made safe for a text column and a header: undecodable
    bytes (surrogate escapes), NUL and other control characters replaced."""
    clean = text.encode("utf-8", "replace").decode("utf-8")
    return "".join(c if c.isprintable() else "?" for c in clean)


def recipient_domain(address: str) -> str:
    return address.rpartition("@")[2].rstrip(".").lower()


def _received_header(env: IncomingEnvelope, qid: str, when: str) -> bytes:
    helo = printable(env.client_helo) or "unknown"
    peer = f"{env.client_name or 'unknown'} [{env.client_address or 'unknown'}]"
    line = (
        f"Received: from {helo} ({peer})\r\n"
        f"\tby {settings.MAILRELAY_HOSTNAME} (mailrelay) with {env.protocol} id {qid}"
    )
    if len(env.recipients) == 1:
        line += f"\r\n\tfor <{env.recipients[0].address}>"
    return (line + f"; {when}\r\n").encode("utf-8", "surrogateescape")


def build_stored_bytes(env: IncomingEnvelope, data: bytes, qid: str) -> tuple[bytes, str, str]:
    """Prepend our Received header (and a Message-ID when missing).

    Returns the bytes to store, the Message-ID and the Subject.
    """
    info = inspect_headers(data)
    when = format_datetime(clock.now())
    prefix = _received_header(env, qid, when)
    message_id = info.message_id
    if not message_id:
        message_id = f"<{qid}.{int(time.time())}@{settings.MAILRELAY_HOSTNAME}>"
        prefix += f"Message-ID: {message_id}\r\n".encode("ascii", "replace")
    return prefix + data, message_id, info.subject


def message_accept(env: IncomingEnvelope, data: bytes) -> Message:
    """Store a message and one row per recipient in one transaction.

    The caller replies 250 only after this returns: the commit has happened.
    """
    now = clock.now()
    qid = new_qid()
    stored, message_id, subject = build_stored_bytes(env, data, qid)
    message = Message(
        qid=qid,
        state=MessageState.SUBMISSION,
        source=env.source,
        mail_from=env.mail_from,
        body_type=env.body_type,
        smtputf8=env.smtputf8,
        ret=env.ret,
        envid=env.envid,
        declared_size=env.declared_size,
        client_address=env.client_address,
        client_helo=printable(env.client_helo)[:255],
        data=stored,
        size=len(stored),
        message_id=message_id,
        subject=subject,
        received_at=now,
        expires_at=now + settings.MAILRELAY_MESSAGE_EXPIRATION_TIMEOUT,
        next_attempt_at=now,
    )
    recipients = [
        Recipient(
            address=rcpt.address,
            domain=recipient_domain(rcpt.address),
            orcpt=rcpt.orcpt,
            notify=rcpt.notify,
            state=RecipientState.SUBMITTED,
            next_attempt_at=now,
        )
        for rcpt in env.recipients
    ]
    # One statement (one transaction) for the message and all its recipients.
    insert_with_children(message, recipients, "message")
    return message
