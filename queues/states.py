"""The states of the queue store's rows and the other closed vocabularies.

Kept apart from the models so that the state transitions (queues.transitions)
and the models can both use them without importing each other.
"""

from __future__ import annotations

from django.db import models


class DeliveryType(models.TextChoices):
    SUBMISSION = "submission", "Submission"
    SMART_HOST = "smart_host", "Smart host"
    DNS_MX = "dns_mx", "DNS MX"
    TRANSPORT_MAP = "transport_map", "Transport map"
    UNREACHABLE = "unreachable", "Unreachable"
    POISON = "poison", "Poison"
    DEAD_LETTER = "dead_letter", "Dead-letter"


class LinkState(models.TextChoices):
    READY = "ready", "Ready"
    ACTIVE = "active", "Active"
    RETRY = "retry", "Retry"


class MessageState(models.TextChoices):
    SUBMISSION = "submission", "Submission"  # some recipients await the categorizer
    CATEGORIZING = "categorizing", "Categorizing"  # claimed by a categorizer
    QUEUED = "queued", "Queued"  # categorized; some recipients not final
    DONE = "done", "Done"  # every recipient final


class MessageSource(models.TextChoices):
    SMTP = "smtp", "SMTP"
    PICKUP = "pickup", "Pickup"
    REPLAY = "replay", "Replay"
    DSN = "dsn", "DSN"


class RecipientState(models.TextChoices):
    SUBMITTED = "submitted", "Submitted"  # waiting for the categorizer
    QUEUED = "queued", "Queued"  # in a delivery queue, not yet tried
    DEFERRED = "deferred", "Deferred"  # tried, temporary failure, waiting to retry
    ACTIVE = "active", "Active"  # claimed by a delivery (lease_until)
    DELIVERED = "delivered", "Delivered"
    FAILED = "failed", "Failed"
    EXPIRED = "expired", "Expired"


FINAL_RECIPIENT_STATES = (
    RecipientState.DELIVERED,
    RecipientState.FAILED,
    RecipientState.EXPIRED,
)
WAITING_RECIPIENT_STATES = (RecipientState.QUEUED, RecipientState.DEFERRED)


class AttemptPhase(models.TextChoices):
    ROUTE = "route", "Routing"
    CONNECT = "connect", "Connect"
    GREETING = "greeting", "Greeting"
    EHLO = "ehlo", "EHLO"
    STARTTLS = "starttls", "STARTTLS"
    MAIL = "mail", "MAIL FROM"
    RCPT = "rcpt", "RCPT TO"
    DATA = "data", "DATA"
    SESSION = "session", "Session"  # lost connection, timeout mid-session


class AttemptOutcome(models.TextChoices):
    DELIVERED = "delivered", "Delivered"
    DEFERRED = "deferred", "Deferred"
    FAILED = "failed", "Failed"


class EventLevel(models.TextChoices):
    INFO = "info", "Information"
    WARNING = "warning", "Warning"
    ERROR = "error", "Error"
