"""Exim retry rules: parser, matching, F/G/H schedules, hints (seed: exim-retry-configuration).

Pure tests, no database and no clock: every time is an offset from ``T0``.
"""

from __future__ import annotations

import random
from datetime import UTC, datetime, timedelta
from io import StringIO
from pathlib import Path

import pytest
from django.core.management import call_command
from django.core.management.base import CommandError
from django.test import override_settings

from delivery.smtp.retryrules import (
    DEFAULT_RULES_TEXT,
    RetryOptions,
    RetryRuleError,
    load_rules,
    load_rules_or_default,
    parse_error_name,
    parse_rules,
)
from delivery.smtp.retryschedule import (
    RetryData,
    TryDecision,
    combine_decisions,
    may_try,
    next_retry,
    projected_schedule,
    record_failure,
)
from queues.lib import address_key, host_key

T0 = datetime(2024, 3, 1, 12, 0, tzinfo=UTC)
S = timedelta(seconds=1)
M = timedelta(minutes=1)
H = timedelta(hours=1)
D = timedelta(days=1)

# §8 of the seed, one rule per line (the seed's text runs them together).
SEED_EXAMPLES = """\
alice@wonderland.fict.example quota_5d F,7d,3h
wonderland.fict.example quota_5d
wonderland.fict.example * F,1h,15m; G,2d,1h,2;
lookingglass.fict.example * F,24h,30m;
* refused_A F,2h,20m;
* * F,2h,15m; G,16h,1h,1.5; F,5d,8h
"""


def rule_of(text: str):
    """The single rule of ``text``."""
    rules = parse_rules(text)
    assert len(rules) == 1
    return rules.rules[0]


def offsets(tries) -> list[timedelta]:
    return [t.at - T0 for t in tries]


# ------------------------------------------------------------------- §8 schedules

_CATCH_ALL_G = [3 * H + 15 * M, 4 * H + 45 * M, 7 * H, 10 * H + 22 * M + 30 * S]
_CATCH_ALL_G += [15 * H + 26 * M + 15 * S, 23 * H + 1 * M + 52 * S]

SEED_SCHEDULES = [
    # line, expected retry offsets after a first failure at T0 (last one: final attempt)
    pytest.param(1, [3 * H * k for k in range(1, 58)], id="alice quota_5d F,7d,3h"),
    pytest.param(2, [], id="quota_5d without parameters bounces at once"),
    pytest.param(
        3,
        [15 * M * k for k in range(1, 6)]  # every 15 minutes for an hour
        # ... then 1h, 2h, 4h, 8h, 16h, and 32h capped at retry_interval_max (24h)
        + [2 * H + 15 * M, 4 * H + 15 * M, 8 * H + 15 * M, 16 * H + 15 * M]
        + [32 * H + 15 * M, 56 * H + 15 * M],
        id="wonderland F,1h,15m; G,2d,1h,2",
    ),
    pytest.param(4, [30 * M * k for k in range(1, 50)], id="lookingglass F,24h,30m"),
    pytest.param(5, [20 * M * k for k in range(1, 8)], id="refused_A F,2h,20m"),
    pytest.param(
        6,
        [15 * M * k for k in range(1, 10)]  # every 15 minutes for 2 hours
        + _CATCH_ALL_G  # from 1h growing by 1.5 up to 16 hours
        + [_CATCH_ALL_G[-1] + 8 * H * k for k in range(1, 14)],  # every 8h up to 5 days
        id="catch-all F,2h,15m; G,16h,1h,1.5; F,5d,8h",
    ),
]


@pytest.mark.parametrize(("line", "expected"), SEED_SCHEDULES)
def test_seed_example_rules_give_the_described_schedule(line, expected):
    rule = next(r for r in parse_rules(SEED_EXAMPLES) if r.line == line)
    tries = projected_schedule(rule, T0)
    assert offsets(tries) == expected
    # Only the last retry is final: it comes after the final cutoff has been reached.
    assert [t.final for t in tries] == [False] * (len(expected) - 1) + [True] * bool(expected)
    if expected:
        assert tries[-2].at - T0 <= rule.final_cutoff < tries[-1].at - T0


def test_seed_wonderland_intervals_double_after_the_first_hour():
    rule = parse_rules(SEED_EXAMPLES).rules[2]
    intervals = [t.interval for t in projected_schedule(rule, T0)]
    assert intervals == [15 * M] * 5 + [1 * H, 2 * H, 4 * H, 8 * H, 16 * H, 24 * H]


def test_seed_catch_all_gives_up_after_five_days_and_default_rule_after_four():
    catch_all = parse_rules(SEED_EXAMPLES).rules[-1]
    assert catch_all.final_cutoff == 5 * D
    tries = projected_schedule(catch_all, T0)
    assert all(t.interval == 8 * H for t in tries if t.param_set.text == "F,5d,8h")
    # §10's default rule: "the cutoff time is four days".
    default = rule_of("* * F,2h,15m; G,16h,1h,1.5; F,4d,6h")
    assert default.final_cutoff == 4 * D
    assert projected_schedule(default, T0)[-1].at - T0 > 4 * D


