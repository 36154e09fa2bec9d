"""What an SMTP exchange's replies and a delivery round's results mean, decided
without the database; and the retry data the round reads and leaves.

Under their own headings:

- one reply classified (``classify``): delivered, deferred or failed, and the
  scope its failure blames (the recipient, the message or the host);
- the round decided: ``decide`` turns the SMTP exchange's results
  (``BatchResult``) into a pure ``RoundOutcome`` (queues.outcomes: per
  recipient delivered, failed, or deferred until…; per link its verdict) and
  what else the round owes: its Attempt rows, the NDRs and "relayed" reports
  (the NOTIFY rule, queues.lib), the retry data to store or clear.
  ``delivery.smtp.deliver`` writes it through the store's transitions, in one
  transaction;
- the results of one message on one target (``Recorder``), as the
  connections report them, each classified and stamped with its target;
- the link's verdict and the hosts' retry data: which hosts to try, what a
  round that reached none does to its link, the hosts' retry data to store
  and what a delivery clears; that data stored between rounds (Exim's hints
  database: the ``RetryHint`` table) is this module's only database access.

When to try again (the rules in force, the next try of a failure) is
``delivery.smtp.retry``'s.
"""

from __future__ import annotations

import logging
import re
import time
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from datetime import datetime
from typing import TypeVar

from delivery.smtp import retry
from delivery.smtp.retryschedule import (
    RetryData,
    TryDecision,
    combine_decisions,
    may_try,
    record_failure,
)
from delivery.smtp.types import (
    BatchResult,
    HostFailure,
    OutboundMessage,
    OutboundRecipient,
    Peer,
    RecipientResult,
)
from queues.lib import DSN_SUCCESS, address_key, clock, dsn_wanted, host_key, scrub_nul
from queues.models import Attempt, AttemptOutcome, AttemptPhase, Link, Recipient, RetryHint
from queues.outcomes import Delivered, LinkOutcome, RecipientOutcome, RoundOutcome, Verdict

T = TypeVar("T")

# ----------------------------------------------------------------------------
# Classify the outcome of an outbound SMTP exchange, by reply code and phase.
#
# Pure and table-driven: no I/O, no Django. The decision is taken from the
# reply code and the phase it answered, never from the reply text (DESIGN.md,
# "Failure types"); the text is only read for the RFC 3463 enhanced status
# code the peer may have put at its start.
#
# - **Scope** comes from the phase: connect, greeting, EHLO, STARTTLS and
#   session (lost connection, timeout) are per-connection; MAIL and DATA are
#   per-message; RCPT is per-recipient. A ``421`` reply closes the channel
#   (RFC 5321 §3.8) whatever command it answered, so it is per-connection too.
# - **Outcome** comes from the reply class: 2xx delivered, 4xx deferred, 5xx
#   failed. Per-connection failures are always deferred: a host that is down
#   or refuses us now says nothing final about the recipients, and expiry
#   fails them if it lasts. No reply at all (refused, timeout, reset) is a
#   per-connection failure and deferred too.
# - **Enhanced status code**: parsed from the reply text when present; when
#   absent a default is taken from a table by phase (no reply) or by class.
#
# The phase, scope and outcome strings are the values of
# ``queues.models.AttemptPhase`` and ``AttemptOutcome``; they are repeated
# here as plain strings so the classification needs no Django (a test checks
# that they match).
# ----------------------------------------------------------------------------


# queues.models.AttemptPhase values
ROUTE = "route"
CONNECT = "connect"
GREETING = "greeting"
EHLO = "ehlo"
STARTTLS = "starttls"
MAIL = "mail"
RCPT = "rcpt"
DATA = "data"
SESSION = "session"

# queues.models.AttemptOutcome values
DELIVERED = "delivered"
DEFERRED = "deferred"
FAILED = "failed"

# RecipientResult.scope values
SCOPE_CONNECTION = "connection"
SCOPE_MESSAGE = "message"
SCOPE_RECIPIENT = "recipient"

SCOPE_BY_PHASE: Mapping[str, str] = {
    # A routing failure concerns one recipient's domain (not produced here,
    # but classified the same way when the delivery side records it).
    ROUTE: SCOPE_RECIPIENT,
    CONNECT: SCOPE_CONNECTION,
    GREETING: SCOPE_CONNECTION,
    EHLO: SCOPE_CONNECTION,
    STARTTLS: SCOPE_CONNECTION,
    SESSION: SCOPE_CONNECTION,
    MAIL: SCOPE_MESSAGE,
    DATA: SCOPE_MESSAGE,
    RCPT: SCOPE_RECIPIENT,
}

