"""Reading a stored message's bytes without loading them whole.

Bodies are up to tens of megabytes, and most readers want only part of one
(a report quotes the header block) or can pass it on piece by piece (an
export). Both read with ``SUBSTRING`` on the server: PostgreSQL detoasts only
the chunks a slice needs, so a prefix costs its own length, not the body's,
and Python holds one piece at a time. The one place these queries are written.
"""

from __future__ import annotations

from collections.abc import Iterator

from django.db import models
from django.db.models.functions import Length, Substr

from queues.models import Message


def _slice(start: int, length: int) -> Substr:
    # SUBSTRING counts from 1.
    return Substr("data", start + 1, length, output_field=models.BinaryField())


def body_prefix(message_id: int, length: int) -> bytes:
    """The first ``length`` octets of a stored message (all of it when shorter).

    Raises ``Message.DoesNotExist`` when the message is gone."""
    return bytes(Message.objects.values_list(_slice(0, length), flat=True).get(pk=message_id))


def body_size(message_id: int) -> int | None:
    """The length of a stored message in octets (PostgreSQL reads it from the
    TOAST header, not the body); None when the message is gone."""
    return Message.objects.filter(pk=message_id).values_list(Length("data"), flat=True).first()


def body_pieces(message_id: int, piece: int) -> Iterator[bytes]:
    """A stored message's bytes in pieces of ``piece`` octets, each read from the
    database when the consumer asks for it; nothing when the message is gone.

    Stored bytes never change, so the pieces of one message always fit
    together; a message removed half-way ends early (the caller's lookup
    decided it existed)."""
    start = 0
    while True:
        data = Message.objects.filter(pk=message_id).values_list(_slice(start, piece), flat=True)
        part = data.first()
        if part is None:
            return
        size = len(part)
        yield bytes(part)
        # Dropped before the next read: one piece alive at a time, not two.
        del part
        if size < piece:
            return
        start += size