SEED_MATCHES = [
    # address, error, rule line of SEED_EXAMPLES (None: no rule)
    ("alice@wonderland.fict.example", "quota_6d", 1),
    ("alice@wonderland.fict.example", "quota_5d", 1),
    ("alice@wonderland.fict.example", "quota_4d", 3),  # read recently: general rule
    ("alice@wonderland.fict.example", "quota", 3),  # last read unknown: never quota_<time>
    ("bob@wonderland.fict.example", "quota_5d", 2),
    ("bob@wonderland.fict.example", "timeout_connect_MX", 3),
    ("WONDERLAND.fict.example", "refused_A", 3),
    ("alice@lookingglass.fict.example", "rcpt_452", 4),
    ("x@elsewhere.example", "refused_A", 5),
    ("x@elsewhere.example", "refused_MX", 6),
    ("x@elsewhere.example", "refused", 6),
    ("x@elsewhere.example", None, 6),
]


@pytest.mark.parametrize(("address", "error", "line"), SEED_MATCHES)
def test_seed_example_rules_are_chosen_in_order(address, error, line):
    rule = parse_rules(SEED_EXAMPLES).find(address, error=error)
    assert (rule.line if rule else None) == line


def test_rule_without_parameters_times_out_at_once():
    rules = parse_rules(SEED_EXAMPLES)
    rule = rules.find("bob@wonderland.fict.example", error="quota_9d")
    assert rule.params == () and rule.final_cutoff is None
    outcome = record_failure(None, key="R:bob@wonderland.fict.example", rule=rule, now=T0)
    assert outcome.timed_out and outcome.hint.expired and outcome.hint.next_try == T0
    # Same when no rule at all applies: temporary errors are treated as permanent.
    assert record_failure(None, key="k", rule=None, now=T0).timed_out


# ----------------------------------------------------------------------- parsing


def test_parse_comments_blank_lines_continuations_quotes_and_trailing_semicolon():
    rules = parse_rules(
        "# retry rules\n"
        "\n"
        "begin retry\n"
        '"*@quoted.example"  *  F,1h,15m;\n'
        "   # indented comment\n"
        "spread.example  *  F,2h,15m; \\\n"
        "      # a comment inside a continuation is skipped\n"
        "      G,16h,1h,1.5; \\\n"
        "      f,4d,6h\n"
        "a.example * G , 2h , 10m , 2\n"
    )
    assert [r.line for r in rules] == [4, 6, 10]
    quoted, spread, spaced = rules.rules
    assert quoted.pattern == "*@quoted.example"
    assert [p.text for p in spread.params] == ["F,2h,15m", "G,16h,1h,1.5", "F,4d,6h"]
    assert spread.text == "spread.example  *  F,2h,15m; G,16h,1h,1.5; f,4d,6h"
    assert spaced.params[0].interval == 10 * M and spaced.params[0].multiplier == 2
    assert parse_rules("").rules == () and parse_rules("# nothing\n\n").rules == ()


def test_parse_param_set_fields():
    rule = rule_of("x.example * F,1h30m,90s; G,2d,15m,1.5; H,1w,1h,3")
    f, g, h = rule.params
    assert (f.algorithm, f.cutoff, f.interval) == ("F", 90 * M, 90 * S)
    assert (g.algorithm, g.cutoff, g.interval, float(g.multiplier)) == ("G", 2 * D, 15 * M, 1.5)
    assert (h.algorithm, h.cutoff, h.interval, h.multiplier) == ("H", 7 * D, 1 * H, 3)
    assert rule.final_cutoff == 7 * D
    assert rule_of("x * F,1.00:00:00,00:15:00").params[0].cutoff == D  # Exchange's TimeSpan


PARSE_ERRORS = [
    # text, line, fragment of the message
    ("* * F,2h,15m\n\nfoo.example bar F,1h,1m\n", 3, "unknown error name 'bar'"),
    ("# c\n* * F,2x,15m\n", 2, "bad cutoff time '2x'"),
    ("* * X,1h,1m\n", 1, "unknown retry algorithm 'X'"),
    ("* * G,1h,10m\n", 1, "G,<cutoff>,<start>,<multiplier>"),
    ("* * F,1h\n", 1, "F,<cutoff>,<interval>"),
    ("* * F,1h,15m;;F,2h,1h\n", 1, "empty"),
    ("* * F,2h,15m; F,1h,10m\n", 1, "not later than the cutoff"),
    ("example.com F,1h,15m\n", 1, "is the error name missing?"),
    ("example.com\n", 1, "missing error name"),
    ("* * F,1h,15m\n^[bad * F,1h,1m\n", 2, "bad regular expression"),
    ('"unterminated * F,1h,1m\n', 1, "unterminated quoted string"),
    ("* rcpt_4x5 F,1h,1m\n", 1, "xx, dx or dd"),
    ("* rcpt_5xx F,1h,1m\n", 1, "rcpt_ must be followed by 4xx"),
    ("* * senders F,1h,1m\n", 1, "'=' expected after 'senders'"),
    ("* * senders=\n", 1, "senders= needs an address list"),
    ("* * G,1h,10m,0.5\n", 1, "at least 1"),
    ("* * G,1h,10m,x\n", 1, "bad multiplier 'x'"),
    ("* * F,1h,0s\n", 1, "must be more than 0"),
    ("+relay_domains * F,1h,1m\n", 1, "named lists are not supported"),
    ("lsearch;/etc/doms * F,1h,1m\n", 1, "lookups are not supported"),
    ("@mx_any * F,1h,1m\n", 1, "not supported"),
    ("! * F,1h,1m\n", 1, "'!' must be followed by a pattern"),
    ("* quota_xyz F,1h,1m\n", 1, "bad time in 'quota_xyz'"),
    ("* timeout_connect_B F,1h,1m\n", 1, "unknown error name"),
    ("* * F,2h,15m; \\\n   G,16h,1h,zz\n", 1, "bad multiplier 'zz'"),  # where the rule starts
]