# Reply codes that end the session whatever command they answer.
CONNECTION_CODES: frozenset[int] = frozenset({421})

# Outcome by reply class (first digit). A class outside 2/4/5 (a 3xx where a
# final reply was due, garbage) is a protocol error: retry, never fail.
OUTCOME_BY_CLASS: Mapping[int, str] = {2: DELIVERED, 4: DEFERRED, 5: FAILED}
PROTOCOL_ERROR_ENHANCED = "4.5.0"

# Outcome by scope, overriding the class: a connection-level problem is
# always retried; message expiry turns it into a failure eventually.
OUTCOME_BY_SCOPE: Mapping[str, str] = {SCOPE_CONNECTION: DEFERRED}

# Enhanced code when the peer gave no reply at all, by phase (RFC 3463):
# 4.4.1 no answer from host, 4.4.2 bad connection (lost or timed out),
# 4.7.5 cryptographic failure (the TLS handshake did not complete).
NO_REPLY_ENHANCED: Mapping[str, str] = {
    CONNECT: "4.4.1",
    GREETING: "4.4.2",
    EHLO: "4.4.2",
    STARTTLS: "4.7.5",
    MAIL: "4.4.2",
    RCPT: "4.4.2",
    DATA: "4.4.2",
    SESSION: "4.4.2",
}
NO_REPLY_DEFAULT = "4.4.2"

# Enhanced code when the reply carried none, by reply class.
ENHANCED_BY_CLASS: Mapping[int, str] = {2: "2.0.0", 4: "4.0.0", 5: "5.0.0"}

# RFC 3463 status-code = class "." subject "." detail; class 2, 4 or 5,
# subject and detail 1 to 3 digits, followed by a space or the end of line.
_ENHANCED = re.compile(r"([245])\.(\d{1,3})\.(\d{1,3})(?=\s|$)")


@dataclass(frozen=True, slots=True)
class Classification:
    outcome: str  # DELIVERED / DEFERRED / FAILED
    scope: str  # SCOPE_CONNECTION / SCOPE_MESSAGE / SCOPE_RECIPIENT
    enhanced: str  # "x.y.z"


def parse_enhanced(text: str) -> str:
    """The RFC 3463 code at the start of a reply text (``"550 5.1.1 ..."`` minus
    the code), or ``""`` when there is none."""
    m = _ENHANCED.match(text)
    return m.group(0) if m else ""


def strip_enhanced(text: str) -> str:
    """The reply text without a leading enhanced status code."""
    m = _ENHANCED.match(text)
    return text[m.end() :].lstrip() if m else text


def scope_for(phase: str, code: int | None) -> str:
    if code in CONNECTION_CODES:
        return SCOPE_CONNECTION
    # No reply is a transport problem, whatever command was in flight.
    if code is None:
        return SCOPE_CONNECTION
    return SCOPE_BY_PHASE.get(phase, SCOPE_CONNECTION)


def classify(phase: str, code: int | None, text: str = "") -> Classification:
    """Classify one reply (``code``) to a command of ``phase``.

    ``code`` is ``None`` when there was no reply (refused, timeout, lost
    connection, TLS handshake failure). ``text`` is the reply text after the
    code; only its leading enhanced status code is looked at.

    Steps:
    1. scope: ``CONNECTION_CODES`` and "no reply" are per-connection; else
       the phase's scope from ``SCOPE_BY_PHASE``;
    2. outcome: the reply class from ``OUTCOME_BY_CLASS`` (deferred for
       an unexpected class), then ``OUTCOME_BY_SCOPE`` overrides it;
    3. enhanced code: parsed from ``text``; its class is forced to the
       reply's class when they disagree (the reply code is authoritative,
       RFC 2034 §4); when absent, ``NO_REPLY_ENHANCED`` by phase for no
       reply, ``ENHANCED_BY_CLASS`` otherwise.
    """
    scope = scope_for(phase, code)
    if code is None:
        return Classification(
            OUTCOME_BY_SCOPE.get(scope, DEFERRED),
            scope,
            NO_REPLY_ENHANCED.get(phase, NO_REPLY_DEFAULT),
        )
    reply_class = code // 100
    outcome = OUTCOME_BY_CLASS.get(reply_class)
    if outcome is None:
        return Classification(DEFERRED, scope, PROTOCOL_ERROR_ENHANCED)
    outcome = OUTCOME_BY_SCOPE.get(scope, outcome)
    enhanced = parse_enhanced(text)
    if not enhanced:
        enhanced = ENHANCED_BY_CLASS[reply_class]
    elif enhanced[0] != str(reply_class):
        enhanced = f"{reply_class}{enhanced[1:]}"
    return Classification(outcome, scope, enhanced)


