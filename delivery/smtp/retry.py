"""When to try again: the one place the retry schedule is decided.

How Exchange's counters and Exim's rules combine (README, "Retry"):

* The schedule is always computed by the Exim rule engine
  (:mod:`delivery.smtp.retryrules`). The rule list is the operator's file
  (``MAILRELAY_RETRY_RULES``), followed by rules *compiled from Exchange's
  settings*; the first match wins, so a file rule overrides Exchange's
  behaviour only for the addresses and errors it matches.
* Compiled connection rule (any error of a link whose hosts all failed):
  ``* * F,<glitch window>,<glitch interval>; F,<transient window>,<transient
  interval>; F,<forever>,<outbound connection failure interval>`` —
  4 retries 1 min apart, 6 retries 5 min apart, then every 10 min.
* Compiled message rule (RCPT/MAIL/DATA 4xx): the first
  ``PerMsgFailuresBeforeMarkingAsProblem - 1`` failures retry at the glitch
  interval, then the problem-message interval (15 min).
* Windows carry half an interval of slack: cutoffs are measured from the
  first failure, and real retries run a little late, which must not skip a
  step. The last set never ends: Exchange gives up by message expiration
  (``MAILRELAY_MESSAGE_EXPIRATION_TIMEOUT``, from arrival), which applies to
  every rule. A file rule whose final cutoff passes fails the recipients
  it covers (Exim's timeout), before expiration.

Below the schedule, under their own headings: how one reply is classified
(delivered, deferred or failed, and the scope its failure blames: the
recipient, the message or the host), and the retry data stored between
rounds (Exim's hints: the ``RetryHint`` table).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from functools import lru_cache
from typing import Protocol, TypeVar

from django.conf import settings

from delivery.smtp.retryrules import RetryOptions, RetryRules, Rule, load_rules, parse_rules
from delivery.smtp.retryschedule import (
    NextRetry,
    RetryData,
    TryDecision,
    combine_decisions,
    may_try,
    next_retry,
    record_failure,
)
from delivery.smtp.types import HostFailure, RecipientResult
from queues.lib import address_key, format_duration, host_key, scrub_nul
from queues.models import RetryHint

T = TypeVar("T")


class Peer(Protocol):
    host: str
    ip: str


FOREVER = timedelta(days=36500)
MESSAGE_ERRORS = ("rcpt_4xx", "mail_4xx", "data_4xx")


def _fixed(cutoff: timedelta, interval: timedelta) -> str:
    """An Exim F parameter set: retry every ``interval`` until ``cutoff``."""
    return f"F,{format_duration(cutoff)},{format_duration(interval)}"


def exchange_rules_text() -> str:
    """Exim rules that reproduce Exchange's retry timers from the settings."""
    s = settings
    glitch_n = s.MAILRELAY_QUEUE_GLITCH_RETRY_COUNT
    glitch = s.MAILRELAY_QUEUE_GLITCH_RETRY_INTERVAL
    transient_n = s.MAILRELAY_TRANSIENT_FAILURE_RETRY_COUNT
    transient = s.MAILRELAY_TRANSIENT_FAILURE_RETRY_INTERVAL
    outbound = s.MAILRELAY_OUTBOUND_CONNECTION_FAILURE_RETRY_INTERVAL
    sets: list[str] = []
    # Failures at 0, g, 2g, ... (n-1)g are each followed by a glitch retry.
    elapsed = timedelta(0)
    if glitch_n > 0:
        sets.append(_fixed((glitch_n - 1) * glitch + glitch / 2, glitch))
        elapsed = glitch_n * glitch
    if transient_n > 0:
        sets.append(_fixed(elapsed + (transient_n - 1) * transient + transient / 2, transient))
    sets.append(_fixed(FOREVER, outbound))
    connection = "; ".join(sets)

    problem_n = s.MAILRELAY_PER_MESSAGE_FAILURES_BEFORE_PROBLEM
    msg_sets = []
    if problem_n > 1:
        msg_sets.append(_fixed((problem_n - 2) * glitch + glitch / 2, glitch))
    msg_sets.append(_fixed(FOREVER, s.MAILRELAY_MESSAGE_RETRY_INTERVAL))
    message = "; ".join(msg_sets)
    lines = ["# compiled from the Exchange retry settings"]
    lines += [f"*  {error}  {message}" for error in MESSAGE_ERRORS]
    lines.append(f"*  *  {connection}")
    return "\n".join(lines) + "\n"