@pytest.mark.parametrize(("text", "line", "fragment"), PARSE_ERRORS)
def test_parse_errors_name_the_line_and_the_problem(text, line, fragment):
    with pytest.raises(RetryRuleError) as caught:
        parse_rules(text, source="retry.conf")
    assert caught.value.line == line
    assert str(caught.value).startswith(f"retry.conf, line {line}: ")
    assert fragment in str(caught.value)


def test_load_rules_reads_a_file_and_reports_a_missing_one(tmp_path: Path):
    path = tmp_path / "retry.conf"
    path.write_text("* * F,2h,15m\n* oops F,1h,1m\n")
    with pytest.raises(RetryRuleError, match=rf"{path}, line 2: unknown error name 'oops'"):
        load_rules(path)
    path.write_text("* * F,2h,15m\n")
    assert load_rules(path).rules[0].params[0].cutoff == 2 * H
    with pytest.raises(RetryRuleError, match="cannot read the rule file"):
        load_rules(tmp_path / "missing.conf")
    default = load_rules_or_default("")
    assert [r.text for r in default] == [DEFAULT_RULES_TEXT.strip()] == ["* * F,2d,15m"]


def test_retry_interval_max_cannot_exceed_24h():
    assert RetryOptions().retry_interval_max == 24 * H
    assert RetryOptions().retry_data_expire == 7 * D
    assert RetryOptions().delay_after_cutoff is True
    with pytest.raises(RetryRuleError, match="cannot be greater than 1d"):
        RetryOptions(retry_interval_max=25 * H)
    with pytest.raises(RetryRuleError, match="must be positive"):
        RetryOptions(retry_interval_max=timedelta(0))


# ---------------------------------------------------------------------- matching

PATTERN_MATCHES = [
    # pattern, address (as find gets it), host, expected
    ("example.com", "u@example.com", None, True),
    ("example.com", "example.com", None, True),  # a bare domain is *@domain
    ("example.com", "u@EXAMPLE.COM", None, True),
    ("example.com", "u@sub.example.com", None, False),
    ("*@example.com", "u@example.com", None, True),
    ("alice@example.com", "alice@example.com", None, True),
    ("alice@example.com", "bob@example.com", None, False),
    ("alice@example.com", "example.com", None, False),  # domain-only key: local part is *
    ("alice@example.com", "alice@example.com", "mx.example.com", False),  # host errors: domain
    ("*-request@example.com", "list-request@example.com", None, True),
    ("*.example.com", "u@mx.example.com", None, True),
    ("*.example.com", "u@a.b.example.com", None, True),
    ("*.example.com", "u@example.com", None, False),
    ("*@*.example.com", "u@a.example.com", None, True),
    ("*", "anyone@anywhere.example", None, True),
    ("!example.com", "u@example.com", None, False),
    ("!example.com", "u@other.example", None, True),
    ("!*.example.com", "u@mx.example.com", None, False),
    (r"^\N[^@]+@xyz\d+\.abc\.example$\N", "bob@xyz12.abc.example", None, True),
    (r"^\N[^@]+@xyz\d+\.abc\.example$\N", "xyz12.abc.example", None, True),  # *@domain key
    (r"^\N[^@]+@xyz\d+\.abc\.example$\N", "u@d.example", "xyz7.abc.example", True),
    # The seed's "Wrong" example: a regex must match a complete address.
    (r"^\Nxyz\d+\.abc\.example$\N", "u@d.example", "xyz7.abc.example", False),
    (r"^\Nxyz\d+\.abc\.example$\N", "xyz12.abc.example", None, False),
    (r"^bob@", "BOB@example.com", None, True),  # address lists match caselessly
    ("*@^mx\\d\\.example$", "u@mx1.example", None, True),
    ("192.168.34.23", "u@a.example", "192.168.34.23", True),  # host given as an IP
]


@pytest.mark.parametrize(("pattern", "address", "host", "expected"), PATTERN_MATCHES)
def test_pattern_matching(pattern, address, host, expected):
    rules = parse_rules(f'"{pattern}" * F,1h,15m')
    assert (rules.find(address, host=host, error="timeout") is not None) is expected