def classify_local(phase: str, enhanced: str) -> Classification:
    """Classify a decision taken without asking the peer (the message is too
    big for its SIZE, it needs SMTPUTF8 the peer lacks, ...): the outcome
    follows the class of ``enhanced``, the scope follows ``phase``."""
    scope = SCOPE_BY_PHASE.get(phase, SCOPE_CONNECTION)
    outcome = OUTCOME_BY_CLASS.get(int(enhanced[0]), DEFERRED)
    return Classification(OUTCOME_BY_SCOPE.get(scope, outcome), scope, enhanced)


# --- the round decided -------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Refusal:
    """A decision taken without asking the peer, for a whole message
    (``phase`` MAIL) or for one recipient (``phase`` RCPT)."""

    phase: str
    enhanced: str
    text: str

    def classification(self) -> Classification:
        return classify_local(self.phase, self.enhanced)


BAD_SENDER = Refusal(MAIL, "5.1.7", "invalid sender or MAIL parameters")
BAD_RECIPIENT = Refusal(RCPT, "5.1.3", "invalid recipient or RCPT parameters")


def unattempted(
    messages: list[OutboundMessage], outcome: str, enhanced: str, text: str
) -> BatchResult:
    """One result per recipient for a round decided without connecting."""
    now = clock.now()
    return BatchResult(
        results=[
            RecipientResult(
                recipient_id=r.id,
                message_id=m.id,
                outcome=outcome,
                phase=AttemptPhase.CONNECT,
                code=None,
                enhanced=enhanced,
                text=text,
                started_at=now,
                scope="connection",
            )
            for m in messages
            for r in m.recipients
        ],
        connected=False,
        connection_error=text,
    )


@dataclass
class Round:
    """What one round decided (by ``decide``, without the database): its pure
    ``outcome`` (queues.outcomes), which the store's transitions write, and
    what else ``_write`` owes in the same transaction."""

    now: datetime
    rows: dict[int, Recipient]  # the claimed rows, as loaded
    link: retry.LinkVerdict
    outcome: RoundOutcome
    attempts: list[Attempt] = field(default_factory=list)
    failed: dict[int, list[Recipient]] = field(default_factory=lambda: defaultdict(list))
    relayed: dict[int, list[Recipient]] = field(default_factory=lambda: defaultdict(list))
    hints: list[RetryData] = field(default_factory=list)
    cleared_hints: list[str] = field(default_factory=list)
    delivered_queues: set[int] = field(default_factory=set)
    errors_by_queue: dict[int, str] = field(default_factory=dict)
    carried_tls: str = ""  # the TLS summary of the round's early records


def _via_mx(link: Link) -> bool:
    return any(not h.get("literal", False) for h in link.hosts)


def _link_retry(link: Link) -> retry.LinkRetry:
    return retry.LinkRetry(
        link.failure_count, link.first_failure_at, link.next_retry_at, link.last_error_at
    )


def attempt_values(res: RecipientResult, now: datetime, link_id: int | None) -> dict[str, object]:
    """The columns of ``res``'s Attempt row on link ``link_id`` (its queue is its
    recipient's)."""
    return {
        "link_id": link_id,
        "recipient_id": res.recipient_id,
        "message_id": res.message_id,
        "started_at": res.started_at or now,
        "duration_ms": res.duration_ms,
        "host": res.host[:300],
        "ip": res.ip[:64],
        "port": res.port,
        "phase": res.phase,
        "code": res.code,
        "enhanced": res.enhanced[:16],
        "text": res.text,
        "outcome": res.outcome,
        "tls_version": res.tls_version[:16],
        "tls_cipher": res.tls_cipher[:100],
        "tls_verified": res.tls_verified[:20],
        "tls_policy": res.tls_policy[:20],
        "auth_used": res.auth_used[:20],
        # A delivery is its own tracking event (tracking.history).
        **(
            {"event_id": res.event_id, "remote_id": remote_queue_id(res.text)}
            if res.outcome == AttemptOutcome.DELIVERED
            else {}
        ),
    }


