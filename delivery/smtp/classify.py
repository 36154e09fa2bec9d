"""Classify the outcome of an outbound SMTP exchange, by reply code and phase.

Pure and table-driven: no I/O, no Django. The decision is taken from the
reply code and the phase it answered, never from the reply text (DESIGN.md,
"Failure types"); the text is only read for the RFC 3463 enhanced status
code the peer may have put at its start.

- **Scope** comes from the phase: connect, greeting, EHLO, STARTTLS and
  session (lost connection, timeout) are per-connection; MAIL and DATA are
  per-message; RCPT is per-recipient. A ``421`` reply closes the channel
  (RFC 5321 §3.8) whatever command it answered, so it is per-connection too.
- **Outcome** comes from the reply class: 2xx delivered, 4xx deferred, 5xx
  failed. Per-connection failures are always deferred: a host that is down
  or refuses us now says nothing final about the recipients, and expiry
  fails them if it lasts. No reply at all (refused, timeout, reset) is a
  per-connection failure and deferred too.
- **Enhanced status code**: parsed from the reply text when present; when
  absent a default is taken from a table by phase (no reply) or by class.

The phase, scope and outcome strings are the values of
``queues.models.AttemptPhase`` and ``AttemptOutcome``; they are repeated
here as plain strings so this module imports without Django (a test checks
that they match).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

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
