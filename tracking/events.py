"""The names of tracking events and of webhook event types (docs/tracking.md, docs/webhooks.md)."""

from __future__ import annotations

RECEIVED = "received"  # the message was stored (client, account, size)
ROUTED = "routed"  # a recipient was placed in a delivery queue (queue, next hop)
DELIVERED = "delivered"  # an attempt the next hop accepted (remote queue id)
DEFERRED = "deferred"  # an attempt that failed temporarily, or an unroutable domain for now
FAILED = "failed"  # an attempt that failed permanently, or a retry timeout
EXPIRED = "expired"  # still waiting at the message's expiry
DSN_SENT = "dsn_sent"  # a DSN (failure, delay, success) was queued to the sender
OPERATOR = "operator"  # an operator action (detail.action: queue_suspend, message_remove…)

TRACKING_EVENTS = (RECEIVED, ROUTED, DELIVERED, DEFERRED, FAILED, EXPIRED, DSN_SENT, OPERATOR)

# Webhook event types: a tracking event's, except that a permanent failure is
# "bounced" and an operator action is its audit name (queue_suspend, …).
BOUNCED = "bounced"
WEBHOOK_BY_TRACKING = {FAILED: BOUNCED}
OPERATOR_ACTIONS = (
    "queue_retry",
    "queue_resubmit",
    "queue_suspend",
    "queue_resume",
    "message_suspend",
    "message_resume",
    "message_resubmit",
    "message_remove",
    "message_export",
    "messages_export",
)
WEBHOOK_EVENTS = (
    DELIVERED,
    DEFERRED,
    BOUNCED,
    EXPIRED,
    DSN_SENT,
    RECEIVED,
    ROUTED,
    *OPERATOR_ACTIONS,
)


def webhook_type(event: str, detail: dict) -> str:
    """The webhook event type of a tracking row."""
    if event == OPERATOR:
        return str(detail.get("action", OPERATOR))
    return WEBHOOK_BY_TRACKING.get(event, event)