def reply_host(res: RecipientResult) -> str:
    """The host a recipient's last reply came from, as the queue list shows it."""
    return f"{res.host} [{res.ip}]" if res.ip else res.host


def _attempt(res: RecipientResult, row: Recipient, link: Link, now: datetime) -> Attempt:
    return Attempt(queue_id=row.queue_id, **attempt_values(res, now, link.pk))


def decide(
    link: Link,
    batch: BatchResult,
    rows: dict[int, Recipient],
    senders: dict[int, str],
    stored: dict[str, RetryData],
    now: datetime,
) -> Round:
    """Decide what a round's results mean, without touching the database.

    1. one Attempt per result;
    2. every host that could not be used gets its retry data; a link whose
       every host failed goes to Retry at the time its rule gives;
    3. delivered and failed recipients become final (failed ones are owed an
       NDR); deferred ones get their next try from the retry rule, or fail
       when the rule's final cutoff has passed; deliveries clear retry data;
    4. message-level 4xx failures count towards a problem message.
    """
    domain = next(iter(rows.values())).address.rpartition("@")[2] if rows else link.name
    via_mx = _via_mx(link)
    last_failure = batch.host_failures[-1] if batch.host_failures else None
    verdict = link_verdict(
        _link_retry(link),
        connected=batch.connected,
        last_failure=last_failure,
        domain=domain,
        via_mx=via_mx,
        now=now,
    )
    rnd = Round(now, rows, verdict, RoundOutcome(now))
    rnd.hints = host_hints(batch.host_failures, stored, domain=domain, via_mx=via_mx, now=now)
    for res in batch.results:
        row = rows.get(res.recipient_id)
        if row is None:  # no longer this round's (taken back, removed)
            continue
        rnd.attempts.append(_attempt(res, row, link, now))
        rnd.outcome.recipients[row.id] = _decide_recipient(
            rnd, res, row, senders.get(row.message_id, ""), via_mx
        )
    return rnd


def _decide_recipient(
    rnd: Round, res: RecipientResult, row: Recipient, sender: str, via_mx: bool
) -> RecipientOutcome:
    """One recipient's verdict (step 3 and 4 of ``decide``)."""
    now = rnd.now
    outcome = RecipientOutcome(
        verdict=Verdict.DEFERRED,
        tried_at=res.started_at or now,
        code=res.code,
        enhanced=res.enhanced[:16],
        text=res.text,
        host=reply_host(res),
        first_failure_at=row.first_failure_at,
    )
    timed_out = False
    if res.outcome == AttemptOutcome.DEFERRED:
        d = retry.deferral(
            res,
            address=row.address,
            sender=sender,
            first_failure_at=row.first_failure_at,
            last_attempt_at=row.last_attempt_at,
            next_attempt_at=row.next_attempt_at,
            link=rnd.link,
            via_mx=via_mx,
            now=now,
        )
        outcome.first_failure_at = d.first_failure_at
        timed_out = d.next_attempt_at is None
        outcome.until = d.next_attempt_at
        if d.message_failure:
            rnd.outcome.message_failures.add(row.message_id)
        if d.address_hint is not None:
            rnd.hints.append(d.address_hint)
        rnd.errors_by_queue[row.queue_id] = res.text
    if res.outcome == AttemptOutcome.DELIVERED:
        outcome.verdict = Verdict.DELIVERED
        rnd.delivered_queues.add(row.queue_id)
        rnd.cleared_hints += cleared_by_delivery(row.address, sender, res.host, res.ip)
        if dsn_wanted(DSN_SUCCESS, row.notify, sender) and not res.peer_dsn:
            rnd.relayed[row.message_id].append(row)
    elif res.outcome == AttemptOutcome.FAILED or timed_out:
        outcome.verdict = Verdict.FAILED  # kept in the Dead-letter queue
        if timed_out:
            outcome.text = f"retry timeout exceeded; last error: {res.text}"
        rnd.failed[row.message_id].append(row)
    return outcome


