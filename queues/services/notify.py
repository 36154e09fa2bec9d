"""Delivery status notifications: the one place a DSN is decided and queued.

Called inside the transaction that makes recipients final (or delayed), so a
message is never finished without the reports it owes being committed.
"""

from __future__ import annotations

from collections.abc import Iterable
from datetime import datetime

from django.conf import settings
from django.db import transaction

from mailrelay import metrics
from queues import clock, dsn
from queues.models import Message, MessageSource, Recipient
from queues.services.accept import IncomingEnvelope, IncomingRecipient, message_accept
from queues.signals import categorizer_work

ACTION_BY_KIND = {dsn.FAILURE: "failed", dsn.DELAY: "delayed", dsn.SUCCESS: "relayed"}


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
    3. build the RFC 3464 report (queues.dsn) and accept it as a new message
       from <> to the original sender, in the caller's transaction;
    4. after commit, ring the categorizer.
    Returns the report's Message, or None when none is owed.
    """
    now = now or clock.now()
    if message.mail_from == "" or message.source == MessageSource.DSN:
        return None
    wanted = [r for r in recipients if dsn.dsn_wanted(kind, r.notify, message.mail_from)]
    if not wanted:
        return None
    data = bytes(message.data)
    if dsn.is_dsn(data):
        return None
    original = dsn.DsnOriginal(
        qid=message.qid,
        mail_from=message.mail_from,
        envid=message.envid,
        ret=message.ret,
        received_at=message.received_at,
        data=data,
        smtputf8=message.smtputf8,
    )
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
    report = dsn.build_dsn(
        kind,
        original,
        lines,
        reporting_mta=settings.MAILRELAY_HOSTNAME,
        now=now,
        max_dsn_size=settings.MAILRELAY_MAX_DSN_SIZE,
        postmaster=settings.MAILRELAY_POSTMASTER or None,
    )
    transport = dsn.dsn_transport(report)
    created = message_accept(
        IncomingEnvelope(
            mail_from="",
            recipients=[IncomingRecipient(message.mail_from)],
            body_type=transport.body_type,
            smtputf8=transport.smtputf8,
            client_helo=settings.MAILRELAY_HOSTNAME,
            protocol="local",
            source=MessageSource.DSN,
        ),
        report,
    )
    metrics.count_dsn(kind)
    transaction.on_commit(lambda: categorizer_work.send(sender=None))
    return created


def ndr_for(message_id: int, recipient_ids: list[int], reason: str = "") -> Message | None:
    """A non-delivery report for these recipients (operator removal with NDR)."""
    message = Message.objects.get(pk=message_id)
    recipients = list(Recipient.objects.filter(message_id=message_id, id__in=recipient_ids))
    return notify(dsn.FAILURE, message, recipients, reason=reason)
