"""Text from strangers, made storable: the one NUL scrubber.

PostgreSQL text cannot hold NUL, and a peer's reply, a header or a tracking
field may carry one. Every writer of such text scrubs it here.
"""

from __future__ import annotations

REPLACEMENT = "\ufffd"


def scrub_nul(text: str, replacement: str = REPLACEMENT) -> str:
    """``text`` without NUL (each replaced by ``replacement``, U+FFFD unless told)."""
    return text.replace("\x00", replacement) if "\x00" in text else text