@dataclass
class Carried:
    """What a round's early records leave to its final record: the link's and the
    queues' bookkeeping and the retry data that deliveries clear — written once
    per round, not once per message."""

    delivered_queues: set[int] = field(default_factory=set)
    errors_by_queue: dict[int, str] = field(default_factory=dict)
    cleared_hints: dict[str, None] = field(default_factory=dict)  # ordered set
    tls: str = ""
    recorded: set[int] = field(default_factory=set)  # the recipients recorded early

    def keep(self, rnd: Round) -> None:
        self.recorded |= rnd.rows.keys()
        self.delivered_queues |= rnd.delivered_queues
        self.errors_by_queue.update(rnd.errors_by_queue)
        self.cleared_hints.update(dict.fromkeys(rnd.cleared_hints))
        self.tls = tls_summary(rnd.attempts) or self.tls

    def keep_delivered(
        self,
        written: list[Delivered],
        results: list[RecipientResult],
        senders: Mapping[int, str],
    ) -> None:
        """``keep`` for an early record of deliveries (``record_delivered``);
        ``senders``: the envelope sender by message id."""
        by_id = {res.recipient_id: res for res in results}
        for row in written:
            res = by_id[row.id]
            self.recorded.add(row.id)
            self.delivered_queues.add(row.queue_id)
            sender = senders[row.message_id]
            cleared = cleared_by_delivery(row.address, sender, res.host, res.ip)
            self.cleared_hints.update(dict.fromkeys(cleared))
        self.tls = tls_summary(results) or self.tls

    def unrecorded(self, batch: BatchResult) -> BatchResult:
        """``batch`` without the results the early records wrote (no longer the round's)."""
        return replace(
            batch, results=[r for r in batch.results if r.recipient_id not in self.recorded]
        )

    def give(self, rnd: Round) -> None:
        rnd.delivered_queues |= self.delivered_queues
        rnd.errors_by_queue = {**self.errors_by_queue, **rnd.errors_by_queue}
        rnd.cleared_hints = list(dict.fromkeys([*self.cleared_hints, *rnd.cleared_hints]))
        rnd.carried_tls = self.tls


def link_outcome(rnd: Round, connection_error: str) -> LinkOutcome:
    """The link's part of the round's outcome (its verdict and its queues')."""
    verdict = rnd.link
    return LinkOutcome(
        failed=verdict.failed,
        failure_count=verdict.retry.failure_count,
        first_failure_at=verdict.retry.first_failure_at,
        next_retry_at=verdict.retry.next_retry_at,
        error=connection_error,
        tls=tls_summary(rnd.attempts) or rnd.carried_tls,
        delivered_queues=rnd.delivered_queues,
        errors_by_queue=rnd.errors_by_queue,
    )


def tls_summary(attempts: list[Attempt] | list[RecipientResult]) -> str:
    """The TLS of the round's last session for the queue list, e.g.
    "TLSv1.3 verified (mta-sts), AUTH PLAIN" or "cleartext (policy may)"."""
    if not attempts:
        return ""
    a = attempts[-1]
    if a.tls_version:
        how = f"verified ({a.tls_verified})" if a.tls_verified not in ("", "none") else "unverified"
        text = f"{a.tls_version} {how}"
    elif a.host or a.tls_policy:
        text = "cleartext" if a.code is not None else "no session"
    else:
        return ""
    if a.tls_policy:
        text += f", policy {a.tls_policy}"
    if a.auth_used:
        text += f", AUTH {a.auth_used}"
    return text[:120]


# ----------------------------------------------------------------------------
# The results of one message on one target: one ``RecipientResult`` per recipient.
#
# ``Recorder`` turns each reply (or the failure that ended the session) into
# a classified result (``classify``, above), stamped with the target
# and the session's transport security (``Security``).
# ----------------------------------------------------------------------------


log = logging.getLogger(__name__)


@dataclass(slots=True)
class Security:
    """The transport security of one session (Attempt.tls_* and auth_used)."""

    policy: str = ""
    version: str = ""
    cipher: str = ""
    verified: str = ""
    auth: str = ""
    report: str = ""  # an MTA-STS "testing" failure, for an Event


