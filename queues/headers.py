"""Pure helpers for the header block of a stored message."""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass
from email.header import decode_header, make_header
from email.utils import getaddresses

from queues.text import scrub_nul

# Where the header fields end: at the empty line after them; at a final line
# end or the end of the data when the message is all header; at once when it
# starts with an empty line (no header fields). LF alone counts as a line end.
_HEADER_END = re.compile(rb"\A\r?\n|\r?\n\r?\n|\r?\n\Z")
# The fields inspect_headers reads, with their continuation lines; a
# continuation line starts with a blank, so it never matches a field name.
_WANTED_FIELD = re.compile(
    rb"^(message-id|subject|received)[ \t]*:([^\n]*(?:\n[ \t][^\n]*)*)",
    re.IGNORECASE | re.MULTILINE,
)
# The fields that say who wrote a message (RFC 5322 3.6.2), with their continuations.
_AUTHOR_FIELD = re.compile(
    rb"^(from|sender)[ \t]*:([^\n]*(?:\n[ \t][^\n]*)*)", re.IGNORECASE | re.MULTILINE
)
# Where a header field ends and the next begins: a CRLF not followed by a blank.
_FIELD_BREAK = re.compile(rb"\r\n(?![ \t])")


@dataclass(frozen=True)
class HeaderInfo:
    message_id: str
    subject: str
    received_count: int
    header_bytes: int


def header_end(data: bytes | bytearray) -> int:
    """The length of the header block of ``data``: its fields, without the line
    end of the last one (all of ``data`` when it has neither an empty line nor
    a final line end). The one place a message is split into header and body."""
    match = _HEADER_END.search(data)
    return match.start() if match else len(data)


def header_block(data: bytes) -> bytes:
    """The header fields of ``data``, without the line end of the last one."""
    return data[: header_end(data)]


def _decode_words(value: str) -> str:
    if "=?" not in value:
        return value
    try:
        return str(make_header(decode_header(value)))
    except Exception:  # noqa: BLE001 - a malformed encoded word is shown as-is
        return value


def _wanted_fields(data: bytes | bytearray, end: int) -> Iterator[tuple[str, str]]:
    """(lower-case name, unfolded value) of the fields inspect_headers needs.

    Scans ``data`` up to ``end`` in place: a message may be all header (no
    empty line), and neither the block nor its lines are copied.
    """
    for match in _WANTED_FIELD.finditer(data, 0, end):
        first, *rest = match.group(2).split(b"\n")
        value = first.rstrip(b"\r").strip().decode("utf-8", "replace")
        for line in rest:
            value += " " + line.rstrip(b"\r").strip().decode("utf-8", "replace")
        yield match.group(1).decode("ascii").lower(), value


def inspect_headers(data: bytes | bytearray) -> HeaderInfo:
    """Copy out what the queue store filters on: Message-ID, Subject, hop count."""
    end = header_end(data)
    message_id = subject = ""
    received = 0
    for name, value in _wanted_fields(data, end):
        if name == "message-id" and not message_id:
            message_id = value[:998]
        elif name == "subject" and not subject:
            subject = _decode_words(value)[:998]
        elif name == "received":
            received += 1
    # Copied into text columns: PostgreSQL text cannot hold NUL.
    return HeaderInfo(scrub_nul(message_id, ""), scrub_nul(subject, ""), received, end)


def author_addresses(data: bytes | bytearray) -> list[tuple[str, str]]:
    """(field name, address) for every address of every From and Sender field
    of the header block, as ``getaddresses`` reads them (the same reading that
    picks the DKIM signing domain, ``queues.dkim.from_domain``). An empty
    address (``From: <>``, a group with no members) claims nothing and is left out."""
    found = []
    for match in _AUTHOR_FIELD.finditer(data, 0, header_end(data)):
        value = b" ".join(line.strip() for line in match.group(2).split(b"\n"))
        name = match.group(1).decode("ascii").capitalize()
        for _display, address in getaddresses([value.decode("utf-8", "replace")]):
            if address:
                found.append((name, address))
    return found


def header_shape_refusal(
    data: bytes | bytearray, max_fields: int, max_field_size: int
) -> tuple[str, int] | None:
    """("fields", limit) when the header block has more than ``max_fields``
    fields, ("size", limit) when one field (its folded lines together, without
    its final CRLF) is longer than ``max_field_size`` bytes; else None (0 = no
    limit). Read in place, in one pass that stops at the first excess; a usual
    header (fewer lines than the field limit, shorter than the size limit)
    costs one count of its line ends."""
    end = header_end(data)
    if not end:
        return None
    lines = data.count(b"\n", 0, end) + 1
    if (not max_fields or lines <= max_fields) and (not max_field_size or end <= max_field_size):
        return None
    fields, start = 1, 0
    for match in _FIELD_BREAK.finditer(data, 0, end):
        if max_field_size and match.start() - start > max_field_size:
            return "size", max_field_size
        fields, start = fields + 1, match.end()
        if max_fields and fields > max_fields:
            return "fields", max_fields
    if max_field_size and end - start > max_field_size:
        return "size", max_field_size
    return None
