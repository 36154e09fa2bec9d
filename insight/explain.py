"""Why is this recipient still waiting? One answer for the UI, the API and the CLI.

``explain_message(message, now)`` answers, for every recipient not yet final:

* the reasons it waits, most important first, each with a machine-readable
  ``code`` (see ``REASONS``), a sentence, and the facts behind it (who
  suspended it and until when, the link's counter and next retry, the host
  whose retry data skips it and the rule that matched, ...);
* the retry rule that applies — its line as written in the operator's file,
  or the rule compiled from the Exchange settings (``delivery.smtp.retry``);
* the last reply, and the projected schedule: the next tries, *computed by
  the rule engine* (``delivery.smtp.retryschedule.projected_schedule``), when the
  delay DSN goes, when the rule's final cutoff passes, when it expires;
* what an operator can do about it (retry now, resubmit, resume).

Cost: one message costs a handful of indexed queries (its recipients with
their queues and links, their last attempts, the retry data of its links'
hosts, the back-pressure rows only for a message still in Submission).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from datetime import datetime, timedelta
from typing import Any, NamedTuple

from django.db.models import Q

from delivery.qmgr.config import qmgr_settings
from delivery.smtp import retry
from delivery.smtp.retryrules import Rule, parse_rules
from delivery.smtp.retryschedule import projected_schedule
from insight.config import insight_settings
from queues.config import store_settings
from queues.lib import DSN_DELAY, dsn_wanted, format_duration
from queues.models import (
    FINAL_RECIPIENT_STATES,
    Attempt,
    DeliveryType,
    Link,
    LinkState,
    Message,
    MessageState,
    Queue,
    Recipient,
    RecipientState,
    RetryHint,
)

#: Every reason code explain can give, and what it means.
REASONS: dict[str, str] = {
    "in_flight": "a delivery round holds it right now",
    "message_suspended": "the message is suspended",
    "poison": "the message crashed workers and is parked in Poison",
    "queue_suspended": "its queue is suspended",
    "submission": "waiting for the categorizer",
    "categorizing": "the categorizer is routing it now",
    "backpressure": "back pressure: the Submission queue is under pressure",
    "unreachable": "no route: the categorizer tries again later",
    "shaping": "a traffic-shaping limit holds its queue",
    "link_retry": "its link is in glitch, transient or Retry after connection failures",
    "host_retry": "a host of its link is skipped by its retry data",
    "problem_message": "a problem message: per-message failures, retried at the message interval",
    "recipient_retry": "a temporary failure of this recipient: waiting for its next try",
    "rerouted": "its queue is re-routed to another next hop",
    "due": "due now: waiting for a delivery round",
}

SCHEDULE_SHOWN = 6
PRESSURE_LEVELS = ("medium", "high")


@dataclass
class Reason:
    code: str
    text: str
    data: dict[str, Any] = field(default_factory=dict)


@dataclass
class Action:
    name: str  # retry / resubmit / resume
    target: str  # queue / message
    label: str
    api: str  # POST here
    ui: str  # POST here (the Queue Viewer's form action)


@dataclass
class RecipientExplain:
    recipient_id: int
    address: str
    state: str
    queue: dict[str, Any] | None
    reason: str  # the first reason's code ("" for a final recipient)
    reasons: list[Reason]
    rule: dict[str, Any] | None
    last_reply: dict[str, Any] | None
    next_try_at: datetime | None
    schedule: list[dict[str, Any]]
    delay_dsn_at: datetime | None
    final_cutoff_at: datetime | None
    expires_at: datetime
    actions: list[Action]


@dataclass
class MessageExplain:
    id: int
    qid: str
    state: str
    now: datetime
    summary: str
    recipients: list[RecipientExplain]

    def as_dict(self) -> dict[str, Any]:
        return _jsonable(asdict(self))


def _jsonable(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_jsonable(v) for v in value]
    if isinstance(value, datetime):
        return value.isoformat()
    if isinstance(value, timedelta):
        return format_duration(value)
    return value


# --- the rule engine, asked (never re-implemented) ---------------------------------------


def _compiled_count() -> int:
    return len(parse_rules(retry.exchange_rules_text()).rules)


def rule_info(rule: Rule | None) -> dict[str, Any] | None:
    """A rule as the operator reads it: its line as written, or the compiled rule."""
    if rule is None:
        return None
    active = retry.rules()
    compiled = list(active.rules).index(rule) >= len(active.rules) - _compiled_count()
    return {
        "text": rule.text,
        "line": None if compiled else rule.line,
        "source": "compiled from the Exchange settings"
        if compiled
        else active.source.removesuffix(" + Exchange settings"),
        "error": str(rule.error),
        "params": rule.params_text,
        "final_cutoff": rule.final_cutoff
        if rule.final_cutoff is not None and rule.final_cutoff < retry.FOREVER
        else None,
    }


def find_rule(address: str, *, error: str = "", host: str | None = None, sender: str | None = None):
    """The rule ``delivery.smtp.retry.decide`` applies to this failure (same search)."""
    active = retry.rules()
    found = active.find(address, host=host, error=error or None, sender=sender)
    if found is None and error:
        found = active.find(address, host=host, error=None, sender=sender)
    return found


def schedule_after(
    rule: Rule | None, first_failed: datetime | None, now: datetime, until: datetime
) -> tuple[list[datetime], datetime | None]:
    """The next tries after ``now`` (the rule engine's projection from the first
    failure), and when the rule's final cutoff passes (None: never, or no rule)."""
    if rule is None or first_failed is None or not rule.params:
        return [], None
    tries = projected_schedule(rule, first_failed, until, options=retry.rules().options)
    upcoming = [t.at for t in tries if t.at > now][:SCHEDULE_SHOWN]
    cutoff = rule.final_cutoff
    cutoff_at = first_failed + cutoff if cutoff is not None and cutoff < retry.FOREVER else None
    return upcoming, cutoff_at


