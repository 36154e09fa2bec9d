"""The retry decisions over a delivery round, as tables: pure, no database.

delivery.smtp.outcome (link verdicts, host retry data, which hosts to try) and
delivery.smtp.retry (recipient deferrals) decide; delivery.smtp.deliver only
reads and writes around them.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

import pytest

from delivery.smtp import outcome, retry
from delivery.smtp.retryschedule import RetryData
from delivery.smtp.types import HostFailure, RecipientResult

NOW = datetime(2026, 1, 5, 12, 0, tzinfo=UTC)
MIN = timedelta(minutes=1)


def result(outcome="deferred", phase="rcpt", code=450, scope="recipient", host="mx.example.net"):
    return RecipientResult(
        recipient_id=1,
        message_id=1,
        outcome=outcome,
        phase=phase,
        code=code,
        enhanced="4.2.1" if code else "",
        text="try later",
        host=host,
        ip="192.0.2.1",
        scope=scope,
    )


def refused(host="mx.example.net", ip="192.0.2.1"):
    return HostFailure(host, ip, 25, "connect", None, "connect failed: refused", "refused")


# --- the link -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("failures_before", "expected_interval"),
    [(0, MIN), (3, MIN), (4, 5 * MIN), (9, 5 * MIN), (10, 10 * MIN), (40, 10 * MIN)],
    ids=["first", "last-glitch", "first-transient", "last-transient", "retry", "long-retry"],
)
def test_a_link_whose_every_host_failed_follows_exchanges_timers(
    failures_before, expected_interval
):
    # The n-th failure of a run at Exchange's schedule: glitch 1 min x4,
    # transient 5 min x6, then every 10 min.
    elapsed = sum(
        (MIN if i < 4 else 5 * MIN if i < 10 else 10 * MIN for i in range(failures_before)),
        timedelta(0),
    )
    first = NOW - elapsed
    link = retry.LinkRetry(
        failure_count=failures_before,
        first_failure_at=first if failures_before else None,
        next_retry_at=NOW if failures_before else None,
        last_error_at=NOW - MIN if failures_before else None,
    )
    verdict = outcome.link_verdict(
        link,
        connected=False,
        last_failure=refused(),
        domain="example.net",
        via_mx=True,
        now=NOW,
    )
    assert verdict.failed and not verdict.timed_out
    assert verdict.retry.failure_count == failures_before + 1
    assert verdict.retry.first_failure_at == (first if failures_before else NOW)
    assert verdict.retry.next_retry_at == NOW + expected_interval
    assert verdict.retry.last_error_at == NOW


def test_a_link_that_reached_a_peer_starts_afresh():
    link = retry.LinkRetry(7, NOW - 30 * MIN, NOW, NOW - MIN)
    verdict = outcome.link_verdict(
        link, connected=True, last_failure=None, domain="example.net", via_mx=True, now=NOW
    )
    assert (verdict.failed, verdict.timed_out) == (False, False)
    assert verdict.retry == retry.LinkRetry(0, None, None, NOW - MIN)


def test_a_link_past_its_rules_final_cutoff_times_out(settings, tmp_path):
    rules = tmp_path / "retry.conf"
    rules.write_text("example.net  *  F,1h,10m\n")
    settings.MAILRELAY_RETRY_RULES = str(rules)
    link = retry.LinkRetry(9, NOW - 2 * timedelta(hours=1), NOW, NOW - 10 * MIN)
    verdict = outcome.link_verdict(
        link,
        connected=False,
        last_failure=refused(),
        domain="example.net",
        via_mx=True,
        now=NOW,
    )
    assert verdict.failed and verdict.timed_out


# --- recipients -----------------------------------------------------------------------


@dataclass
class Row:
    scope: str
    phase: str
    code: int | None
    message_failure: bool
    hint: bool


@pytest.mark.parametrize(
    "row",
    [
        Row("recipient", "rcpt", 450, False, True),
        Row("message", "mail", 451, True, False),
        Row("message", "data", 452, True, False),
        Row("connection", "session", None, False, False),  # lost mid-session
    ],
    ids=["rcpt-4xx", "mail-4xx", "data-4xx", "lost-connection"],
)
def test_a_deferred_recipient_gets_its_next_try_from_the_rules(row):
    res = result(phase=row.phase, code=row.code, scope=row.scope)
    link = retry.LinkVerdict(retry.LinkRetry(), failed=False, timed_out=False)
    d = retry.deferral(
        res,
        address="u@example.net",
        sender="a@example.org",
        first_failure_at=None,
        last_attempt_at=None,
        next_attempt_at=NOW,
        link=link,
        via_mx=True,
        now=NOW,
    )
    assert d.first_failure_at == NOW
    assert d.next_attempt_at == NOW + MIN  # the first glitch retry
    assert d.message_failure is row.message_failure
    if row.hint:
        assert d.address_hint is not None
        assert d.address_hint.key == "R:u@example.net:<a@example.org>"
        assert d.address_hint.next_try == NOW + MIN
        assert d.address_hint.error == "rcpt_450"
    else:
        assert d.address_hint is None


@pytest.mark.parametrize(
    ("timed_out", "expected"),
    [(False, NOW + 5 * MIN), (True, None)],
    ids=["waits-for-its-link", "times-out-with-its-link"],
)
def test_a_recipient_whose_link_failed_waits_for_the_link(timed_out, expected):
    link = retry.LinkVerdict(
        retry.LinkRetry(5, NOW - 10 * MIN, NOW + 5 * MIN, NOW), failed=True, timed_out=timed_out
    )
    d = retry.deferral(
        result(phase="connect", code=None, scope="connection"),
        address="u@example.net",
        sender="a@example.org",
        first_failure_at=NOW - 10 * MIN,
        last_attempt_at=NOW - 5 * MIN,
        next_attempt_at=NOW,
        link=link,
        via_mx=True,
        now=NOW,
    )
    assert d.next_attempt_at == expected
    assert d.first_failure_at == NOW - 10 * MIN
    assert not d.message_failure and d.address_hint is None


# --- hosts ----------------------------------------------------------------------------


def test_every_host_that_failed_gets_retry_data():
    failures = [refused("mx1.example.net", "192.0.2.1"), refused("mx2.example.net", "192.0.2.2")]
    hints = outcome.host_hints(failures, {}, domain="example.net", via_mx=True, now=NOW)
    assert [(h.key, h.error, h.first_failed, h.next_try) for h in hints] == [
        ("T:mx1.example.net:192.0.2.1", "refused_MX", NOW, NOW + MIN),
        ("T:mx2.example.net:192.0.2.2", "refused_MX", NOW, NOW + MIN),
    ]


@dataclass(frozen=True)
class Target:
    host: str
    ip: str
    port: int = 25


def hint(target: Target, *, next_try: datetime, expired: bool = False) -> RetryData:
    return RetryData(
        key=f"T:{target.host}:{target.ip}",
        first_failed=NOW - timedelta(days=1),
        last_tried=NOW - MIN,
        next_try=next_try,
        expired=expired,
        error="refused_MX",
    )


MX1, MX2 = Target("mx1.example.net", "192.0.2.1"), Target("mx2.example.net", "192.0.2.2")


@pytest.mark.parametrize(
    ("hints", "expected", "verdict"),
    [
        ({}, [MX1, MX2], "try"),
        ({MX1: dict(next_try=NOW + MIN)}, [MX2], "try"),
        ({MX1: dict(next_try=NOW - MIN)}, [MX1, MX2], "try"),
        ({MX1: dict(next_try=NOW + MIN), MX2: dict(next_try=NOW + MIN)}, [MX1, MX2], "try"),
        (
            {
                MX1: dict(next_try=NOW + MIN, expired=True),
                MX2: dict(next_try=NOW + MIN, expired=True),
            },
            [],
            "bounce",
        ),
    ],
    ids=["no-data", "one-waiting", "one-due", "all-waiting", "all-past-cutoff"],
)
def test_which_hosts_a_round_tries(hints, expected, verdict):
    data = {h.key: h for h in (hint(t, **kw) for t, kw in hints.items())}
    assert outcome.usable_targets([MX1, MX2], data, domain="example.net", now=NOW) == (
        expected,
        verdict,
    )
