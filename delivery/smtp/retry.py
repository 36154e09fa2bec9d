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

Below the schedule: the link's and a deferred recipient's retry state and
next try. How one reply is classified, the link's verdict after a round
and the retry data stored between rounds (Exim's hints: the ``RetryHint``
table) are the round's outcome (``delivery.smtp.outcome``), which decides
with these.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta

from django.conf import settings

from delivery.smtp.retryrules import RetryOptions, RetryRules, Rule, load_rules, parse_rules
from delivery.smtp.retryschedule import NextRetry, RetryData, next_retry
from delivery.smtp.types import RecipientResult
from queues.config import once_per_process
from queues.lib import address_key, format_duration

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


@once_per_process
def rules() -> RetryRules:
    """The active rule list: the operator's file (``MAILRELAY_RETRY_RULES``, read
    once per process) before the rules compiled from Exchange's settings."""
    active = options()
    compiled = parse_rules(exchange_rules_text(), source="Exchange settings", options=active)
    path = settings.MAILRELAY_RETRY_RULES
    if not path:
        return compiled
    own = load_rules(path, options=active)
    return RetryRules(own.rules + compiled.rules, active, f"{path} + Exchange settings")


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


# --- the retry state of a link and of a deferred recipient (pure: the round's outcome,
# delivery.smtp.outcome, decides with them; delivery.smtp.deliver writes it) -------------


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