# --- the facts --------------------------------------------------------------------------


def _link_counter(link: Link) -> str:
    """Which of Exchange's counters the link is on: glitch, transient or retry."""
    config = insight_settings()
    glitch, transient = config.glitch_retry_count, config.transient_failure_retry_count
    if link.failure_count <= glitch:
        return "glitch"
    if link.failure_count <= glitch + transient:
        return "transient"
    return "retry"


def _host_hints(links: list[Link], now: datetime) -> dict[int, list[RetryHint]]:
    """Retry data of every host of these links whose retry time has not come."""
    names: dict[str, list[int]] = {}
    for link in links:
        for h in link.hosts or []:
            host = str(h.get("host", "")).lower().rstrip(".")
            if host:
                names.setdefault(host, []).append(link.pk)
    if not names:
        return {}
    cond = Q()
    for host in names:
        cond |= Q(key=f"T:{host}") | Q(key__startswith=f"T:{host}:")
    out: dict[int, list[RetryHint]] = {}
    for hint in RetryHint.objects.filter(cond, next_try__gt=now).order_by("key"):
        host = hint.key[2:].split(":", 1)[0]
        for link_id in names.get(host, []):
            out.setdefault(link_id, []).append(hint)
    return out


def _last_attempts(message: Message) -> dict[int, Attempt]:
    out: dict[int, Attempt] = {}
    rows = Attempt.objects.filter(message=message).order_by("recipient_id", "-started_at", "-id")
    for a in rows.only("recipient_id", "phase", "code", "enhanced", "text", "host", "started_at"):
        out.setdefault(a.recipient_id, a)
    return out


def _pressure() -> list[dict[str, Any]]:
    from delivery.models import ResourcePressure

    rows = ResourcePressure.objects.filter(level__in=PRESSURE_LEVELS).order_by("node", "resource")
    return [
        {
            "node": r.node,
            "resource": r.resource,
            "level": r.level,
            "reading": r.reading,
            "threshold": r.high if r.level == "high" else r.medium,
            "action": r.action,
        }
        for r in rows
    ]


def shaping_limit(
    queue: Queue, now: datetime, cache: dict[int, dict[str, Any] | None] | None = None
) -> dict[str, Any] | None:
    """Reason "shaping": the traffic-shaping limit holding ``queue``'s link now
    (``insight.shaping.link_hold``: entry, which limit, its effective value,
    when it frees, and the sentence), else None. ``cache``: per link, so the
    recipients of one message on one link cost one Redis round trip."""
    if not queue.link_id:
        return None
    if cache is not None and queue.link_id in cache:
        return cache[queue.link_id]
    from insight.shaping import link_hold

    hold = link_hold(queue.link, now)
    found = hold.as_data() if hold is not None else None
    if cache is not None:
        cache[queue.link_id] = found
    return found


