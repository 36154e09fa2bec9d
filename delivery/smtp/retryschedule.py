"""Exim's retry rules evaluated: retry times, schedules and the retry data (hints).

Pure, as ``retryrules`` is: every function that needs "now" takes it, and
the randomised H algorithm takes an ``rng``, so a five-day schedule is
computed (and tested) in microseconds.

* :func:`next_retry` computes the next retry time from a rule (§7);
  :func:`projected_schedule` lists the whole schedule (for ``retrytest``).
* :class:`RetryData` is the retry data kept per host/IP or per address+sender;
  :func:`record_failure` updates it after a failed attempt and says whether the
  address has timed out (§9-§11); :func:`may_try` says whether a destination
  may be tried now (§10, §11).
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterable
from dataclasses import dataclass, replace
from datetime import datetime, timedelta
from enum import StrEnum
from fractions import Fraction
from typing import Literal

from delivery.smtp.retryrules import (
    DEFAULT_OPTIONS,
    ParamSet,
    RetryOptions,
    Rule,
)

_ZERO = timedelta(0)
_SECOND = timedelta(seconds=1)
# H needs randomness in production; record_failure uses this when given no rng.
_RNG = random.Random()


# ------------------------------------------------------------------------- schedule


@dataclass(frozen=True)
class NextRetry:
    """The answer of :func:`next_retry`.

    ``expired`` means the destination has been failing for longer than the
    final cutoff: the address times out. ``at`` is still computed then, from
    the final parameter set (the "post-cutoff retry time" of §10), except for
    a rule without parameter sets, where it is ``now``.
    """

    at: datetime
    interval: timedelta
    param_set: ParamSet | None
    expired: bool


def _active_set(rule: Rule, failing: timedelta) -> tuple[ParamSet | None, bool]:
    """The first set whose cutoff has not passed, else the final set and expired=True."""
    for param_set in rule.params:
        if failing <= param_set.cutoff:  # Exim: "failing_interval <= rule->timeout"
            return param_set, False
    return (rule.params[-1] if rule.params else None), True


def _interval(param_set: ParamSet, last_gap: timedelta, rng: random.Random | None) -> timedelta:
    """One step of F, G or H (times in whole seconds, as Exim computes them)."""
    start = param_set.interval
    if param_set.algorithm == "F":
        return start
    grown = timedelta(seconds=math.floor(Fraction(last_gap / _SECOND) * param_set.multiplier))
    if param_set.algorithm == "G":
        # Start at `start`; once the previous gap has reached it, multiply.
        return start if last_gap < start else grown
    # H: the previous gap times the multiplier is the maximum of the next
    # interval, `start` its minimum, and the interval is drawn between them (§7).
    upper = max(start, grown)
    if upper <= start:
        return start
    if rng is None:
        return upper  # no randomness asked for: the latest the retry can be
    low, high = start / _SECOND, upper / _SECOND
    return timedelta(seconds=min(high, max(low, math.floor(rng.uniform(low, high)))))


def next_retry(
    rule: Rule,
    first_failed: datetime,
    last_tried: datetime,
    now: datetime,
    rng: random.Random | None = None,
    *,
    next_try: datetime | None = None,
    options: RetryOptions = DEFAULT_OPTIONS,
) -> NextRetry:
    """Compute when to try again after a failure at ``now`` (§7, Exim's retry_update).

    Steps:

    1. ``failing = now - first_failed`` (pass the earlier of arrival and first
       failure as ``first_failed`` for message errors, §11).
    2. Scan the parameter sets in order for the first whose cutoff is not yet
       passed (``failing <= cutoff``). If none is left, the destination has
       expired; the final set still computes the post-cutoff retry time.
       A rule without sets: expired, next try ``now``.
    3. ``last_gap`` = the smaller of the predicted gap
       (``next_try - last_tried``, when known) and the actual gap
       (``now - last_tried``): a late queue run must not inflate G and H.
       For a first failure ``last_tried == now``, so ``last_gap`` is 0.
    4. Interval: F -> ``interval``. G -> ``start`` while ``last_gap < start``,
       else ``last_gap * multiplier``. H -> drawn from ``rng`` uniformly
       between ``start`` and ``max(start, last_gap * multiplier)`` (without
       an ``rng``, the maximum).
    5. Cap the interval at ``options.retry_interval_max``.
    """
    failing = now - first_failed
    param_set, expired = _active_set(rule, failing)
    if param_set is None:
        return NextRetry(now, _ZERO, None, True)
    actual_gap = now - last_tried
    predicted_gap = (next_try - last_tried) if next_try is not None else actual_gap
    last_gap = max(_ZERO, min(predicted_gap, actual_gap))
    interval = min(_interval(param_set, last_gap, rng), options.retry_interval_max)
    return NextRetry(now + interval, interval, param_set, expired)


@dataclass(frozen=True)
class ScheduledTry:
    """One retry in a projected schedule; ``final`` marks the last attempt,
    after whose failure the address times out."""

    at: datetime
    interval: timedelta
    param_set: ParamSet
    final: bool = False


def projected_schedule(
    rule: Rule,
    first_failed: datetime,
    until: datetime | None = None,
    *,
    rng: random.Random | None = None,
    options: RetryOptions = DEFAULT_OPTIONS,
    limit: int = 10_000,
) -> list[ScheduledTry]:
    """The retry times after a first failure at ``first_failed``, as ``exim -brt`` would explain.

    Steps:

    1. Assume every retry happens exactly at its time and fails.
    2. From ``first_failed`` call :func:`next_retry` repeatedly, feeding back
       ``last_tried`` and ``next_try`` as the hint would hold them.
    3. Stop when :func:`next_retry` reports expiry: the retry just listed is
       the final attempt (``final=True``). A rule without parameter sets has
       no retries (empty list).
    4. Also stop after ``until`` (retries later than it are not listed) or
       after ``limit`` entries (a guard against ``F,90d,1s``).
    """
    tries: list[ScheduledTry] = []
    now = last_tried = first_failed
    scheduled: datetime | None = None
    while len(tries) < limit:
        step = next_retry(
            rule, first_failed, last_tried, now, rng, next_try=scheduled, options=options
        )
        if step.expired:
            if tries:
                tries[-1] = replace(tries[-1], final=True)
            break
        if until is not None and step.at > until:
            break
        assert step.param_set is not None  # not expired implies a set
        tries.append(ScheduledTry(step.at, step.interval, step.param_set))
        last_tried, scheduled, now = now, step.at, step.at
    return tries


# ---------------------------------------------------------------------------- hints


@dataclass(frozen=True)
class RetryData:
    """Retry data for one key (a host/IP, a host+message, an address+sender).

    As in Exim these are hints: deleting them is always safe. A success
    deletes the hint (that is what resets the "retry clock", §11).
    """

    key: str
    first_failed: datetime
    last_tried: datetime
    next_try: datetime
    expired: bool = False
    error: str = ""
    text: str = ""


def is_stale(hint: RetryData, now: datetime, options: RetryOptions = DEFAULT_OPTIONS) -> bool:
    """§9: data not written for longer than ``retry_data_expire`` is ignored.

    Exim timestamps each write; a hint is written at every failure, so
    ``last_tried`` is that timestamp.
    """
    return now - hint.last_tried > options.retry_data_expire


@dataclass(frozen=True)
class FailureOutcome:
    """The result of :func:`record_failure`.

    ``timed_out``: give up on this destination now (for a host, the address
    bounces once every host it may use has timed out). ``hint`` is the data
    to store either way.
    """

    hint: RetryData
    timed_out: bool
    next: NextRetry | None


def record_failure(
    hint: RetryData | None,
    *,
    key: str,
    rule: Rule | None,
    now: datetime,
    rng: random.Random | None = None,
    message_arrived: datetime | None = None,
    per_message: bool = False,
    error: str = "",
    text: str = "",
    options: RetryOptions = DEFAULT_OPTIONS,
) -> FailureOutcome:
    """Update the retry hint after a failed attempt at ``now`` (Exim's retry_update).

    Steps:

    1. No hint, or a stale one (§9): start afresh with
       ``first_failed = last_tried = next_try = now``.
    2. No rule, or a rule without parameter sets: there are no retries; the
       destination times out at once (expired, next try ``now``).
    3. For a per-message error (not a host error: MAIL/DATA/RCPT 4xx, quota)
       the cutoffs are measured from the earlier of the message's arrival
       and the first failure (§11, first action): a clock reset by other
       messages' successes must not keep this one for ever.
    4. :func:`next_retry` gives the next try and whether the final cutoff has
       passed; if so the hint is marked expired and the destination times out
       (the post-cutoff retry time is kept for §10).
    5. §11, second action: a message that arrived no later than the first
       failure and has been queued for longer than the final cutoff times
       out, and the next try is ``now`` instead of a new retry time, so that
       other messages for the destination are considered at once.
    6. Write ``last_tried = now``, the next try, the expired flag, the error.

    ``rng`` drives H; without one a module-level ``random.Random`` is used, so
    H stays random in production (tests pass a seeded one).
    """
    rng = rng if rng is not None else _RNG
    if hint is None or is_stale(hint, now, options):
        hint = RetryData(key=key, first_failed=now, last_tried=now, next_try=now)
    if rule is None or not rule.params:
        new = replace(
            hint, key=key, last_tried=now, next_try=now, expired=True, error=error, text=text
        )
        return FailureOutcome(new, True, None)
    first_failed = hint.first_failed
    if per_message and message_arrived is not None and message_arrived < first_failed:
        first_failed = message_arrived
    step = next_retry(
        rule, first_failed, hint.last_tried, now, rng, next_try=hint.next_try, options=options
    )
    timed_out = step.expired
    next_try = step.at
    final_cutoff = rule.final_cutoff
    if (
        not step.expired
        and message_arrived is not None
        and final_cutoff is not None
        and message_arrived <= hint.first_failed
        and now - message_arrived > final_cutoff
    ):
        timed_out = True
        next_try = now
    new = replace(
        hint,
        key=key,
        last_tried=now,
        next_try=next_try,
        expired=step.expired,
        error=error,
        text=text,
    )
    return FailureOutcome(new, timed_out, step)


class TryDecision(StrEnum):
    """Whether a destination (one host/IP, or an address) may be tried now."""

    TRY = "try"  # try it now
    WAIT = "wait"  # retry time not reached: defer without trying
    EXPIRED = "expired"  # past its final cutoff and not due: do not try


def may_try(
    hint: RetryData | None,
    *,
    now: datetime,
    rule: Rule | None,
    message_arrived: datetime | None = None,
    local: bool = False,
    options: RetryOptions = DEFAULT_OPTIONS,
) -> TryDecision:
    """May this destination be tried now for a message? (Exim's retry_check_address, §10, §11.)

    Steps:

    1. No hint, or a stale one (§9): try.
    2. The retry time has come (``now >= next_try``): try (for an expired
       hint this is the one post-cutoff attempt of §10; if it fails,
       :func:`record_failure` times the address out).
    3. Not yet due and not expired: try anyway when the message has been
       queued for longer than the rule's final cutoff (§11: tried once, then
       timed out), or when there is no rule at all; otherwise wait.
    4. Not yet due and expired (§10): a local delivery always gets its one
       attempt. Remote with ``delay_after_cutoff`` (default): EXPIRED, i.e.
       bounce without trying until the post-cutoff retry time. Remote without
       it: try if the destination has not been tried since the message
       arrived, else EXPIRED.

    For a remote address, combine the answers of its hosts/IPs with
    :func:`combine_decisions`.
    """
    if hint is None or is_stale(hint, now, options):
        return TryDecision.TRY
    if now >= hint.next_try:
        return TryDecision.TRY
    if not hint.expired:
        final_cutoff = rule.final_cutoff if rule is not None else None
        if final_cutoff is None:
            return TryDecision.TRY
        if message_arrived is not None and now - message_arrived > final_cutoff:
            return TryDecision.TRY
        return TryDecision.WAIT
    if local:
        return TryDecision.TRY
    if options.delay_after_cutoff:
        return TryDecision.EXPIRED
    if message_arrived is not None and hint.last_tried < message_arrived:
        return TryDecision.TRY
    return TryDecision.EXPIRED


def combine_decisions(
    decisions: Iterable[TryDecision],
) -> Literal["try", "defer", "bounce"]:
    """An address's fate from its hosts' decisions (§10).

    Any host to try: try those. Every host expired (past its final cutoff and
    not due): bounce without an attempt. Otherwise (some host merely waiting,
    or no host at all): defer.
    """
    seen = list(decisions)
    if TryDecision.TRY in seen:
        return "try"
    if seen and all(d is TryDecision.EXPIRED for d in seen):
        return "bounce"
    return "defer"