def options() -> RetryOptions:
    """The retry options from the settings (Exim's retry_interval_max, …)."""
    return RetryOptions(
        retry_interval_max=settings.MAILRELAY_RETRY_INTERVAL_MAX,
        retry_data_expire=settings.MAILRELAY_RETRY_DATA_EXPIRE,
        delay_after_cutoff=settings.MAILRELAY_DELAY_AFTER_CUTOFF,
    )


def _settings_key() -> tuple:
    s = settings
    return (
        s.MAILRELAY_RETRY_RULES,
        s.MAILRELAY_QUEUE_GLITCH_RETRY_COUNT,
        s.MAILRELAY_QUEUE_GLITCH_RETRY_INTERVAL,
        s.MAILRELAY_TRANSIENT_FAILURE_RETRY_COUNT,
        s.MAILRELAY_TRANSIENT_FAILURE_RETRY_INTERVAL,
        s.MAILRELAY_OUTBOUND_CONNECTION_FAILURE_RETRY_INTERVAL,
        s.MAILRELAY_PER_MESSAGE_FAILURES_BEFORE_PROBLEM,
        s.MAILRELAY_MESSAGE_RETRY_INTERVAL,
        s.MAILRELAY_RETRY_INTERVAL_MAX,
        s.MAILRELAY_RETRY_DATA_EXPIRE,
        s.MAILRELAY_DELAY_AFTER_CUTOFF,
    )


@lru_cache(maxsize=8)
def _rules_for(key: tuple) -> RetryRules:
    active = options()
    compiled = parse_rules(exchange_rules_text(), source="Exchange settings", options=active)
    path = key[0]
    if not path:
        return compiled
    own = load_rules(path, options=active)
    return RetryRules(own.rules + compiled.rules, active, f"{path} + Exchange settings")


def rules() -> RetryRules:
    """The active rule list (cached per settings; the file is read once per process)."""
    return _rules_for(_settings_key())


@dataclass(frozen=True)
class Decision:
    at: datetime
    timed_out: bool
    rule: Rule | None


def decide(
    *,
    address: str,
    error: str,
    first_failed: datetime,
    last_tried: datetime,
    next_try: datetime | None,
    now: datetime,
    host: str | None = None,
    sender: str | None = None,
) -> Decision:
    """Next try for a failure, and whether the rule's final cutoff has passed."""
    active = rules()
    rule = active.find(address, host=host, error=error or None, sender=sender)
    if rule is None and error:
        rule = active.find(address, host=host, error=None, sender=sender)
    if rule is None or not rule.params:
        return Decision(now, True, rule)
    step: NextRetry = next_retry(
        rule, first_failed, last_tried, now, next_try=next_try, options=active.options
    )
    return Decision(step.at, step.expired, rule)


def error_name(phase: str, code: int | None, host_error: str = "", via_mx: bool = True) -> str:
    """The Exim error name of a failure (pure; by phase and code, never by text)."""
    if phase in ("rcpt", "mail", "data") and code is not None and 400 <= code < 500:
        return f"{phase}_{code}"
    if host_error in ("refused", "timeout_connect"):
        return f"{host_error}_{'MX' if via_mx else 'A'}"
    if host_error == "timeout":
        return "timeout_MX" if via_mx else "timeout_A"
    return host_error  # lost_connection, tls_required, auth_failed, or "" ("*" only)


def validate_retry_settings() -> None:
    """Fail start-up on a bad rule file, naming the setting and the line."""
    from django.core.exceptions import ImproperlyConfigured

    from delivery.smtp.retryrules import RetryRuleError

    try:
        rules()
    except RetryRuleError as exc:
        raise ImproperlyConfigured(f"MAILRELAY_RETRY_RULES: {exc}") from None


