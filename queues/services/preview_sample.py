"""The first messages a bulk action would touch (Exchange's -WhatIf lists them):
id, queue id, sender, recipients, queue and age, beside the preview's counts.

One query for the messages (the action's own selection, oldest first: the
order the action works in) and one for their recipients.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from django.db.models import QuerySet

from queues.models import Message, Recipient

SAMPLE_SIZE = 10
SAMPLE_RECIPIENTS = 3  # addresses named per message (the rest: "+N")


def sample(selected: QuerySet[Message], now: datetime, size: int = SAMPLE_SIZE) -> list[dict]:
    """The first ``size`` messages of ``selected`` (by id), as plain dicts."""
    rows = list(selected.order_by("id").values("id", "qid", "mail_from", "received_at")[:size])
    if not rows:
        return []
    by_message: dict[int, list[tuple[str, str]]] = {row["id"]: [] for row in rows}
    recipients = (
        Recipient.objects.filter(message_id__in=list(by_message))
        .order_by("message_id", "id")
        .values_list("message_id", "address", "queue__name")
    )
    for message_id, address, queue in recipients:
        by_message[message_id].append((address, queue or ""))
    out: list[dict[str, Any]] = []
    for row in rows:
        rcpts = by_message[row["id"]]
        queues = sorted({queue for _, queue in rcpts if queue})
        out.append(
            {
                "id": row["id"],
                "qid": row["qid"],
                "sender": row["mail_from"] or "<>",
                "recipients": [address for address, _ in rcpts[:SAMPLE_RECIPIENTS]],
                "more_recipients": max(len(rcpts) - SAMPLE_RECIPIENTS, 0),
                "queues": queues or ["Submission"],
                "age_seconds": max(int((now - row["received_at"]).total_seconds()), 0),
            }
        )
    return out


def sample_lines(rows: list[dict]) -> list[str]:
    """The sample as the command prints it: one line per message."""
    lines = []
    for row in rows:
        rcpts = ", ".join(row["recipients"])
        if row["more_recipients"]:
            rcpts += f" +{row['more_recipients']}"
        lines.append(
            f"{row['id']:>8} {row['qid']:16} {age_words(row['age_seconds']):>6} "
            f"{'/'.join(row['queues'])[:24]:24} <{row['sender'].strip('<>')}> → {rcpts}"
        )
    return lines


def age_words(seconds: int) -> str:
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds // size}{unit}"
    return f"{seconds}s"


__all__ = ["SAMPLE_SIZE", "age_words", "sample", "sample_lines"]