def test_host_errors_match_the_host_first_then_the_domain():
    # §4's example: MX x.y.z, p.q.r and m.n.o for a.b.c.example.
    rules = parse_rules("p.q.r.example * F,24h,30m\na.b.c.example * F,4d,45m\n")

    def line(address, host):
        return rules.find(address, host=host, error="refused_MX").line

    assert line("u@a.b.c.example", "x.y.z.example") == 2  # the domain's rule
    assert line("u@a.b.c.example", "p.q.r.example") == 1  # the host's own rule
    assert line("a.b.c.example", None) == 2  # routing failure for the domain
    assert rules.find("u@other.example", host="m.n.o.example", error="timeout") is None


def test_rules_are_searched_in_order_and_error_and_senders_must_match_too():
    rules = parse_rules(
        "example.com rcpt_452 F,1h,10m\n"
        "example.com timeout F,3h,20m\n"
        "* * F,2h,15m\n"
        "example.com * F,9h,1h\n"  # never reached: the catch-all comes first
    )
    assert rules.find("u@example.com", error="rcpt_452").line == 1
    assert rules.find("u@example.com", error="rcpt_451").line == 3
    assert rules.find("u@example.com", host="mx.example.com", error="timeout_MX").line == 2
    assert rules.find("u@example.com", error="lost_connection").line == 3


def test_senders_lists():
    rules = parse_rules(
        "* rcpt_4xx senders=: F,1h,30m\n"
        'a.domain rcpt_452 senders="xb.dom : yc.dom" G,8h,10m,1.5\n'
        "b.domain * senders=!*@spam.example F,3h,1h\n"
        "* * F,2h,15m\n"
    )

    def line(address, error, sender):
        return rules.find(address, error=error, sender=sender).line

    assert line("u@x.example", "rcpt_421", "") == 1  # bounce messages
    assert line("u@x.example", "rcpt_421", "<>") == 1
    assert line("u@x.example", "rcpt_421", "a@b.example") == 4
    assert line("u@x.example", "rcpt_421", None) == 4  # unknown sender: senders= never matches
    assert line("u@a.domain", "rcpt_452", "me@xb.dom") == 2
    assert line("u@a.domain", "rcpt_452", "me@yc.dom") == 2
    assert line("u@a.domain", "rcpt_452", "me@zz.dom") == 4
    assert line("u@a.domain", "rcpt_451", "me@xb.dom") == 4
    assert line("u@b.domain", "timeout", "me@ok.example") == 3  # negated: all but spam
    assert line("u@b.domain", "timeout", "me@spam.example") == 4
    assert rules.rules[1].senders == "xb.dom : yc.dom"


ERROR_MATCHES = [
    # rule error name, failure, matches
    ("*", "rcpt_452", True),
    ("*", "timeout_connect_MX", True),
    ("auth_failed", "auth_failed", True),
    ("auth_failed", "tls_required", False),
    ("tls_required", "tls_required", True),
    ("lookup", "lookup", True),
    ("lost_connection", "lost_connection", True),
    ("lost_connection", "timeout", False),
    ("rcpt_4xx", "rcpt_452", True),
    ("rcpt_4xx", "rcpt_4xx", True),
    ("rcpt_45x", "rcpt_452", True),
    ("rcpt_45x", "rcpt_450", True),
    ("rcpt_45x", "rcpt_421", False),
    ("rcpt_45x", "rcpt_4xx", False),  # code unknown: only rcpt_4xx covers it
    ("rcpt_452", "rcpt_452", True),
    ("rcpt_452", "rcpt_451", False),
    ("rcpt_436", "rcpt_436", True),
    ("rcpt_4xx", "mail_452", False),
    ("mail_4xx", "mail_421", True),
    ("mail_45x", "mail_451", True),
    ("mail_45x", "data_451", False),
    ("data_4xx", "data_421", True),
    ("data_42x", "data_421", True),
    ("data_452", "data_451", False),
    ("timeout", "timeout", True),
    ("timeout", "timeout_connect_MX", True),
    ("timeout", "timeout_connect_A", True),
    ("timeout", "timeout_connect", True),
    ("timeout", "timeout_MX", True),
    ("timeout", "timeout_A", True),
    ("timeout", "refused", False),
    ("timeout_connect", "timeout_connect_MX", True),
    ("timeout_connect", "timeout_connect_A", True),
    ("timeout_connect", "timeout_MX", False),  # a timeout during the session
    ("timeout_connect_MX", "timeout_connect_MX", True),
    ("timeout_connect_MX", "timeout_connect_A", False),
    ("timeout_connect_MX", "timeout_MX", False),
    ("timeout_connect_A", "timeout_connect_A", True),
    ("timeout_MX", "timeout_MX", True),
    ("timeout_MX", "timeout_connect_MX", True),  # connecting or during the session
    ("timeout_MX", "timeout_A", False),
    ("timeout_MX", "timeout", False),  # host origin unknown
    ("timeout_A", "timeout_connect_A", True),
    ("refused", "refused", True),
    ("refused", "refused_MX", True),
    ("refused", "refused_A", True),
    ("refused_MX", "refused_MX", True),
    ("refused_MX", "refused_A", False),
    ("refused_A", "refused", False),
    ("quota", "quota", True),
    ("quota", "quota_1d", True),
    ("quota_5d", "quota_6d", True),
    ("quota_5d", "quota_5d", True),
    ("quota_5d", "quota_4d", False),
    ("quota_5d", "quota_120h", True),
    ("quota_5d", "quota", False),  # last access unknown: never matched (§5)
    ("quota", "timeout", False),
]


