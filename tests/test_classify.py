"""Failure classification: by reply code and phase, never by text."""

import pytest

from delivery.smtp import outcome
from delivery.smtp.outcome import Classification, classify, classify_local, parse_enhanced

D, F, OK = outcome.DEFERRED, outcome.FAILED, outcome.DELIVERED
CONN, MSG, RCPT = outcome.SCOPE_CONNECTION, outcome.SCOPE_MESSAGE, outcome.SCOPE_RECIPIENT


@pytest.mark.parametrize(
    ("phase", "code", "text", "expected"),
    [
        # no reply at all: always a deferred connection problem
        ("connect", None, "Connection refused", (D, CONN, "4.4.1")),
        ("greeting", None, "timeout", (D, CONN, "4.4.2")),
        ("ehlo", None, "lost", (D, CONN, "4.4.2")),
        ("starttls", None, "handshake failed", (D, CONN, "4.7.5")),
        ("session", None, "lost connection after DATA", (D, CONN, "4.4.2")),
        # connection phases: deferred even on 5xx (expiry fails them later)
        ("greeting", 421, "4.3.2 Service not available", (D, CONN, "4.3.2")),
        ("greeting", 554, "5.3.2 no SMTP service here", (D, CONN, "5.3.2")),
        ("greeting", 554, "go away", (D, CONN, "5.0.0")),
        ("ehlo", 550, "nope", (D, CONN, "5.0.0")),
        ("starttls", 454, "4.7.0 TLS not available", (D, CONN, "4.7.0")),
        ("session", 500, "5.5.1 bad RSET", (D, CONN, "5.5.1")),
        # per-message phases
        ("mail", 250, "2.1.0 Ok", (OK, MSG, "2.1.0")),
        ("mail", 451, "4.3.0 try later", (D, MSG, "4.3.0")),
        ("mail", 553, "5.7.1 sender rejected", (F, MSG, "5.7.1")),
        ("mail", 550, "sender rejected", (F, MSG, "5.0.0")),
        ("data", 250, "2.0.0 Ok: queued as ABC", (OK, MSG, "2.0.0")),
        ("data", 250, "Ok", (OK, MSG, "2.0.0")),
        ("data", 452, "4.3.1 insufficient storage", (D, MSG, "4.3.1")),
        ("data", 554, "5.6.0 content rejected", (F, MSG, "5.6.0")),
        ("data", 451, "local error", (D, MSG, "4.0.0")),
        # per-recipient
        ("rcpt", 250, "2.1.5 Ok", (OK, RCPT, "2.1.5")),
        ("rcpt", 450, "4.2.1 mailbox busy", (D, RCPT, "4.2.1")),
        ("rcpt", 452, "4.5.3 too many recipients", (D, RCPT, "4.5.3")),
        ("rcpt", 550, "5.1.1 user unknown", (F, RCPT, "5.1.1")),
        ("rcpt", 553, "no such user", (F, RCPT, "5.0.0")),
        # 421 closes the channel whatever it answers
        ("mail", 421, "4.4.2 shutting down", (D, CONN, "4.4.2")),
        ("rcpt", 421, "closing", (D, CONN, "4.0.0")),
        ("data", 421, "4.3.2 bye", (D, CONN, "4.3.2")),
        # the code decides, not the text
        ("rcpt", 550, "temporary failure, please try again", (F, RCPT, "5.0.0")),
        ("rcpt", 450, "user unknown, permanently", (D, RCPT, "4.0.0")),
        # enhanced class disagreeing with the reply: the reply code wins
        ("rcpt", 550, "4.2.2 mailbox full", (F, RCPT, "5.2.2")),
        ("rcpt", 451, "5.1.1 user unknown", (D, RCPT, "4.1.1")),
        # not an enhanced code: version numbers, missing separator
        ("rcpt", 550, "5.1.1.1 odd", (F, RCPT, "5.0.0")),
        ("rcpt", 550, "5.1.1user", (F, RCPT, "5.0.0")),
        ("rcpt", 550, "3.1.1 odd class", (F, RCPT, "5.0.0")),
        ("rcpt", 550, "5.1234.1 subject too long", (F, RCPT, "5.0.0")),
        # unexpected reply classes are protocol errors: retried
        ("rcpt", 354, "go ahead", (D, RCPT, "4.5.0")),
        ("data", 199, "what", (D, MSG, "4.5.0")),
        ("mail", 650, "what", (D, MSG, "4.5.0")),
    ],
)
def test_classify(phase, code, text, expected):
    assert classify(phase, code, text) == Classification(*expected)


@pytest.mark.parametrize(
    ("phase", "enhanced", "expected"),
    [
        ("mail", "5.3.4", (F, MSG, "5.3.4")),
        ("mail", "5.6.7", (F, MSG, "5.6.7")),
        ("rcpt", "5.1.3", (F, RCPT, "5.1.3")),
        ("rcpt", "4.4.3", (D, RCPT, "4.4.3")),
        ("connect", "5.4.4", (D, CONN, "5.4.4")),
    ],
)
def test_classify_local(phase, enhanced, expected):
    assert classify_local(phase, enhanced) == Classification(*expected)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("2.0.0 Ok", "2.0.0"),
        ("5.1.10 Recipient address rejected", "5.1.10"),
        ("4.7.1", "4.7.1"),
        ("4.7.1\tTabbed", "4.7.1"),
        ("Ok 2.0.0", ""),
        ("", ""),
        ("5.1", ""),
    ],
)
def test_parse_enhanced(text, expected):
    assert parse_enhanced(text) == expected


def test_strip_enhanced():
    assert outcome.strip_enhanced("5.1.1 <x@y>: user unknown") == "<x@y>: user unknown"
    assert outcome.strip_enhanced("user unknown") == "user unknown"


def test_constants_match_the_models():
    from queues.models import AttemptOutcome, AttemptPhase

    assert set(outcome.SCOPE_BY_PHASE) == set(AttemptPhase.values)
    assert {outcome.DELIVERED, outcome.DEFERRED, outcome.FAILED} == set(AttemptOutcome.values)
    assert set(outcome.NO_REPLY_ENHANCED) == set(AttemptPhase.values) - {outcome.ROUTE}
