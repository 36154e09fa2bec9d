"""The next hop's own queue id, read from its reply to the end of data."""

from __future__ import annotations

import re

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