@pytest.mark.parametrize(("rule_error", "failure", "expected"), ERROR_MATCHES)
def test_error_name_matching(rule_error, failure, expected):
    rules = parse_rules(f"* {rule_error} F,1h,15m")
    assert (rules.find("u@example.com", error=failure) is not None) is expected


def test_error_names_are_case_insensitive_and_canonical():
    assert str(parse_error_name("Refused_mx")) == "refused_MX"
    assert str(parse_error_name("TIMEOUT_CONNECT_a")) == "timeout_connect_A"
    assert str(parse_error_name("RCPT_45X")) == "rcpt_45x"
    assert str(parse_error_name("quota_120h")) == "quota_5d"
    assert rule_of("* Refused_MX F,1h,1m").error.text == "refused_MX"
    # Without an error (exim -brt without one) only rules with * apply.
    rules = parse_rules("* timeout F,1h,1m\n* * F,2h,15m")
    assert rules.find("u@example.com").line == 2


# ------------------------------------------------------------------- algorithms


def test_fixed_interval_from_now_whatever_the_history():
    rule = rule_of("* * F,2h,15m")
    step = next_retry(rule, T0, T0 + 40 * M, T0 + 50 * M)
    assert (step.at, step.interval, step.expired) == (T0 + 65 * M, 15 * M, False)


def test_geometric_starts_then_multiplies_the_smaller_of_predicted_and_actual_gap():
    rule = rule_of("* * G,2d,10m,3")
    first = next_retry(rule, T0, T0, T0)  # first failure: no gap yet
    assert first.interval == 10 * M
    second = next_retry(rule, T0, T0, T0 + 10 * M, next_try=T0 + 10 * M)
    assert second.interval == 30 * M
    # A queue run 2h late must not inflate the interval: the predicted gap counts.
    late = next_retry(rule, T0, T0 + 10 * M, T0 + 2 * H + 40 * M, next_try=T0 + 40 * M)
    assert late.interval == 90 * M
    # Tried early (forced retry after 5 minutes): the actual gap is smaller, so the
    # start value applies again.
    early = next_retry(rule, T0, T0 + 10 * M, T0 + 15 * M, next_try=T0 + 40 * M)
    assert early.interval == 10 * M


def test_geometric_intervals_are_whole_seconds_like_exims():
    tries = projected_schedule(rule_of("* * G,1d,7s,1.5"), T0)
    assert [t.interval / S for t in tries[:6]] == [7, 10, 15, 22, 33, 49]


def test_randomised_h_stays_between_start_and_previous_interval_times_multiplier():
    rule = rule_of("* * H,5d,10m,2")
    rng = random.Random(1234)
    drawn = []
    for _ in range(200):
        tries = projected_schedule(rule, T0, rng=rng)
        previous = timedelta(0)
        for t in tries:
            high = max(10 * M, min(previous * 2, 24 * H))
            assert 10 * M <= t.interval <= high
            drawn.append(t.interval)
            previous = t.interval
    assert len(set(drawn)) > 100  # really random, not a fixed geometric series
    # The first interval is always the start value (no previous interval yet).
    assert projected_schedule(rule, T0, rng=random.Random(7))[0].interval == 10 * M
    # Seeded: the same rng seed gives the same schedule.
    again = [projected_schedule(rule, T0, rng=random.Random(s)) for s in (5, 5)]
    assert again[0] == again[1]
    # Without an rng the projection shows the top of the range (= G's series).
    assert offsets(projected_schedule(rule, T0))[:4] == [10 * M, 30 * M, 70 * M, 150 * M]


def test_randomised_h_draws_from_the_rng_between_bounds():
    class Edge(random.Random):
        def __init__(self, pick):
            super().__init__(0)
            self.pick = pick

        def uniform(self, a, b):
            return a if self.pick == "low" else b

    rule = rule_of("* * H,1d,10m,4")
    low = next_retry(rule, T0, T0, T0 + 10 * M, Edge("low"), next_try=T0 + 10 * M)
    high = next_retry(rule, T0, T0, T0 + 10 * M, Edge("high"), next_try=T0 + 10 * M)
    assert (low.interval, high.interval) == (10 * M, 40 * M)


def test_retry_interval_max_caps_every_interval():
    rule = rule_of("* * G,10d,1h,3")
    assert max(t.interval for t in projected_schedule(rule, T0)) == 24 * H
    capped = projected_schedule(rule, T0, options=RetryOptions(retry_interval_max=6 * H))
    assert [t.interval for t in capped[:5]] == [1 * H, 3 * H, 6 * H, 6 * H, 6 * H]
    assert next_retry(rule_of("* * F,4d,2d"), T0, T0, T0).interval == 24 * H


