"""The signature of a webhook (docs/webhooks.md): HMAC-SHA256 of ``"{t}.{body}"``."""

from __future__ import annotations

import hashlib
import hmac

SIGNATURE_HEADER = "X-Mailrelay-Signature"
EVENT_ID_HEADER = "X-Mailrelay-Event-Id"
EVENT_TYPE_HEADER = "X-Mailrelay-Event"


def signature(secret: str, timestamp: int, body: str) -> str:
    mac = hmac.new(secret.encode(), f"{timestamp}.{body}".encode(), hashlib.sha256)
    return mac.hexdigest()


def header(secret: str, timestamp: int, body: str) -> str:
    """The value of X-Mailrelay-Signature: ``t=<unix seconds>,v1=<hex>``."""
    return f"t={timestamp},v1={signature(secret, timestamp, body)}"
