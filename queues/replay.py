"""Exchange's replay format: the envelope in leading X-Sender / X-Receiver header lines.

Pure and standard-library only: export (``replay_format``) and the split of a
replay file into its envelope lines and the message (``split_injected``).
Parsing the addresses and parameters is ``delivery.pickup.parse``'s job.

A replay file::

    X-Sender: <sender@example.org> BODY=8BITMIME RET=HDRS ENVID=QQ314159
    X-Receiver: <rcpt@example.net> NOTIFY=SUCCESS,FAILURE ORCPT=rfc822;rcpt@example.net
    X-Receiver: <other@example.com>
    Received: from ...          <- the message, exactly as stored
    ...
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

X_SENDER = "x-sender"
X_RECEIVER = "x-receiver"
# Exchange's own exports carry more injected X-headers (X-CreatedBy,
# X-HeloDomain, X-ExtendedMessageProps, ...) and close them with this one;
# everything up to it is envelope, not message.
X_END_OF_INJECTED = "x-endofinjectedxheaders"


def _text(value: str) -> bytes:
    # Addresses and xtext are ASCII unless SMTPUTF8, when they are UTF-8 (RFC 6531).
    return value.encode("utf-8", "surrogateescape")


def replay_format(message: Any, recipients: Iterable[Any]) -> bytes:
    """A message in replay format: X-Sender, one X-Receiver per recipient, the stored bytes.

    ``replay_envelope`` and then ``message.data``; an export that streams the
    body calls ``replay_envelope`` and sends the stored bytes after it.
    """
    return replay_envelope(message, recipients) + bytes(message.data)


def replay_envelope(message: Any, recipients: Iterable[Any]) -> bytes:
    """The lines a replay file puts before the stored bytes: X-Sender, then one
    X-Receiver per recipient, each ending in CRLF.

    ``message`` has ``mail_from``, ``body_type``, ``smtputf8``, ``ret`` and
    ``envid`` (a ``queues.models.Message``; ``data`` is not read); ``recipients`` have ``address``,
    ``notify`` and ``orcpt`` — pass the ones still to deliver (not final), e.g.
    ``message.recipients.exclude(state__in=FINAL_RECIPIENT_STATES)``.
    Pure: reads those attributes and nothing else. Raises ValueError when
    there is no recipient (a replay file without X-Receiver is bad).
    """
    sender = f"<{message.mail_from or ''}>"
    params = []
    if message.body_type:
        params.append(f"BODY={message.body_type}")
    if message.smtputf8:
        params.append("SMTPUTF8")
    if message.ret:
        params.append(f"RET={message.ret}")
    if message.envid:
        params.append(f"ENVID={message.envid}")
    lines = [b"X-Sender: " + _text(" ".join([sender, *params]))]
    for r in recipients:
        rparams = []
        if r.notify:
            rparams.append(f"NOTIFY={r.notify}")
        if r.orcpt:
            rparams.append(f"ORCPT={r.orcpt}")
        lines.append(b"X-Receiver: " + _text(" ".join([f"<{r.address}>", *rparams])))
    if len(lines) == 1:
        raise ValueError("no recipient left to replay")
    return b"\r\n".join(lines) + b"\r\n"


def split_injected(fields: list[tuple[str, bytes]]) -> int:
    """How many leading header fields are replay envelope lines.

    ``fields`` are (lower-case name, raw bytes) of the header block in
    order. The envelope is every field up to and including an
    X-EndOfInjectedXHeaders field preceded by X- fields only (an Exchange
    export), else the leading run of X-Sender and X-Receiver fields.
    """
    names = [name for name, _ in fields]
    if X_END_OF_INJECTED in names:
        end = names.index(X_END_OF_INJECTED) + 1
        if all(name.startswith("x-") for name in names[:end]):
            return end
    count = 0
    for name in names:
        if name not in (X_SENDER, X_RECEIVER):
            break
        count += 1
    return count