def _who_until(by: str, until: datetime | None) -> str:
    parts = []
    if by:
        parts.append(f"by {by}")
    parts.append(f"until {until.isoformat()}" if until else "until resumed by hand")
    return " ".join(parts)


# --- the answer -------------------------------------------------------------------------


def _actions(reasons: list[Reason], message: Message, queue: Queue | None) -> list[Action]:
    codes = {r.code for r in reasons}
    out: list[Action] = []

    def add(name: str, target: str, label: str, pk: int) -> None:
        plural = "queues" if target == "queue" else "messages"
        out.append(
            Action(name, target, label, f"/api/v1/{plural}/{pk}/{name}/", f"/{plural}/{pk}/{name}/")
        )

    if codes & {"message_suspended", "poison"}:
        add("resume", "message", "Resume the message", message.pk)
    if queue is not None and "queue_suspended" in codes:
        add("resume", "queue", "Resume the queue", queue.pk)
    retryable = {"link_retry", "host_retry", "problem_message", "recipient_retry"}
    if queue is not None and codes & retryable and not codes & {"queue_suspended"}:
        add("retry", "queue", "Retry the queue now", queue.pk)
    if codes & (retryable | {"unreachable", "poison", "rerouted"}):
        add("resubmit", "message", "Resubmit the message to the categorizer", message.pk)
    return out


# --- one recipient, step by step ---------------------------------------------------------


class _Retry(NamedTuple):
    """A retry step's reason and what it settles: the rule that applies, the
    first failure its schedule counts from, and the next try."""

    reason: Reason
    rule: Rule | None
    first_failed: datetime | None
    next_try: datetime


def _in_flight(r: Recipient) -> Reason | None:
    """Reason "in_flight": a delivery round holds the recipient's lease."""
    if r.state != RecipientState.ACTIVE:
        return None
    lease = store_settings().lease
    since = r.lease_until - lease if r.lease_until else None
    return Reason(
        "in_flight",
        f"In flight on worker {r.lease_owner or '?'}"
        + (f" since about {since.isoformat()}" if since else "")
        + ".",
        {"worker": r.lease_owner, "since": since, "lease_until": r.lease_until},
    )


def _message_held(message: Message, queue: Queue | None) -> Reason | None:
    """Reason "poison" (suspended and parked in Poison) or "message_suspended"."""
    if not message.suspended:
        return None
    if queue is not None and queue.delivery_type == DeliveryType.POISON:
        return Reason(
            "poison",
            f"Parked in Poison after crashing workers {message.crash_count} time(s).",
            {"crash_count": message.crash_count},
        )
    by, until = message.suspended_by, message.suspended_until
    return Reason(
        "message_suspended",
        f"The message is suspended {_who_until(by, until)}.",
        {"by": by, "until": until},
    )


def _submission(
    r: Recipient, message: Message, pressure: list[dict[str, Any]] | None, now: datetime
) -> tuple[list[Reason], datetime | None]:
    """A recipient still in Submission: being categorized, waiting for the
    categorizer's next try (returned as the next try), or due (after any back
    pressure holding the relay behind)."""
    if r.state != RecipientState.SUBMITTED:
        return [], None
    if message.state == MessageState.CATEGORIZING:
        return [
            Reason(
                "categorizing",
                f"The categorizer {message.lease_owner or '?'} is routing it now.",
                {"worker": message.lease_owner, "lease_until": message.lease_until},
            )
        ], None
    if message.next_attempt_at > now:
        next_try = message.next_attempt_at
        return [
            Reason(
                "submission",
                f"In Submission: the categorizer tries it again at {next_try.isoformat()}.",
                {"next_attempt_at": next_try},
            )
        ], next_try
    reasons: list[Reason] = []
    if pressure:
        worst = max(pressure, key=lambda p: p["level"] == "high")
        reasons.append(
            Reason(
                "backpressure",
                f"Back pressure: {worst['resource']} is {worst['level']} on "
                f"{worst['node']} (reading {worst['reading']}, threshold "
                f"{worst['threshold']}): the relay is behind.",
                {"resources": pressure},
            )
        )
    reasons.append(Reason("submission", "In Submission: due, waiting for the categorizer.", {}))
    return reasons, None