class Recorder:
    """The results of one message on one target, one per recipient."""

    __slots__ = ("msg", "target", "started", "t0", "decided", "peer_dsn", "security")

    def __init__(
        self,
        msg: OutboundMessage,
        target: Peer,
        started: datetime,
        t0: float,
        peer_dsn: bool = False,
        security: Security | None = None,
    ):
        self.peer_dsn = peer_dsn
        self.security = security or Security()
        self.msg = msg
        self.target = target
        self.started = started
        self.t0 = t0
        self.decided: dict[int, RecipientResult] = {}

    def set(
        self,
        rcpt: OutboundRecipient,
        phase: str,
        code: int | None,
        text: str,
        cls: Classification | None = None,
    ) -> None:
        if cls is None:
            cls = classify(phase, code, text)
        t = self.target
        sec = self.security
        self.decided[rcpt.id] = RecipientResult(
            recipient_id=rcpt.id,
            message_id=self.msg.id,
            outcome=cls.outcome,
            phase=phase,
            code=code,
            enhanced=cls.enhanced,
            text=strip_enhanced(text),
            host=t.host,
            ip=t.ip,
            port=t.port or None,
            started_at=self.started,
            duration_ms=int((time.monotonic() - self.t0) * 1000),
            scope=cls.scope,
            peer_dsn=self.peer_dsn,
            tls_version=sec.version,
            tls_cipher=sec.cipher,
            tls_verified=sec.verified,
            tls_policy=sec.policy,
            auth_used=sec.auth,
            tls_report=sec.report,
        )

    def set_many(
        self,
        rcpts: Sequence[OutboundRecipient],
        phase: str,
        code: int | None,
        text: str,
        cls: Classification | None = None,
    ) -> None:
        if cls is None:
            cls = classify(phase, code, text)
        for rcpt in rcpts:
            self.set(rcpt, phase, code, text, cls)

    def fill(self, phase: str, code: int | None, text: str, enhanced: str = "") -> None:
        """Give every recipient without a result this one (``enhanced``
        overrides the classified enhanced status code when given)."""
        cls = classify(phase, code, text)
        if enhanced:
            cls = replace(cls, enhanced=enhanced)
        self.set_many(
            [r for r in self.msg.recipients if r.id not in self.decided], phase, code, text, cls
        )

    def refuse(self, rcpts: Sequence[OutboundRecipient], refusal: Refusal) -> None:
        """Give ``rcpts`` a result decided without asking the peer."""
        if rcpts:
            self.set_many(rcpts, refusal.phase, None, refusal.text, refusal.classification())

    def results(self) -> list[RecipientResult]:
        return [self.decided[r.id] for r in self.msg.recipients if r.id in self.decided]


# --- the link's verdict, the hosts' retry data, which hosts to try (pure) ----------


def link_verdict(
    link: retry.LinkRetry,
    *,
    connected: bool,
    last_failure: HostFailure | None,
    domain: str,
    via_mx: bool,
    now: datetime,
) -> retry.LinkVerdict:
    """A round that reached a peer resets the link; one that reached none moves it
    along the connection rule (Exchange's glitch/transient/Retry, compiled)."""
    if connected:
        return retry.LinkVerdict(retry.LinkRetry(last_error_at=link.last_error_at), False, False)
    error = retry.error_name(
        last_failure.phase if last_failure else "connect",
        last_failure.code if last_failure else None,
        last_failure.error if last_failure else "",
        via_mx,
    )
    first_failed = link.first_failure_at or now
    decision = retry.decide(
        address=f"postmaster@{domain}",
        host=(last_failure.host if last_failure and last_failure.host else None) or domain,
        error=error,
        first_failed=first_failed,
        last_tried=link.last_error_at or now,
        next_try=link.next_retry_at,
        now=now,
    )
    state = retry.LinkRetry(link.failure_count + 1, first_failed, decision.at, now)
    return retry.LinkVerdict(state, True, decision.timed_out)


def host_hints(
    failures: Sequence[HostFailure],
    existing: Mapping[str, RetryData],
    *,
    domain: str,
    via_mx: bool,
    now: datetime,
) -> list[RetryData]:
    """Exim's per-host retry data for every host that could not be used."""
    by_key = {host_key(f.host, f.ip): f for f in failures if f.host}
    if not by_key:
        return []  # nothing failed: no rule to look up
    active = retry.rules()
    saved = []
    for key, f in by_key.items():
        error = retry.error_name(f.phase, f.code, f.error, via_mx)
        rule = active.find(f"postmaster@{domain}", host=f.host, error=error or None)
        outcome = record_failure(
            existing.get(key),
            key=key,
            rule=rule,
            now=now,
            error=error,
            text=f.text,
            options=active.options,
        )
        saved.append(outcome.hint)
    return saved


