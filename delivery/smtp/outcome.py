"""What a delivery round's results mean, decided without the database.

``decide`` turns the SMTP exchange's results (``BatchResult``) into a pure
``RoundOutcome`` (queues.outcomes: per recipient delivered, failed, or
deferred until…; per link its verdict, from the retry rules of
delivery.smtp.retry) and what else the round owes: its Attempt rows, the
NDRs and "relayed" reports (the NOTIFY rule, queues.lib), the retry
data to store or clear. ``delivery.smtp.deliver`` writes it through the
store's transitions, in one transaction.

The ``Recorder`` (below) collects the exchange's per-recipient results as the
connections report them, each classified and stamped with its target.
"""

from __future__ import annotations

import logging
import time
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from datetime import datetime

from delivery.smtp import retry
from delivery.smtp.types import (
    BatchResult,
    OutboundMessage,
    OutboundRecipient,
    Peer,
    RecipientResult,
)
from queues.lib import DSN_SUCCESS, clock, dsn_wanted
from queues.models import Attempt, AttemptOutcome, AttemptPhase, Link, Recipient
from queues.outcomes import Delivered, LinkOutcome, RecipientOutcome, RoundOutcome, Verdict


@dataclass(frozen=True, slots=True)
class Refusal:
    """A decision taken without asking the peer, for a whole message
    (``phase`` MAIL) or for one recipient (``phase`` RCPT)."""

    phase: str
    enhanced: str
    text: str

    def classification(self) -> retry.Classification:
        return retry.classify_local(self.phase, self.enhanced)


BAD_SENDER = Refusal(retry.MAIL, "5.1.7", "invalid sender or MAIL parameters")
BAD_RECIPIENT = Refusal(retry.RCPT, "5.1.3", "invalid recipient or RCPT parameters")


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
    hints: list[retry.RetryData] = field(default_factory=list)
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


def attempt_values(res: RecipientResult, now: datetime) -> dict[str, object]:
    """The columns of ``res``'s Attempt row (its queue is its recipient's)."""
    return {
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
    }


def reply_host(res: RecipientResult) -> str:
    """The host a recipient's last reply came from, as the queue list shows it."""
    return f"{res.host} [{res.ip}]" if res.ip else res.host


def _attempt(res: RecipientResult, row: Recipient, now: datetime) -> Attempt:
    return Attempt(queue_id=row.queue_id, **attempt_values(res, now))


def decide(
    link: Link,
    batch: BatchResult,
    rows: dict[int, Recipient],
    senders: dict[int, str],
    host_hints: dict[str, retry.RetryData],
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
    verdict = retry.link_verdict(
        _link_retry(link),
        connected=batch.connected,
        last_failure=last_failure,
        domain=domain,
        via_mx=via_mx,
        now=now,
    )
    rnd = Round(now, rows, verdict, RoundOutcome(now))
    rnd.hints = retry.host_hints(
        batch.host_failures, host_hints, domain=domain, via_mx=via_mx, now=now
    )
    for res in batch.results:
        row = rows.get(res.recipient_id)
        if row is None:  # no longer this round's (taken back, removed)
            continue
        rnd.attempts.append(_attempt(res, row, now))
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
        rnd.cleared_hints += retry.cleared_by_delivery(row.address, sender, res.host, res.ip)
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

    def keep(self, rnd: Round) -> None:
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
            self.delivered_queues.add(row.queue_id)
            sender = senders[row.message_id]
            cleared = retry.cleared_by_delivery(row.address, sender, res.host, res.ip)
            self.cleared_hints.update(dict.fromkeys(cleared))
        self.tls = tls_summary(results) or self.tls

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
# a classified result (``delivery.smtp.retry``), stamped with the target
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
        cls: retry.Classification | None = None,
    ) -> None:
        if cls is None:
            cls = retry.classify(phase, code, text)
        t = self.target
        sec = self.security
        self.decided[rcpt.id] = RecipientResult(
            recipient_id=rcpt.id,
            message_id=self.msg.id,
            outcome=cls.outcome,
            phase=phase,
            code=code,
            enhanced=cls.enhanced,
            text=retry.strip_enhanced(text),
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
        cls: retry.Classification | None = None,
    ) -> None:
        if cls is None:
            cls = retry.classify(phase, code, text)
        for rcpt in rcpts:
            self.set(rcpt, phase, code, text, cls)

    def fill(self, phase: str, code: int | None, text: str, enhanced: str = "") -> None:
        """Give every recipient without a result this one (``enhanced``
        overrides the classified enhanced status code when given)."""
        cls = retry.classify(phase, code, text)
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