def _queue_held(queue: Queue | None) -> list[Reason]:
    """Reasons "queue_suspended" and "rerouted": what the operator set on its queue."""
    if queue is None:
        return []
    reasons: list[Reason] = []
    if queue.suspended:
        by, until = queue.suspended_by, queue.suspended_until
        reasons.append(
            Reason(
                "queue_suspended",
                f"Its queue {queue.name} is suspended {_who_until(by, until)}.",
                {"queue": queue.pk, "by": by, "until": until},
            )
        )
    if queue.reroute_to:
        until = queue.reroute_until
        reasons.append(
            Reason(
                "rerouted",
                f"Re-routed to {queue.reroute_to} until "
                f"{until.isoformat() if until else 'unrouted by hand'}"
                + (f" by {queue.reroute_by}" if queue.reroute_by else "")
                + ".",
                {"to": queue.reroute_to, "until": until, "by": queue.reroute_by},
            )
        )
    return reasons


def _unreachable(r: Recipient) -> Reason:
    """Reason "unreachable": no route; the categorizer tries at its next attempt."""
    next_try = r.next_attempt_at
    return Reason(
        "unreachable",
        f"No route ({r.last_text or 'routing failed'}); the categorizer tries "
        f"again at {next_try.isoformat()}.",
        {"next_attempt_at": next_try, "error": r.last_text},
    )


def _shaping(
    r: Recipient, queue: Queue, now: datetime, cache: dict[int, dict[str, Any] | None] | None
) -> Reason | None:
    """Reason "shaping": the traffic-shaping limit holding its link now, if any.
    Shaping holds what is due (a recipient waiting for its own next try waits
    for that)."""
    if not queue.link_id or r.next_attempt_at > now:
        return None
    limit = shaping_limit(queue, now, cache)
    if limit is None:
        return None
    return Reason("shaping", limit.get("text", "A shaping limit holds it."), limit)


def _link_retry(
    link: Link, link_hints: list[RetryHint], domain: str, now: datetime
) -> _Retry | None:
    """Reason "link_retry": its link waits for its next retry after connection
    failures; the rule is the one for its first skipped host's error."""
    if link.state != LinkState.RETRY or not link.next_retry_at or link.next_retry_at <= now:
        return None
    counter = _link_counter(link)
    error = link_hints[0].error if link_hints else ""
    host = link_hints[0].key[2:].split(":", 1)[0] if link_hints else None
    rule = find_rule(f"postmaster@{domain}", error=error, host=host)
    next_try = link.next_retry_at
    reason = Reason(
        "link_retry",
        f"Its link {link.name} is in {counter} retry after "
        f"{link.failure_count} connection failure(s); next retry "
        f"{next_try.isoformat()}. Last error: {link.last_error or '—'}",
        {
            "link": link.pk,
            "counter": counter,
            "failure_count": link.failure_count,
            "next_retry_at": next_try,
            "last_error": link.last_error,
        },
    )
    return _Retry(reason, rule, link.first_failure_at, next_try)


def _host_retries(link_hints: list[RetryHint], domain: str) -> list[Reason]:
    """Reasons "host_retry": each host of its link skipped by its retry data,
    with the rule that matched that host's error."""
    reasons = []
    for hint in link_hints:
        host = hint.key[2:].split(":", 1)[0]
        matched = find_rule(f"postmaster@{domain}", error=hint.error, host=host)
        reasons.append(
            Reason(
                "host_retry",
                f"Host {host} is skipped until {hint.next_try.isoformat()} by its retry "
                f"data ({hint.error or 'error'}: {hint.text or '—'}), rule: "
                f"{matched.text if matched else 'none'}.",
                {
                    "host": host,
                    "key": hint.key,
                    "error": hint.error,
                    "text": hint.text,
                    "next_try": hint.next_try,
                    "first_failed": hint.first_failed,
                    "rule": rule_info(matched),
                },
            )
        )
    return reasons


