"""The NOTIFY rule (RFC 3461), written once: who is owed which report.

Pure (no Django models, no SMTP): the DSN builder and notifier
(``queues.bounce``), the delivery round (a "relayed" report owed on
success), the operator's preview of a removal's NDRs (``wants_q``, the same
rule as a query) and the explain page all ask here.
"""

from __future__ import annotations

from django.db.models import Q

# Kinds, named after the NOTIFY keywords (RFC 3461 §4.1).
FAILURE = "failure"
DELAY = "delay"
SUCCESS = "success"
KINDS = (FAILURE, DELAY, SUCCESS)

# Defaults when NOTIFY was not given (RFC 3461 §4.1 leaves it to us; FAILURE,DELAY
# is what Postfix, Exim and Exchange do).
DEFAULT_NOTIFY = frozenset({FAILURE, DELAY})


def null_sender(mail_from: str) -> bool:
    """Reports never go to the null sender (RFC 5321 §4.5.5, RFC 3461 §6.2: a
    report about a report could loop forever)."""
    return mail_from.strip() in ("", "<>")


def wants(kind: str, notify: str, mail_from: str) -> bool:
    """Whether a ``kind`` report is owed for a recipient with this NOTIFY value.

    Never to the null sender; NOTIFY=NEVER wants none; no NOTIFY means
    FAILURE,DELAY; otherwise exactly the listed kinds.
    """
    if kind not in KINDS:
        raise ValueError(f"unknown DSN kind {kind!r}")
    if null_sender(mail_from):
        return False
    keywords = {word.strip().lower() for word in notify.split(",") if word.strip()}
    if not keywords:
        return kind in DEFAULT_NOTIFY
    if "never" in keywords:
        return False
    return kind in keywords


def wants_q(kind: str, prefix: str = "") -> Q:
    """``wants`` on recipient rows, as a query (``prefix``: the path to the
    recipient, e.g. "recipients__"); the null-sender part is the message's,
    ``null_sender_q``."""
    if kind not in KINDS:
        raise ValueError(f"unknown DSN kind {kind!r}")
    notify = f"{prefix}notify"
    listed = Q(**{f"{notify}__icontains": kind}) & ~Q(**{f"{notify}__icontains": "never"})
    return Q(**{notify: ""}) | listed if kind in DEFAULT_NOTIFY else listed


def null_sender_q(prefix: str = "") -> Q:
    """``null_sender`` on message rows, as a query."""
    return Q(**{f"{prefix}mail_from__in": ("", "<>")})
