"""The outbound client's TLS contexts, built once per process (and per CA file).

Building an ``SSLContext`` costs milliseconds, so a context is made once
and shared by every connection; ``peer_chain`` reads what the peer sent, for
DANE (``delivery.smtp.dane``).
"""

from __future__ import annotations

import ipaddress
import logging
import os
import ssl

from delivery.smtp.tls import TlsRequirement

log = logging.getLogger(__name__)


def sni(host: str) -> str | None:
    try:
        ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        return host.rstrip(".") or None
    return None  # SNI carries names only (RFC 6066 §3)


_tls_context: ssl.SSLContext | None = None


def client_context() -> ssl.SSLContext:
    """Opportunistic TLS (RFC 7435): encrypt, but verify nothing, since an
    unverified channel is still better than cleartext. Built once per process
    because building a context costs milliseconds."""
    global _tls_context
    if _tls_context is None:
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_NONE
        _tls_context = ctx
    return _tls_context


_verifying_contexts: dict[tuple[str, float], ssl.SSLContext] = {}


def context_for(req: TlsRequirement) -> ssl.SSLContext:
    """The opportunistic context, or for ``verify``/``secure``/MTA-STS one that
    checks the chain against ``ca_file`` (the system store when empty) and the
    host name; built once per CA file (and again when the file changes)."""
    if req.verify not in ("ca", "mta-sts"):
        return client_context()
    stamp = os.stat(req.ca_file).st_mtime if req.ca_file else 0.0
    key = (req.ca_file, stamp)
    ctx = _verifying_contexts.get(key)
    if ctx is None:
        ctx = ssl.create_default_context(cafile=req.ca_file or None)
        _verifying_contexts[key] = ctx
    return ctx


def peer_chain(ssl_object: ssl.SSLObject | None) -> list[bytes]:
    """The certificates the peer sent (DER, leaf first), for DANE."""
    if ssl_object is None:
        return []
    inner = getattr(ssl_object, "_sslobj", None)
    get_chain = getattr(inner, "get_unverified_chain", None)
    if get_chain is not None:  # private before Python 3.13, public after
        return [cert.public_bytes(2) for cert in get_chain() or []]  # 2: DER
    leaf = ssl_object.getpeercert(binary_form=True)
    return [leaf] if leaf else []
