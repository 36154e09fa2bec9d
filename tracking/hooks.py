"""The receivers that record a message's life, from the queue store's signals
(connected in tracking.apps; the engine and the store import nothing of this app).

Each takes what the sender already holds and writes a batch of tracking rows
with at most one SELECT (the messages' envelope facts) and one INSERT, in the
sender's transaction (tracking.record):

- ``placed`` (signal ``recipients_placed``): the categorizer placed a batch
  (``received`` once per message on its first categorization, ``routed`` /
  ``failed`` / ``deferred`` per recipient);
- ``attempted`` (``attempts_recorded``): a delivery round's results (one row
  per attempt: ``delivered`` with the remote queue id, ``deferred`` or
  ``failed``);
- ``expired`` (``recipients_expired``): the sweep expired recipients;
- ``on_dsn_sent``: a DSN was queued (signal of queues.bounce.notify);
- ``on_audit``: an operator action (post_save of queues.models.AuditEntry).
"""

from __future__ import annotations

from collections.abc import Container, Iterable, Mapping
from datetime import datetime
from typing import Any

from queues.models import AuditEntry, DeliveryType, Link, Message, Queue, RecipientState
from queues.signals import PLACED_FACTS
from tracking import events
from tracking.record import new, write
from tracking.remote_id import remote_queue_id

_FACTS = ("id", "qid", "mail_from", "message_id")


def _facts(message_ids: Iterable[int]) -> dict[int, tuple[str, str, str]]:
    """qid, sender and Message-ID of each message (one SELECT)."""
    return {
        mid: (qid, sender, msgid)
        for mid, qid, sender, msgid in Message.objects.filter(id__any=set(message_ids)).values_list(
            *_FACTS
        )
    }


def _message_fields(facts: Mapping[int, tuple[str, str, str]], mid: int) -> dict[str, Any]:
    qid, sender, msgid = facts.get(mid, ("", "", ""))
    return {"message_pk": mid, "qid": qid, "sender": sender, "message_id": msgid}


def placed(
    placements: Mapping[str, Any], now: datetime, facts: Mapping[int, tuple] | None = None
) -> None:
    """After the categorizer decided a batch (queues.signals.recipients_placed).

    ``placements`` maps a domain to its decision: ``recipient_ids`` and either
    ``route`` (queue_name, link_name) or ``error`` (permanent, enhanced, text).
    ``facts``: the PLACED_FACTS of the recipients by id, when the caller has
    them (else one SELECT).
    """
    by_id: dict[int, tuple[str, Any]] = {}
    for domain, placement in placements.items():
        for rid in placement.recipient_ids:
            by_id[rid] = (domain, placement)
    if not by_id:
        return
    if facts is not None and all(rid in facts for rid in by_id):
        recipients = [facts[rid] for rid in by_id]
    else:
        from queues.models import Recipient

        recipients = list(Recipient.objects.filter(id__any=list(by_id)).values_list(*PLACED_FACTS))
    rows = []
    seen: set[int] = set()
    for rid, address, mid, qid, sender, msgid, client, account, size, rcvd, nxt, src in recipients:
        common = {"message_pk": mid, "qid": qid, "sender": sender, "message_id": msgid}
        # Received once: at the first categorization, the message is due at its arrival.
        if mid not in seen and nxt == rcvd:
            seen.add(mid)
            rows.append(
                new(
                    events.RECEIVED,
                    rcvd,
                    client=client or "",
                    account=account,
                    size=size,
                    detail={"source": src},
                    **common,
                )
            )
        domain, placement = by_id[rid]
        if placement.route is not None:
            rows.append(
                new(
                    events.ROUTED,
                    now,
                    recipient=address,
                    queue=placement.route.queue_name,
                    next_hop=placement.route.link_name,
                    **common,
                )
            )
            continue
        error = placement.error
        code = 550 if error.permanent else 451
        rows.append(
            new(
                events.FAILED if error.permanent else events.DEFERRED,
                now,
                recipient=address,
                host=domain,
                code=code,
                enhanced=error.enhanced,
                reply=f"{code} {error.enhanced} {error.text}",
                queue=(
                    DeliveryType.DEAD_LETTER if error.permanent else DeliveryType.UNREACHABLE
                ).label,
                detail={"phase": "route"},
                **common,
            )
        )
    write(rows)


def _tls(attempt: Any) -> str:
    if not attempt.tls_version:
        return ""
    verified = attempt.tls_verified if attempt.tls_verified not in ("", "none") else "unverified"
    return f"{attempt.tls_version} {attempt.tls_cipher} {verified}".strip()[:160]