def usable_targets(
    targets: Sequence[T], hints: Mapping[str, RetryData], *, domain: str, now: datetime
) -> tuple[list[T], str]:
    """Which hosts to try, from their retry data (Exim §10).

    Returns the targets and a verdict: "try" (hosts whose retry time has come,
    or that have no retry data), "bounce" (every host is past its rule's final
    cutoff and not due: the recipients time out without an attempt), or
    "defer" — which cannot stop a round here, because the link's own retry
    time has just come: then every host is tried.
    """
    if not hints:
        return list(targets), "try"
    active = retry.rules()
    decisions = []
    for t in targets:
        hint = hints.get(host_key(t.host, t.ip))
        rule = (
            active.find(f"postmaster@{domain}", host=t.host, error=hint.error or None)
            if hint
            else None
        )
        decisions.append(may_try(hint, now=now, rule=rule, options=active.options))
    verdict = combine_decisions(decisions)
    if verdict == "bounce":
        return [], verdict
    ready = [t for t, d in zip(targets, decisions, strict=True) if d is TryDecision.TRY]
    return (ready or list(targets)), "try"


# --- retry data, stored (Exim's hints database is the RetryHint table) ----------------


def stored_hints(hosts: Iterable[HostFailure | Peer]) -> dict[str, RetryData]:
    """The stored retry data of these hosts (anything with ``host`` and ``ip``)."""
    keys = [host_key(h.host, h.ip) for h in hosts]
    if not keys:
        return {}  # an early record of finished messages: nothing to read
    return {key: _as_data(row) for key, row in RetryHint.objects.load(keys).items()}


def store_hints(hints: Iterable[RetryData]) -> None:
    RetryHint.objects.save(_as_row(h) for h in hints)


def forget_hints(keys: Iterable[str]) -> None:
    RetryHint.objects.clear(keys)


def cleared_by_delivery(address: str, sender: str, host: str, ip: str) -> list[str]:
    """A delivery resets the retry clock of its address and of the host that took it."""
    keys = [address_key(address, sender)]
    if host:
        keys.append(host_key(host, ip))
    return keys


def _as_data(row: RetryHint) -> RetryData:
    return RetryData(
        row.key, row.first_failed, row.last_tried, row.next_try, row.expired, row.error, row.text
    )


def _as_row(hint: RetryData) -> RetryHint:
    return RetryHint(
        key=hint.key,
        first_failed=hint.first_failed,
        last_tried=hint.last_tried,
        next_try=hint.next_try,
        expired=hint.expired,
        error=hint.error,
        text=scrub_nul(hint.text)[:2000],  # PostgreSQL text holds no NUL
    )


# The next hop's own queue id, read from its reply to the end of data: kept on
# the delivered attempt (``Attempt.remote_id``), searched in the tracking history.
# Most specific first; each captures the id (sizes bounded: a reply is text from a peer).
_PATTERNS = (
    re.compile(r"queued as\s+<?([A-Za-z0-9][A-Za-z0-9._@\-]{0,98})>?", re.I),  # Postfix
    re.compile(r"\bid=([A-Za-z0-9][A-Za-z0-9._\-]{0,98})", re.I),  # Exim "OK id=1kAbc-000123-AB"
    re.compile(r"\bInternalId=(\d{1,40})", re.I),  # Exchange
    re.compile(r"(\S{1,99}) - gsmtp\s*$"),  # Gmail "OK  1700000000 a1-20020a...- gsmtp"
    re.compile(
        r"^\s*(?:\d\.\d{1,3}\.\d{1,3}\s+)?([A-Za-z0-9]{8,40}) Message accepted for delivery", re.I
    ),  # Sendmail
    re.compile(r"\bqueued (?:with id|as id)\s+([A-Za-z0-9][A-Za-z0-9._\-]{0,98})", re.I),
)


def remote_queue_id(reply: str) -> str:
    """``"250 2.0.0 Ok: queued as 4Xyz"`` → ``"4Xyz"``; ``""`` when the reply names none."""
    for pattern in _PATTERNS:
        match = pattern.search(reply)
        if match:
            return match[1].rstrip(".")[:100]
    return ""