def test_cutoffs_are_measured_from_the_first_failure():
    rule = rule_of("* * F,2h,15m; F,1d,1h; F,4d,6h")
    # The last try was 10 minutes ago, but the first failure 3 hours ago: second set.
    step = next_retry(rule, T0, T0 + 2 * H + 50 * M, T0 + 3 * H)
    assert (step.param_set.text, step.at) == ("F,1d,1h", T0 + 4 * H)
    # Exactly at a cutoff the set still applies ("beyond which" it no longer does).
    assert next_retry(rule, T0, T0, T0 + 2 * H).param_set.text == "F,2h,15m"
    assert next_retry(rule, T0, T0, T0 + 2 * H + S).param_set.text == "F,1d,1h"
    # Past the final cutoff: expired, and the final set gives the post-cutoff time.
    past = next_retry(rule, T0, T0 + 4 * D - H, T0 + 4 * D + H)
    assert past.expired and past.at == T0 + 4 * D + 7 * H


def test_projected_schedule_until_and_limit():
    rule = rule_of("* * F,2d,15m")
    assert offsets(projected_schedule(rule, T0, until=T0 + H)) == [15 * M, 30 * M, 45 * M, H]
    assert len(projected_schedule(rule, T0, limit=10)) == 10
    assert not projected_schedule(rule, T0, limit=10)[-1].final
    assert len(projected_schedule(rule, T0)) == 193  # 2d / 15m, plus the final attempt


def test_exchange_default_retry_timings_as_an_exim_rule():
    # Glitch retry 4 x 1m, then transient 6 x 5m, then every 10m (Exchange's
    # defaults). Cutoffs are inclusive, so each set's cutoff is its last start.
    rule = rule_of("* * F,3m,1m; F,29m,5m; F,2d,10m")
    intervals = [t.interval for t in projected_schedule(rule, T0, until=T0 + 2 * H)]
    assert intervals[:4] == [M] * 4
    assert intervals[4:10] == [5 * M] * 6
    assert set(intervals[10:]) == {10 * M}


# ------------------------------------------------------------------------- hints


def fail(hint, rule, at, **kw):
    return record_failure(hint, key="T:mx.example:192.0.2.1", rule=rule, now=at, **kw)


def test_record_failure_creates_and_advances_a_hint_until_it_expires():
    rule = rule_of("* * F,1h,15m; G,2h,30m,2")
    outcome = fail(None, rule, T0)
    hint = outcome.hint
    assert (hint.first_failed, hint.last_tried, hint.next_try) == (T0, T0, T0 + 15 * M)
    assert not outcome.timed_out and not hint.expired
    times = []
    while not outcome.timed_out:
        outcome = fail(hint, rule, hint.next_try)
        hint = outcome.hint
        times.append(hint.last_tried - T0)
    assert times == [15 * M, 30 * M, 45 * M, H, H + 15 * M, H + 45 * M, 2 * H + 45 * M]
    assert hint.expired and hint.first_failed == T0
    # The post-cutoff retry time comes from the final set (§10).
    assert hint.next_try - hint.last_tried == 2 * H


def test_stale_hints_are_ignored_after_retry_data_expire():
    rule = rule_of("* * F,2h,15m; F,4d,6h")
    old = RetryData("k", T0, T0 + 3 * D, T0 + 3 * D + 6 * H, expired=False)
    fresh = fail(old, rule, T0 + 10 * D + S)  # not written for 7 days and a second
    assert fresh.hint.first_failed == T0 + 10 * D + S
    assert fresh.hint.next_try - fresh.hint.last_tried == 15 * M
    kept = fail(old, rule, T0 + 10 * D)  # exactly 7 days: still used
    assert kept.hint.first_failed == T0 and kept.timed_out
    assert may_try(old, now=T0 + 3 * D + H, rule=rule) is TryDecision.WAIT
    assert may_try(old, now=T0 + 10 * D + S, rule=rule) is TryDecision.TRY
    short = RetryOptions(retry_data_expire=D)
    assert may_try(old, now=T0 + 4 * D + S, rule=rule, options=short) is TryDecision.TRY


def _expired_hint(rule):
    """A host that has failed past its final cutoff, last tried at T0+5h."""
    outcome = fail(RetryData("k", T0, T0 + 4 * H, T0 + 5 * H), rule, T0 + 5 * H)
    assert outcome.timed_out and outcome.hint.expired
    return outcome.hint


def test_delay_after_cutoff_true_bounces_new_messages_until_the_post_cutoff_retry():
    rule = rule_of("* * F,2h,15m; F,4h,1h")
    hint = _expired_hint(rule)
    assert hint.next_try == T0 + 6 * H
    arrived = T0 + 5 * H + 30 * M  # a new message for the failing destination
    decision = may_try(hint, now=arrived, rule=rule, message_arrived=arrived)
    assert decision is TryDecision.EXPIRED
    assert combine_decisions([decision, decision]) == "bounce"
    # At the post-cutoff retry time: one attempt; if it fails, bounce and a new time.
    assert may_try(hint, now=T0 + 6 * H, rule=rule, message_arrived=arrived) is TryDecision.TRY
    again = fail(hint, rule, T0 + 6 * H, message_arrived=arrived)
    assert again.timed_out and again.hint.next_try == T0 + 7 * H
    # A local delivery always gets its one attempt.
    assert may_try(hint, now=arrived, rule=rule, local=True) is TryDecision.TRY