def attempted(
    attempts: list[Any],
    rows: Mapping[int, Any],
    link: Link,
    now: datetime,
    facts: Mapping[int, tuple[str, str, str]] | None = None,
    owned: Container[int] | None = None,
    own_savepoint: bool = True,
) -> None:
    """After a delivery round wrote its attempts (queues.signals.attempts_recorded):
    ``attempts`` are its queues.models.Attempt objects, ``rows`` the round's
    recipients by id with their new state, ``owned`` the ids of those it could
    still write (None: all); ``facts``: qid, sender and
    Message-ID by message id when the caller has them (else one SELECT);
    ``own_savepoint`` False: a failed write may roll the caller's transaction
    back (it records another way then; tracking.record.write)."""
    if not attempts:
        return
    if facts is None or any(a.message_id not in facts for a in attempts):
        facts = _facts(a.message_id for a in attempts)
    out = []
    for a in attempts:
        row = rows.get(a.recipient_id)
        state = getattr(row, "state", None)
        if owned is not None and a.recipient_id not in owned:
            state = None
        if a.outcome == "delivered":
            event = events.DELIVERED
        elif state == RecipientState.FAILED:
            event = events.FAILED
        else:
            # Deferred; or the round lost its claim before recording (``row`` is
            # None): the recipient waits for its new owner, not failed.
            event = events.DEFERRED
        reply = " ".join(str(p) for p in (a.code or "", a.enhanced, a.text) if p)
        out.append(
            new(
                event,
                a.started_at or now,
                recipient=getattr(row, "address", ""),
                next_hop=link.name,
                host=a.host,
                ip=a.ip,
                tls=_tls(a),
                code=a.code,
                enhanced=a.enhanced,
                reply=reply,
                remote_id=remote_queue_id(a.text) if event == events.DELIVERED else "",
                detail={"phase": a.phase, "duration_ms": a.duration_ms}
                | ({"auth": a.auth_used} if a.auth_used else {})
                | (
                    {"retry_timeout": True}
                    if event == events.FAILED and a.outcome != "failed"
                    else {}
                ),
                **_message_fields(facts, a.message_id),
            )
        )
    write(out, own_savepoint=own_savepoint)


def expired(recipients: list[Any], now: datetime, reason: str) -> None:
    """After the sweep expired ``recipients`` (queues.signals.recipients_expired)."""
    facts = _facts(r.message_id for r in recipients)
    write(
        [
            new(
                events.EXPIRED,
                now,
                recipient=r.address,
                queue=DeliveryType.DEAD_LETTER.label,  # the queue's name (special_queue)
                reply=reason,
                **_message_fields(facts, r.message_id),
            )
            for r in recipients
        ]
    )


def on_placed(sender: object, **kwargs: Any) -> None:
    """queues.signals.recipients_placed: ``placed``."""
    placed(kwargs["placements"], kwargs["now"], kwargs.get("facts"))


def on_attempts_recorded(sender: object, **kwargs: Any) -> None:
    """queues.signals.attempts_recorded: ``attempted``."""
    attempted(
        kwargs["attempts"],
        kwargs["rows"],
        kwargs["link"],
        kwargs["now"],
        kwargs.get("facts"),
        owned=kwargs.get("owned"),
        own_savepoint=kwargs.get("own_savepoint", True),
    )


def on_expired(sender: object, **kwargs: Any) -> None:
    """queues.signals.recipients_expired: ``expired``."""
    expired(kwargs["recipients"], kwargs["now"], kwargs["reason"])


def on_dsn_sent(
    sender: object,
    kind: str,
    message: Message,
    recipients: list[Any],
    report: Message | None,
    now: datetime,
    **kwargs: object,
) -> None:
    """A DSN about ``recipients`` of ``message`` was queued (queues.bounce.notify)."""
    fields = {
        "message_pk": message.pk,
        "qid": message.qid,
        "sender": message.mail_from,
        "message_id": message.message_id,
    }
    detail = {"kind": kind, "dsn_qid": report.qid if report is not None else ""}
    write(
        [
            new(events.DSN_SENT, now, recipient=r.address, detail=detail, **fields)
            for r in recipients
        ]
    )


OPERATOR_TARGETS = ("message", "queue", "link")
CHUNK = 2000


def on_audit(sender: object, instance: AuditEntry, created: bool, **kwargs: object) -> None:
    """An operator action: one row per message (or queue, link) it changed or
    names, else one row."""
    if not created or instance.target_type not in OPERATOR_TARGETS:
        return
    entry = instance
    detail: dict[str, Any] = {"action": entry.action, "via": entry.via, "count": entry.count}
    if entry.detail:
        detail["text"] = entry.detail
    if entry.filter:
        detail["filter"] = entry.filter
    common = {"actor": entry.actor_name, "detail": detail}
    # The rows it changed when the action said (a bulk action by filter, or ids
    # of which some were skipped), else the ids it was given.
    ids = list(getattr(entry, "changed_ids", None) or entry.target_ids or [])
    if not ids:
        write([new(events.OPERATOR, entry.created_at, **common)])
        return
    for start in range(0, len(ids), CHUNK):
        chunk = ids[start : start + CHUNK]
        if entry.target_type == "message":
            facts = _facts(chunk)
            rows = [
                new(events.OPERATOR, entry.created_at, **_message_fields(facts, mid), **common)
                for mid in chunk
            ]
        else:
            model = Queue if entry.target_type == "queue" else Link
            names = dict(model.objects.filter(id__in=chunk).values_list("id", "name"))
            field = "queue" if entry.target_type == "queue" else "next_hop"
            rows = [
                new(events.OPERATOR, entry.created_at, **{field: names.get(i, str(i))}, **common)
                for i in chunk
            ]
        write(rows)
