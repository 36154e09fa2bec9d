"""Pure helpers for the header block of a stored message."""

from __future__ import annotations

import re
from dataclasses import dataclass
from email.header import decode_header, make_header

_HEADER_END = re.compile(rb"\r?\n\r?\n")


@dataclass(frozen=True)
class HeaderInfo:
    message_id: str
    subject: str
    received_count: int
    header_bytes: int


def header_block(data: bytes) -> bytes:
    match = _HEADER_END.search(data)
    return data[: match.start()] if match else data


def _unfolded_fields(block: bytes) -> list[tuple[str, str]]:
    fields: list[tuple[str, str]] = []
    for line in block.split(b"\n"):
        line = line.rstrip(b"\r")
        if line[:1] in (b" ", b"\t") and fields:
            name, value = fields[-1]
            fields[-1] = (name, value + " " + line.strip().decode("utf-8", "replace"))
            continue
        name, sep, value = line.partition(b":")
        if sep:
            fields.append(
                (
                    name.strip().decode("ascii", "replace").lower(),
                    value.strip().decode("utf-8", "replace"),
                )
            )
    return fields


def _decode_words(value: str) -> str:
    if "=?" not in value:
        return value
    try:
        return str(make_header(decode_header(value)))
    except Exception:  # noqa: BLE001 - a malformed encoded word is shown as-is
        return value


def inspect_headers(data: bytes) -> HeaderInfo:
    """Copy out what the queue store filters on: Message-ID, Subject, hop count."""
    block = header_block(data)
    message_id = subject = ""
    received = 0
    for name, value in _unfolded_fields(block):
        if name == "message-id" and not message_id:
            message_id = value[:998]
        elif name == "subject" and not subject:
            subject = _decode_words(value)[:998]
        elif name == "received":
            received += 1
    # Copied into text columns: PostgreSQL text cannot hold NUL.
    return HeaderInfo(
        message_id.replace("\x00", ""), subject.replace("\x00", ""), received, len(block)
    )
