"""Alerts on age: a queue whose oldest waiting message is too old.

The threshold is ``MAILRELAY_ALERT_OLDEST_AGE`` (1h), or the queue's own in
``MAILRELAY_ALERT_OLDEST_AGE_QUEUES`` (by queue name; 0 turns it off). Past
the threshold the queue is in *warning* (the top bar turns amber), past twice
the threshold *critical* (red). The age is the queue row's oldest waiting
message (``Queue.oldest_received_at``, kept by the sweep's recount), so an
evaluation costs one query over the queues, never a count of messages.

``evaluate(now)`` compares that with the alerts raised before
(``AlertState``) and records every change as an Event (kind "alert"):
raised (warning or error level), changed level, cleared (info).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta

from django.db import connection, transaction

from insight.config import insight_settings
from insight.models import AlertState
from queues.models import DeliveryType, Event, EventLevel, Queue

KIND_AGE = "oldest_age"
WARNING, CRITICAL = "warning", "critical"
LEVEL_VALUES = {WARNING: 1, CRITICAL: 2}
CRITICAL_FACTOR = 2
_LOCK = 0x6D72_616C  # pg advisory lock: one evaluation at a time


def threshold_for(queue_name: str) -> timedelta | None:
    """The age alert threshold of a queue (None: no age alert for it)."""
    config = insight_settings()
    t = config.alert_oldest_age_queues.get(queue_name.lower(), config.alert_oldest_age)
    return t if t > timedelta(0) else None


@dataclass
class AgeCheck:
    queue_id: int
    queue_name: str
    delivery_type: str
    age: timedelta
    threshold: timedelta | None
    level: str | None  # None, warning, critical


def age_checks(now: datetime) -> list[AgeCheck]:
    """Every queue holding mail, its oldest age, threshold and level (no writes)."""
    out = []
    rows = (
        Queue.objects.filter(oldest_received_at__isnull=False)
        .exclude(delivery_type=DeliveryType.DEAD_LETTER)
        .values_list("id", "name", "delivery_type", "oldest_received_at")
    )
    for qid, name, dtype, oldest in rows:
        age = max(now - oldest, timedelta(0))
        threshold = threshold_for(name)
        level = None
        if threshold is not None and age >= threshold:
            level = CRITICAL if age >= CRITICAL_FACTOR * threshold else WARNING
        out.append(AgeCheck(qid, name, dtype, age, threshold, level))
    return out


def _key(queue_id: int) -> str:
    return f"age:queue:{queue_id}"


def _text(check: AgeCheck) -> str:
    return (
        f"Queue {check.queue_name}: oldest waiting message is "
        f"{int(check.age.total_seconds() // 60)} min old (alert at "
        f"{int(check.threshold.total_seconds() // 60) if check.threshold else 0} min)."
    )


def _event(now: datetime, level: str, text: str, queue_id: int | None, data: dict) -> Event:
    return Event(created_at=now, level=level, kind="alert", text=text, queue_id=queue_id, data=data)


def evaluate(now: datetime) -> list[AlertState]:
    """Raise, update and clear the age alerts; returns the alerts in force."""
    checks = {c.queue_id: c for c in age_checks(now)}
    events: list[Event] = []
    with transaction.atomic():
        if connection.vendor == "postgresql":
            with connection.cursor() as cursor:
                cursor.execute("SELECT pg_advisory_xact_lock(%s)", [_LOCK])
        current = {a.key: a for a in AlertState.objects.select_for_update().filter(kind=KIND_AGE)}
        for qid, check in checks.items():
            if check.level is None:
                continue
            key = _key(qid)
            data = {
                "queue": check.queue_name,
                "age_seconds": int(check.age.total_seconds()),
                "threshold_seconds": int(check.threshold.total_seconds()),
                "level": check.level,
            }
            ev_level = EventLevel.ERROR if check.level == CRITICAL else EventLevel.WARNING
            existing = current.pop(key, None)
            if existing is None:
                AlertState.objects.create(
                    key=key,
                    kind=KIND_AGE,
                    level=check.level,
                    queue_id=qid,
                    value=check.age.total_seconds(),
                    threshold=check.threshold.total_seconds(),
                    text=_text(check),
                    raised_at=now,
                    updated_at=now,
                )
                events.append(_event(now, ev_level, f"Alert raised: {_text(check)}", qid, data))
                continue
            if existing.level != check.level:
                events.append(
                    _event(now, ev_level, f"Alert now {check.level}: {_text(check)}", qid, data)
                )
            existing.level = check.level
            existing.value = check.age.total_seconds()
            existing.threshold = check.threshold.total_seconds()
            existing.text = _text(check)
            existing.updated_at = now
            existing.save()
        for gone in current.values():
            events.append(
                _event(
                    now,
                    EventLevel.INFO,
                    f"Alert cleared: {gone.text.split(':', 1)[0]} is within its age limit.",
                    gone.queue_id,
                    {"key": gone.key, "raised_at": gone.raised_at.isoformat()},
                )
            )
            gone.delete()
        Event.objects.bulk_create(events)
    return active()


def active() -> list[AlertState]:
    return list(AlertState.objects.select_related("queue").order_by("-level", "raised_at"))


def worst_level() -> tuple[str | None, int]:
    """(worst level in force, number of alerts) for the top bar: one small query."""
    levels = list(AlertState.objects.values_list("level", flat=True))
    if not levels:
        return None, 0
    return max(levels, key=lambda lv: LEVEL_VALUES.get(lv, 0)), len(levels)


def as_dict(alert: AlertState) -> dict:
    return {
        "key": alert.key,
        "kind": alert.kind,
        "level": alert.level,
        "queue": {"id": alert.queue_id, "name": alert.queue.name if alert.queue else None},
        "value_seconds": alert.value,
        "threshold_seconds": alert.threshold,
        "text": alert.text,
        "raised_at": alert.raised_at.isoformat(),
        "updated_at": alert.updated_at.isoformat(),
    }
