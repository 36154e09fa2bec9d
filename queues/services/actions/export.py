"""Export of stored messages: .eml, or a zip of many, read in pieces."""

from __future__ import annotations

import itertools
import tempfile
import zipfile
from collections.abc import Iterator, Mapping, Sequence
from typing import IO, Any

from django.db.models import QuerySet

from queues import bodies
from queues.models import (
    FINAL_RECIPIENT_STATES,
    Message,
)
from queues.replay import replay_envelope
from queues.services.action_errors import ActionConflict, ActionTooLarge
from queues.services.actions.common import (
    EXPORT_PIECE,
    EXPORT_SPOOL,
    MAX_EXPORT,
    ZIP_WRITE,
    Actor,
    Via,
    _audit,
)

EXPORT_FORMS = ("received", "sent")


def _check_form(form: str) -> None:
    if form not in EXPORT_FORMS:
        raise ValueError(f"unknown export form {form!r} (received or sent)")


def message_export_pieces(
    message: Message,
    fmt: str = "eml",
    actor: Actor | None = None,
    via: str | None = None,
    form: str = "received",
) -> Iterator[bytes]:
    """The message exactly as stored (the received bytes behind our Received
    header), as an iterator of pieces read from the database as it is consumed.

    ``form="sent"`` is what leaves for the next hop: the header fields added
    for sending (``Message.signature``, a DKIM-Signature) before the stored
    bytes; ``"received"`` (the default) leaves them out.

    ``fmt="replay"`` puts Exchange's replay envelope first (X-Sender, one
    X-Receiver per recipient still to deliver), so the file can be dropped in
    the replay folder (suspend, export, copy into Replay). With an ``actor``
    the export is written to the audit log (message bodies are personal data:
    who read which one is worth knowing). The format is checked and the audit
    written now, before the first piece; ``message`` may be loaded without
    its body (``.defer("data")``): the body is never loaded whole.
    """
    if fmt not in ("eml", "replay"):
        raise ValueError(f"unknown export format {fmt!r} (eml or replay)")
    _check_form(form)
    head: tuple[bytes, ...] = ()
    if fmt == "replay":
        pending = message.recipients.exclude(state__in=FINAL_RECIPIENT_STATES).order_by("id")
        try:
            head = (replay_envelope(message, pending),)
        except ValueError as exc:
            raise ActionConflict(f"message {message.qid}: {exc}") from None
    if form == "sent" and message.signature:
        head += (bytes(message.signature),)
    if actor is not None:
        _audit(actor, via or Via.API, "message_export", "message", ids=[message.pk], count=1)
    return itertools.chain(head, bodies.body_pieces(message.pk, EXPORT_PIECE))


def message_export_size(message: Message, fmt: str = "eml", form: str = "received") -> int | None:
    """How many octets ``message_export_pieces`` yields for an eml export (for a
    Content-Length), without reading the body; None for replay or when gone."""
    _check_form(form)
    if fmt != "eml" or (size := bodies.body_size(message.pk)) is None:
        return None
    return size + (len(message.signature) if form == "sent" else 0)


def message_export(
    message: Message,
    fmt: str = "eml",
    actor: Actor | None = None,
    via: str | None = None,
    form: str = "received",
) -> bytes:
    """``message_export_pieces`` joined: the whole export in memory (the CLI's
    file or standard output; the web exports stream the pieces instead)."""
    return b"".join(message_export_pieces(message, fmt, actor, via, form))


def _zip_write(entry: IO[bytes], data: bytes) -> None:
    view = memoryview(data)
    for start in range(0, len(view), ZIP_WRITE):
        entry.write(view[start : start + ZIP_WRITE])


def messages_export_zip(
    queryset: QuerySet[Message],
    out: IO[bytes],
    actor: Actor,
    via: str,
    *,
    ids: Sequence[int] = (),
    filter: Mapping[str, Any] | None = None,
    limit: int = MAX_EXPORT,
) -> int:
    """Write the selected messages into a zip (one ``<qid>.eml`` each) on ``out``.

    Bodies are read one message at a time, in pieces (``EXPORT_PIECE``) streamed
    into the zip entry, so memory does not grow with the messages' sizes; a
    message removed before its body is read is left out (stored bytes never
    change, so pieces of one message always fit together). Raises
    ActionTooLarge past ``limit`` messages. Returns how many it wrote.
    """
    count = queryset.count()
    if count > limit:
        raise ActionTooLarge(
            f"{count} messages match; export at most {limit} at once (narrow the filter)"
        )
    written = 0
    # At most ``limit`` small rows: the bodies are not part of this query.
    rows = list(queryset.order_by("id").values_list("id", "qid"))
    with zipfile.ZipFile(out, "w", compression=zipfile.ZIP_DEFLATED) as archive:
        for message_id, qid in rows:
            pieces = bodies.body_pieces(message_id, EXPORT_PIECE)
            first = next(pieces, None)
            if first is None:
                continue
            with archive.open(f"{qid}.eml", "w") as entry:
                _zip_write(entry, first)
                del first
                for data in pieces:
                    _zip_write(entry, data)
                    del data  # before the next piece is read
            written += 1
    _audit(actor, via, "messages_export", "message", ids=ids, filter=filter, count=written)
    return written


def messages_export_zip_file(
    queryset: QuerySet[Message],
    actor: Actor,
    via: str,
    *,
    ids: Sequence[int] = (),
    filter: Mapping[str, Any] | None = None,
    limit: int = MAX_EXPORT,
) -> IO[bytes]:
    """``messages_export_zip`` into a temporary file (in memory up to
    ``EXPORT_SPOOL``, then on disk), returned open at its start; the caller
    closes it (``FileResponse`` does, once it has sent it). Raises as
    ``messages_export_zip`` does, leaving no file behind."""
    out = tempfile.SpooledTemporaryFile(max_size=EXPORT_SPOOL)  # noqa: SIM115
    try:
        messages_export_zip(queryset, out, actor, via, ids=ids, filter=filter, limit=limit)
    except BaseException:
        out.close()
        raise
    out.seek(0)
    return out