def _recipient_retry(r: Recipient, message: Message, last: Attempt | None, link: Link) -> _Retry:
    """Reason "problem_message" or "recipient_retry": a deferred recipient waiting
    for its own next try, under the rule for its last attempt's error."""
    error = (
        retry.error_name(last.phase, last.code, via_mx=link.delivery_type == DeliveryType.DNS_MX)
        if last is not None
        else ""
    )
    rule = find_rule(r.address, error=error, sender=message.mail_from)
    next_try = r.next_attempt_at
    if message.problem:
        reason = Reason(
            "problem_message",
            f"A problem message ({message.per_message_failures} per-message "
            f"failures): retried at {next_try.isoformat()} so it cannot hold up "
            "the others.",
            {"per_message_failures": message.per_message_failures, "next_attempt_at": next_try},
        )
    else:
        reason = Reason(
            "recipient_retry",
            f"Deferred ({error or 'temporary failure'}); next try {next_try.isoformat()}.",
            {"error": error, "next_attempt_at": next_try},
        )
    return _Retry(reason, rule, r.first_failure_at, next_try)


def _add_due(reasons: list[Reason], waiting: bool) -> None:
    """Reason "due", first, when nothing (or only a skipped host or a re-route) holds it."""
    if waiting and not reasons:
        reasons.append(Reason("due", "Due now: waiting for a delivery round.", {}))
    elif waiting and all(x.code in ("host_retry", "rerouted") for x in reasons):
        reasons.append(Reason("due", "Due now: waiting for a delivery round.", {}))
        reasons.sort(key=lambda x: x.code != "due")


def _reasons(
    r: Recipient,
    message: Message,
    last: Attempt | None,
    hints: dict[int, list[RetryHint]],
    pressure: list[dict[str, Any]] | None,
    now: datetime,
    shaping: dict[int, dict[str, Any] | None] | None,
) -> tuple[list[Reason], Rule | None, datetime | None, datetime | None]:
    """Why ``r`` waits, most important first, with the retry rule that applies,
    the first failure its schedule counts from, and the next try (the last
    step that sets one wins)."""
    queue: Queue | None = r.queue if r.queue_id else None
    link: Link | None = queue.link if queue is not None and queue.link_id else None
    reasons = [x for x in (_in_flight(r), _message_held(message, queue)) if x is not None]
    submission, next_try = _submission(r, message, pressure, now)
    reasons += submission
    reasons += _queue_held(queue)
    rule: Rule | None = None
    first_failed: datetime | None = None
    waiting = r.state in (RecipientState.QUEUED, RecipientState.DEFERRED)
    if waiting and queue is not None and queue.delivery_type == DeliveryType.UNREACHABLE:
        next_try = r.next_attempt_at
        reasons.append(_unreachable(r))
    if waiting and queue is not None and (held := _shaping(r, queue, now, shaping)):
        reasons.append(held)
    if waiting and link is not None:
        domain = r.address.rpartition("@")[2]
        link_hints = hints.get(link.pk, [])
        link_step = _link_retry(link, link_hints, domain, now)
        if link_step is not None:
            reasons.append(link_step.reason)
            rule, first_failed, next_try = (
                link_step.rule,
                link_step.first_failed,
                link_step.next_try,
            )
        reasons += _host_retries(link_hints, domain)
        # Its own retry explains it only when its link's retry gave no rule.
        if rule is None and r.state == RecipientState.DEFERRED and r.next_attempt_at > now:
            own = _recipient_retry(r, message, last, link)
            reasons.append(own.reason)
            rule, first_failed, next_try = own.rule, own.first_failed, own.next_try
    _add_due(reasons, waiting)
    return reasons, rule, first_failed, next_try


def _schedule(
    r: Recipient, message: Message, rule: Rule | None, first_failed: datetime | None, now: datetime
) -> tuple[list[dict[str, Any]], datetime | None, datetime | None]:
    """The projected schedule, in time order: the rule engine's next tries, the
    delay DSN (if one is still owed), the rule's final cutoff and the expiry;
    with when the delay DSN goes and when the cutoff passes."""
    schedule: list[dict[str, Any]] = []
    tries, cutoff_at = schedule_after(rule, first_failed, now, message.expires_at)
    schedule += [{"at": t, "kind": "retry"} for t in tries]
    delay_at = None
    if (
        not r.delay_dsn_sent
        and dsn_wanted(DSN_DELAY, r.notify, message.mail_from)
        and message.source != "dsn"
    ):
        delay_at = message.received_at + qmgr_settings().delay_notification_timeout
        schedule.append({"at": delay_at, "kind": "delay_dsn"})
    if cutoff_at is not None:
        schedule.append({"at": cutoff_at, "kind": "final_cutoff"})
    schedule.append({"at": message.expires_at, "kind": "expires"})
    schedule.sort(key=lambda s: s["at"])
    return schedule, delay_at, cutoff_at