def categorizer_retry_at(now: datetime) -> datetime:
    """Next routing attempt after a temporary DNS failure (Unreachable queue)."""
    return now + settings.MAILRELAY_CATEGORIZER_RETRY_INTERVAL


# --- decisions over one delivery round (pure: delivery.smtp.deliver reads and writes) -------


@dataclass(frozen=True)
class LinkRetry:
    """A link's connection-retry state (Exchange's counters, on the link row)."""

    failure_count: int = 0
    first_failure_at: datetime | None = None
    next_retry_at: datetime | None = None
    last_error_at: datetime | None = None


@dataclass(frozen=True)
class LinkVerdict:
    """The link after a round: ``failed`` when every host failed (the link goes to
    Retry at ``retry.next_retry_at``); ``timed_out`` when, moreover, its rule's
    final cutoff has passed (the recipients fail)."""

    retry: LinkRetry
    failed: bool
    timed_out: bool


def link_verdict(
    link: LinkRetry,
    *,
    connected: bool,
    last_failure: HostFailure | None,
    domain: str,
    via_mx: bool,
    now: datetime,
) -> LinkVerdict:
    """A round that reached a peer resets the link; one that reached none moves it
    along the connection rule (Exchange's glitch/transient/Retry, compiled)."""
    if connected:
        return LinkVerdict(LinkRetry(last_error_at=link.last_error_at), False, False)
    error = error_name(
        last_failure.phase if last_failure else "connect",
        last_failure.code if last_failure else None,
        last_failure.error if last_failure else "",
        via_mx,
    )
    first_failed = link.first_failure_at or now
    decision = decide(
        address=f"postmaster@{domain}",
        host=(last_failure.host if last_failure and last_failure.host else None) or domain,
        error=error,
        first_failed=first_failed,
        last_tried=link.last_error_at or now,
        next_try=link.next_retry_at,
        now=now,
    )
    retry = LinkRetry(link.failure_count + 1, first_failed, decision.at, now)
    return LinkVerdict(retry, True, decision.timed_out)


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
    active = rules()
    saved = []
    for key, f in by_key.items():
        error = error_name(f.phase, f.code, f.error, via_mx)
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


@dataclass(frozen=True)
class Deferral:
    """A deferred recipient's next try; ``next_attempt_at`` is None when it timed
    out (its rule's final cutoff passed: it fails)."""

    next_attempt_at: datetime | None
    first_failure_at: datetime
    message_failure: bool = False  # counts towards a problem message
    address_hint: RetryData | None = None  # RCPT 4xx: retry data per address+sender


def deferral(
    result: RecipientResult,
    *,
    address: str,
    sender: str,
    first_failure_at: datetime | None,
    last_attempt_at: datetime | None,
    next_attempt_at: datetime | None,
    link: LinkVerdict,
    via_mx: bool,
    now: datetime,
) -> Deferral:
    """When a recipient that got a temporary failure is tried again."""
    first_failed = first_failure_at or now
    if result.scope == "connection" and link.failed:
        # No host answered: the recipient waits for its link.
        if link.timed_out:
            return Deferral(None, first_failed)
        return Deferral(link.retry.next_retry_at or now, first_failed)
    lost = result.scope == "connection" and result.code is None
    host_error = "lost_connection" if lost else ""
    error = error_name(result.phase, result.code, host_error, via_mx)
    decision = decide(
        address=address,
        error=error,
        host=(result.host or None) if host_error else None,
        sender=sender,
        first_failed=first_failed,
        last_tried=last_attempt_at or now,
        next_try=next_attempt_at,
        now=now,
    )
    if decision.timed_out:
        return Deferral(None, first_failed)
    hint = None
    if result.phase == "rcpt":
        hint = RetryData(
            key=address_key(address, sender),
            first_failed=first_failed,
            last_tried=now,
            next_try=decision.at,
            error=error,
            text=result.text[:2000],
        )
    return Deferral(decision.at, first_failed, result.scope == "message", hint)


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
    active = rules()
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
# here as plain strings so this module imports without Django (a test checks
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
