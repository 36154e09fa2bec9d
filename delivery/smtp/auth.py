"""AUTH to the next hop (RFC 4954): the client's dialogue, once the connection is secured.

``authenticate`` runs on a ``connection.Connection`` after EHLO and STARTTLS
(the round's ``_Batch`` in ``delivery.smtp.client`` calls it when the next
hop has credentials: ``MAILRELAY_SMTP_AUTH``, in the file format of
``delivery.smtp.tls``, read and looked up for each target by the round's TLS
plan, ``client.load_auth``). It never sends credentials in cleartext, nor
over unverified TLS, unless allowed.
"""

from __future__ import annotations

import base64

from delivery.smtp import outcome
from delivery.smtp.connection import CRLF, Connection, Reply
from delivery.smtp.failure import SessionFailed
from delivery.smtp.tls import ENHANCED as TLS_ENHANCED
from delivery.smtp.tls import TLS_REQUIRED, Credentials

AUTH_FAILED = "auth_failed"  # Exim's error name for a refused AUTH
VERIFIED_PEER = ("ca", "mta-sts", "dane")  # TlsSecurity.verified values that checked the peer


async def authenticate(conn: Connection, creds: Credentials) -> None:
    """AUTH PLAIN, else LOGIN (RFC 4954), on ``conn`` once it is secured;
    never in cleartext unless the credentials allow it, and over TLS only
    when the peer's certificate was verified (a ``verify``/``secure``/``dane``
    or MTA-STS policy) unless the operator allows unverified TLS. A 5xx is
    Exim's ``auth_failed``: that next hop will refuse every connection the
    same way."""
    host = conn.target.host
    if not conn.tls and not creds.allow_cleartext:
        raise SessionFailed(
            outcome.EHLO,
            None,
            f"refusing to send AUTH credentials to {host} without TLS "
            "(add allow-cleartext to its MAILRELAY_SMTP_AUTH line to allow it)",
            error=TLS_REQUIRED,
            enhanced=TLS_ENHANCED,
        )
    unverified = conn.tls and conn.security.verified not in VERIFIED_PEER
    if unverified and not (creds.allow_cleartext or conn.config.auth_over_unverified_tls):
        raise SessionFailed(
            outcome.EHLO,
            None,
            f"refusing to send AUTH credentials to {host}: its TLS certificate was not "
            f"verified (TLS policy {conn.security.policy or 'may'}; give it the level verify, "
            "secure or dane, or set MAILRELAY_SMTP_AUTH_ALLOW_UNVERIFIED_TLS)",
            error=TLS_REQUIRED,
            enhanced=TLS_ENHANCED,
        )
    offered = conn.extensions.get("AUTH", "").upper().split()
    if "PLAIN" in offered:
        mechanism = "PLAIN"
        r = await conn.command(b"AUTH PLAIN " + creds.plain() + CRLF, "AUTH", outcome.EHLO)
    elif "LOGIN" in offered:
        mechanism = "LOGIN"
        r = await _auth_login(conn, creds)
    else:
        raise SessionFailed(
            outcome.EHLO,
            None,
            f"{host} offers no AUTH PLAIN or LOGIN (offered: {' '.join(offered) or 'none'}); "
            "credentials are configured for it",
            error=AUTH_FAILED,
            enhanced="4.7.0",
        )
    if r.code == 235:
        conn.security.auth = mechanism
        return
    error = AUTH_FAILED if r.code // 100 == 5 else ""
    # Say plainly what failed (the reply text is often just "failed"), and
    # keep the peer's enhanced code in its own field.
    label = "authentication failed (auth_failed)" if error else "authentication deferred"
    raise SessionFailed(
        outcome.EHLO,
        r.code,
        f"{label}: {outcome.strip_enhanced(r.text)}",
        error=error,
        enhanced=outcome.parse_enhanced(r.text),
        in_reply_to=f"AUTH {mechanism}",
    )


async def _auth_login(conn: Connection, creds: Credentials) -> Reply:
    """AUTH LOGIN: the user name and the password, each after a 334."""
    r = await conn.command(b"AUTH LOGIN\r\n", "AUTH", outcome.EHLO)
    for secret in (creds.username, creds.password):
        if r.code != 334:
            return r
        answer = base64.b64encode(secret.encode()) + CRLF
        r = await conn.command(answer, "AUTH", outcome.EHLO)
    return r
