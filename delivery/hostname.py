"""Our own name, as peers see it: a start-up warning when it cannot work.

The relay greets, EHLOs and writes Received headers with MAILRELAY_HOSTNAME
(else the machine's FQDN). Receivers refuse an EHLO of ``localhost`` or of a
name without a dot, so a relay named so delivers nothing to the Internet;
``runsmtp`` and ``runall`` say so once when they start.
"""

from __future__ import annotations

LOCAL_NAMES = {"localhost", "localhost.localdomain", "localhost6", "localhost6.localdomain6"}


def hostname_warning(name: str) -> str | None:
    """The warning for ``name``, or None when it is a plausible public name."""
    bare = name.strip().rstrip(".").lower()
    if bare in LOCAL_NAMES:
        why = "is localhost"
    elif "." not in bare:
        why = "has no dot"
    else:
        return None
    return (
        f"warning: our hostname {name!r} {why}: the relay greets and EHLOs with it, and "
        "receivers on the Internet refuse such a name. Set MAILRELAY_HOSTNAME to this "
        "relay's DNS name (e.g. relay.example.com); for a local trial it does no harm."
    )