def test_delay_after_cutoff_false_tries_hosts_not_tried_since_the_message_arrived():
    rule = rule_of("* * F,2h,15m; F,4h,1h")
    hint = _expired_hint(rule)
    options = RetryOptions(delay_after_cutoff=False)
    new = T0 + 5 * H + 30 * M  # arrived after the host was last tried
    assert may_try(hint, now=new, rule=rule, message_arrived=new, options=options) is (
        TryDecision.TRY
    )
    outcome = fail(hint, rule, new, message_arrived=new)
    assert outcome.timed_out  # it failed again: bounce
    old = T0 + 4 * H  # arrived before that last try: no new attempt
    decision = may_try(hint, now=new, rule=rule, message_arrived=old, options=options)
    assert decision is TryDecision.EXPIRED


def test_combine_decisions():
    try_, wait, expired = TryDecision.TRY, TryDecision.WAIT, TryDecision.EXPIRED
    assert combine_decisions([expired, try_]) == "try"
    assert combine_decisions([expired, wait]) == "defer"  # some host is still in retry
    assert combine_decisions([expired, expired]) == "bounce"
    assert combine_decisions([]) == "defer"


def test_host_in_retry_is_skipped_until_its_time():
    rule = rule_of("* * F,2h,15m; F,2d,1h")
    hint = fail(None, rule, T0).hint
    assert may_try(hint, now=T0 + 14 * M, rule=rule, message_arrived=T0 + 5 * M) is (
        TryDecision.WAIT
    )
    assert may_try(hint, now=T0 + 15 * M, rule=rule) is TryDecision.TRY


def test_intermittent_per_message_errors_use_the_arrival_when_it_is_earlier():
    # §11 first action: other messages get through and reset the clock, so the
    # first failure of this error is recent; the message arrived long before.
    rule = rule_of("* * F,2h,15m; F,1d,1h")
    hint = RetryData("T:mx.example:192.0.2.1:msg1", T0 + 25 * H, T0 + 25 * H, T0 + 25 * H)
    now = T0 + 25 * H + 15 * M
    per_message = fail(hint, rule, now, message_arrived=T0, per_message=True)
    assert per_message.timed_out and per_message.hint.expired
    assert per_message.hint.first_failed == T0 + 25 * H  # the stored clock is not rewritten
    # A host error does not look at the message's arrival for the cutoffs.
    host = fail(hint, rule, now, message_arrived=T0 + 24 * H, per_message=False)
    assert not host.timed_out and host.hint.next_try == now + 15 * M
    # Within the cutoff the arrival picks the set: 3h of age -> the hourly set.
    young = fail(hint, rule, now, message_arrived=now - 3 * H, per_message=True)
    assert not young.timed_out and young.hint.next_try == now + H


def test_message_older_than_the_cutoff_is_tried_once_then_timed_out():
    # §11 second action, message that arrived before the first failure: the
    # destination's clock was reset by successes, but the message is older than
    # the final cutoff. It is tried even though the retry time has not come, and
    # when that fails it times out with no new retry time.
    rule = rule_of("* * F,2h,15m; F,1d,1h")
    hint = RetryData("k", T0 + 30 * H, T0 + 30 * H, T0 + 30 * H + 15 * M)
    now = T0 + 30 * H + 5 * M
    assert may_try(hint, now=now, rule=rule, message_arrived=T0) is TryDecision.TRY
    assert may_try(hint, now=now, rule=rule, message_arrived=T0 + 20 * H) is TryDecision.WAIT
    outcome = fail(hint, rule, now, message_arrived=T0)
    assert outcome.timed_out
    assert not outcome.hint.expired  # the destination itself has not expired...
    assert outcome.hint.next_try == now  # ...and other messages are considered at once


def test_message_that_arrived_after_the_first_failure_and_outlived_the_cutoff():
    # The same for a message that arrived after the first failure: tried once at
    # the next run although the host's retry time is later, then timed out.
    rule = rule_of("* * F,1h,45m")
    hint = fail(fail(None, rule, T0).hint, rule, T0 + 45 * M).hint
    assert hint.next_try == T0 + 90 * M
    arrived, now = T0 + 1 * M, T0 + 62 * M
    assert may_try(hint, now=now, rule=rule, message_arrived=arrived) is TryDecision.TRY
    outcome = fail(hint, rule, now, message_arrived=arrived)
    assert outcome.timed_out and outcome.hint.expired


def test_retry_keys():
    assert host_key("MX1.Example.", "192.0.2.1") == "T:mx1.example:192.0.2.1"
    assert host_key("mx1.example", "192.0.2.1", 2525) == "T:mx1.example:192.0.2.1:2525"
    assert address_key("u@example.com", "<>") == "R:u@example.com:<>"
    assert address_key("u@example.com", "s@x.example") == "R:u@example.com:<s@x.example>"
    assert address_key("u@example.com", None) == "R:u@example.com"


# ---------------------------------------------------------------------- command


def run_retrytest(*args, **options) -> str:
    out = StringIO()
    call_command("retrytest", *args, stdout=out, **options)
    return out.getvalue()


