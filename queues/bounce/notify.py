"""Delivery status notifications: the one place a DSN is decided and queued.

Called inside the transaction that makes recipients final (or delayed), so a
message is never finished without the reports it owes being committed.

Bodies are large and a report rarely needs one: ``notify`` takes a message
loaded without its body (``.defer("data")``) and reads from PostgreSQL only
what the report returns, when it builds it: the whole original when it goes
back in full, else only its header block, read in growing prefixes
(``original_header_block``). This module is the only place reports read
originals; nothing here touches ``Message.data``, which would load the body.
"""

from __future__ import annotations

from collections.abc import Iterable
from datetime import datetime

from django.db import transaction
from django.dispatch import Signal

from queues.accept import IncomingEnvelope, IncomingRecipient, message_accept
from queues.bodies import body_prefix
from queues.bounce import dsn
from queues.config import store_settings
from queues.lib import clock
from queues.models import Message, MessageSource, Recipient
from queues.signals import categorizer_work

# Sent in the caller's transaction when a report was queued (message tracking
# records it): kwargs kind, message, recipients, report, now.
dsn_sent = Signal()

ACTION_BY_KIND = {dsn.FAILURE: "failed", dsn.DELAY: "delayed", dsn.SUCCESS: "relayed"}

# Reading a header block: a first prefix that holds almost every message's
# headers, then larger ones; past the cap the headers are cut at a line end
# (a message with a megabyte of header fields gets the first megabyte back).
HEADER_READ_FIRST = 16 * 1024
HEADER_READ_GROWTH = 8
HEADER_READ_CAP = 1024 * 1024


def original_header_block(message_id: int) -> bytes:
    """The header block of a stored message, without reading its body."""
    length = HEADER_READ_FIRST
    while True:
        prefix = body_prefix(message_id, length)
        block = dsn.header_block_in(prefix, whole=len(prefix) < length)
        if block is not None:
            return block
        if length >= HEADER_READ_CAP:
            return dsn.truncated_header_block(prefix)
        length = min(length * HEADER_READ_GROWTH, HEADER_READ_CAP)


def original_data(message_id: int) -> bytes:
    """The whole stored message (for a report that returns it in full)."""
    return bytes(Message.objects.values_list("data", flat=True).get(pk=message_id))


def _diagnostic(r: Recipient) -> str:
    if r.last_code is None:
        return ""
    return " ".join(p for p in (str(r.last_code), r.last_enhanced, r.last_text) if p)


def _status(kind: str, r: Recipient, expired: bool) -> str:
    if kind == dsn.SUCCESS:
        return "2.0.0"
    if expired:
        return "4.4.7"  # RFC 3463: delivery time expired
    return r.last_enhanced or ("5.0.0" if kind == dsn.FAILURE else "4.0.0")


def notify(
    kind: str,
    message: Message,
    recipients: Iterable[Recipient],
    *,
    now: datetime | None = None,
    reason: str = "",
    expired: bool = False,
) -> Message | None:
    """Queue one ``kind`` report about ``recipients`` of ``message`` to its sender.

    Steps:
    1. never for the null sender nor for a report (no bounce of a bounce);
    2. keep the recipients whose NOTIFY asks for this kind (RFC 3461);
    3. read what the report returns (RFC 3461 RET, MAILRELAY_MAX_DSN_SIZE):
       the whole original, or only its header block; never a report about
       a report (a foreign one is recognised by its header);
    4. build the RFC 3464 report (queues.bounce.dsn) and accept it as a new message
       from <> to the original sender, in the caller's transaction;
    5. after commit, ring the categorizer.
    Returns the report's Message, or None when none is owed.

    ``message`` may be, and should be, loaded without its body
    (``Message.objects.defer("data")``): its ``data`` is never touched; the
    fields used are pk, qid, mail_from, source, envid, ret, size, smtputf8,
    received_at and expires_at. ``recipients`` need address, orcpt, notify
    and the ``last_*`` fields.
    """
    now = now or clock.now()
    if message.mail_from == "" or message.source == MessageSource.DSN:
        return None
    wanted = [r for r in recipients if dsn.dsn_wanted(kind, r.notify, message.mail_from)]
    if not wanted:
        return None
    # The original lives only while the report is built; then the report alone.
    report = _report(kind, message, wanted, now, reason, expired)
    if report is None:
        return None
    transport = dsn.dsn_transport(report)
    created = message_accept(
        IncomingEnvelope(
            mail_from="",
            recipients=[IncomingRecipient(message.mail_from)],
            body_type=transport.body_type,
            smtputf8=transport.smtputf8,
            client_helo=store_settings().hostname,
            protocol="local",
            source=MessageSource.DSN,
            dkim_sign=True,  # ours: the relay vouches for its own reports
        ),
        report,
    )
    dsn_sent.send(
        sender=None, kind=kind, message=message, recipients=wanted, report=created, now=now
    )
    transaction.on_commit(lambda: categorizer_work.send(sender=None))
    return created


def _report(
    kind: str,
    message: Message,
    wanted: list[Recipient],
    now: datetime,
    reason: str,
    expired: bool,
) -> bytes | None:
    """The report's bytes, or None when the original is itself a report."""
    original = _original(kind, message)
    if dsn.is_dsn(original.data):
        return None
    lines = [
        dsn.DsnRecipient(
            address=r.address,
            orcpt=r.orcpt,
            action=ACTION_BY_KIND[kind],
            status=_status(kind, r, expired),
            remote_mta=r.last_host,
            diagnostic_code=_diagnostic(r),
            last_attempt_at=r.last_attempt_at,
            will_retry_until=message.expires_at if kind == dsn.DELAY else None,
            reason=reason or ("" if r.last_code is not None else r.last_text),
        )
        for r in wanted
    ]
    config = store_settings()
    return dsn.build_dsn(
        kind,
        original,
        lines,
        reporting_mta=config.hostname,
        now=now,
        max_dsn_size=config.max_dsn_size,
        postmaster=config.postmaster or None,
    )


def _original(kind: str, message: Message) -> dsn.DsnOriginal:
    """The original as the report needs it: whole when it goes back in full,
    else its header block with the size of the whole."""
    full = dsn.returns_full(kind, message.ret, message.size, store_settings().max_dsn_size)
    if full:
        data, size = original_data(message.pk), None
    else:
        data, size = original_header_block(message.pk), message.size
    return dsn.DsnOriginal(
        qid=message.qid,
        mail_from=message.mail_from,
        envid=message.envid,
        ret=message.ret,
        received_at=message.received_at,
        data=data,
        smtputf8=message.smtputf8,
        size=size,
    )


def ndr_for(message_id: int, recipient_ids: list[int], reason: str = "") -> Message | None:
    """A non-delivery report for these recipients (operator removal with NDR)."""
    message = Message.objects.defer("data").get(pk=message_id)
    recipients = list(Recipient.objects.filter(message_id=message_id, id__in=recipient_ids))
    return notify(dsn.FAILURE, message, recipients, reason=reason)