def _last_reply(r: Recipient) -> dict[str, Any] | None:
    if not (r.last_attempt_at or r.last_text):
        return None
    return {
        "code": r.last_code,
        "enhanced": r.last_enhanced,
        "text": r.last_text,
        "host": r.last_host,
        "at": r.last_attempt_at,
    }


def _explain_recipient(
    r: Recipient,
    message: Message,
    last: Attempt | None,
    hints: dict[int, list[RetryHint]],
    pressure: list[dict[str, Any]] | None,
    now: datetime,
    shaping: dict[int, dict[str, Any] | None] | None = None,
) -> RecipientExplain:
    queue: Queue | None = r.queue if r.queue_id else None
    reasons, rule, first_failed, next_try = _reasons(
        r, message, last, hints, pressure, now, shaping
    )
    schedule, delay_at, cutoff_at = _schedule(r, message, rule, first_failed, now)
    return RecipientExplain(
        recipient_id=r.pk,
        address=r.address,
        state=r.state,
        queue={"id": queue.pk, "name": queue.name, "type": queue.delivery_type} if queue else None,
        reason=reasons[0].code if reasons else "",
        reasons=reasons,
        rule=rule_info(rule),
        last_reply=_last_reply(r),
        next_try_at=next_try,
        schedule=schedule,
        delay_dsn_at=delay_at,
        final_cutoff_at=cutoff_at,
        expires_at=message.expires_at,
        actions=_actions(reasons, message, queue),
    )


def explain_message(message: Message, now: datetime) -> MessageExplain:
    """Why each recipient of ``message`` not yet final is waiting (see the module doc)."""
    recipients = [
        r
        for r in Recipient.objects.filter(message=message)
        .select_related("queue", "queue__link")
        .order_by("id")
        if r.state not in FINAL_RECIPIENT_STATES
    ]
    links = {r.queue.link_id: r.queue.link for r in recipients if r.queue_id and r.queue.link_id}
    hints = _host_hints(list(links.values()), now) if links else {}
    last = (
        _last_attempts(message)
        if any(r.attempt_count or r.state == RecipientState.DEFERRED for r in recipients)
        else {}
    )
    pressure = (
        _pressure()
        if message.state == MessageState.SUBMISSION and message.next_attempt_at <= now
        else None
    )
    shaping: dict[int, dict[str, Any] | None] = {}
    out = [
        _explain_recipient(r, message, last.get(r.pk), hints, pressure, now, shaping)
        for r in recipients
    ]
    if out:
        summary = out[0].reasons[0].text if out[0].reasons else ""
    elif message.state == MessageState.DONE:
        summary = "Finished: every recipient is final."
    else:
        summary = "No recipient is waiting."
    return MessageExplain(message.pk, message.qid, message.state, now, summary, out)


def explain_queue(queue: Queue, now: datetime) -> dict[str, Any] | None:
    """The explain of the first recipient in line in ``queue`` (the queue page's summary):
    the next due, by the delivery claim's own index (recipient_waiting)."""
    oldest = (
        Recipient.objects.filter(
            queue=queue, state__in=(RecipientState.QUEUED, RecipientState.DEFERRED)
        )
        .order_by("next_attempt_at", "message_id")
        .values_list("message_id", flat=True)
        .first()
    )
    if oldest is None:
        return None
    message = Message.objects.defer("data").get(pk=oldest)
    result = explain_message(message, now)
    mine = [x for x in result.recipients if x.queue and x.queue["id"] == queue.pk]
    if not mine:
        return None
    first = mine[0]
    return _jsonable(
        {
            "message": {"id": message.pk, "qid": message.qid},
            "recipient": first.address,
            "reason": first.reason,
            "reasons": [asdict(x) for x in first.reasons],
            "next_try_at": first.next_try_at,
            "rule": first.rule,
        }
    )