@pytest.fixture
def seed_rules(tmp_path: Path) -> Path:
    path = tmp_path / "retry.conf"
    path.write_text("# seed §8\n" + SEED_EXAMPLES)
    return path


def test_retrytest_shows_the_rule_and_its_schedule(seed_rules: Path):
    out = run_retrytest("bob@wonderland.fict.example", "--rules", str(seed_rules))
    assert "Retry rule: line 4: wonderland.fict.example * F,1h,15m; G,2d,1h,2;" in out
    assert "retries 1-5: every 15m, +15m to +1h15m (F,1h,15m)" in out
    assert "retry 6: +2h15m (after 1h, G,2d,1h,2)" in out
    assert "retry 11: +2d8h15m (after 1d, G,2d,1h,2)" in out
    assert "Final attempt: retry 11 at +2d8h15m" in out


def test_retrytest_error_host_and_sender(seed_rules: Path, tmp_path: Path):
    out = run_retrytest(
        "x@elsewhere.example", "--rules", str(seed_rules), "--error", "refused_A",
        "--host", "192.0.2.7",
    )  # fmt: skip
    assert "Retry rule: line 6: * refused_A F,2h,20m;" in out
    assert "Host: 192.0.2.7" in out
    path = tmp_path / "senders.conf"
    path.write_text("* rcpt_4xx senders=: F,1h,30m\n* * F,2h,15m\n")
    bounce = run_retrytest("u@x.example", "--rules", str(path), "--error", "rcpt_452",
                           "--sender", "")  # fmt: skip
    assert "Retry rule: line 1:" in bounce and "Sender: <>" in bounce
    nosender = run_retrytest("u@x.example", "--rules", str(path), "--error", "rcpt_452")
    assert "Retry rule: line 2:" in nosender


def test_retrytest_every_retry_at_verbosity_2_and_no_retry_cases(seed_rules: Path):
    out = run_retrytest("u@x.example", "--rules", str(seed_rules), verbosity=2)
    assert "retry 9: +2h15m (after 15m, F,2h,15m)" in out
    assert "retry 10: +3h15m (after 1h, G,16h,1h,1.5)" in out
    none = run_retrytest("bob@wonderland.fict.example", "--rules", str(seed_rules),
                         "--error", "quota_9d")  # fmt: skip
    assert "No retries: a temporary error fails the address at once." in none


def test_retrytest_uses_the_setting_then_the_default(seed_rules: Path):
    with override_settings(MAILRELAY_RETRY_RULES=str(seed_rules)):
        assert "line 6: * refused_A" in run_retrytest("u@x.example", "--error", "refused_A")
    with override_settings(MAILRELAY_RETRY_RULES=""):
        out = run_retrytest("u@x.example", "--error", "refused_A")
    # Without a file, the rules compiled from Exchange's settings apply (delivery.smtp.retry).
    assert "Rules: Exchange settings" in out
    assert "Retry rule: line 5: *  *  F,3m30s,1m; F,31m30s,5m; F,36500d,10m" in out
    assert "retries 1-4: every 1m, +1m to +4m (F,3m30s,1m)" in out
    assert "retries 5-10: every 5m, +9m to +34m (F,31m30s,5m)" in out
    assert "retries 11-294: every 10m, +44m to +1d23h54m (F,36500d,10m)" in out


def test_retrytest_refuses_a_bad_rule_file_and_a_bad_error(tmp_path: Path):
    path = tmp_path / "bad.conf"
    path.write_text("* * F,2h,15m\nexample.com rcpt_4x5 F,1h,10m\n")
    with pytest.raises(CommandError, match=r"line 2: bad error name 'rcpt_4x5'"):
        run_retrytest("u@example.com", "--rules", str(path))
    with pytest.raises(CommandError, match="--error: unknown error name 'nope'"):
        run_retrytest("u@example.com", "--error", "nope")
    with pytest.raises(CommandError, match="cannot read the rule file"):
        run_retrytest("u@example.com", "--rules", str(tmp_path / "missing.conf"))


def test_retrytest_takes_retry_interval_max_from_settings_when_defined(seed_rules: Path):
    with override_settings(MAILRELAY_RETRY_INTERVAL_MAX=6 * H):
        out = run_retrytest("bob@wonderland.fict.example", "--rules", str(seed_rules))
    assert "retry_interval_max 6h" in out
    assert "retries 9-15: every 6h, +14h15m to +2d2h15m (G,2d,1h,2)" in out
    with (
        override_settings(MAILRELAY_RETRY_INTERVAL_MAX=2 * D),
        pytest.raises(CommandError, match="cannot be greater than 1d"),
    ):
        run_retrytest("u@x.example", "--rules", str(seed_rules))


def test_a_rule_written_with_a_u_label_matches_the_routed_a_label():
    rules = parse_rules("bücher.example  *  F,1h,5m\n*.ＥＸＡＭＰＬＥ。org  *  F,2h,10m\n")
    assert rules.find("u@xn--bcher-kva.example").pattern == "bücher.example"
    assert rules.find("u@mail.example.org").pattern == "*.ＥＸＡＭＰＬＥ。org"
    assert rules.find("u@other.example") is None
