"""Plain data of a delivery round: its messages and recipients, what each got,
the peer it reached. A route's data (``NextHop``, ``Route``, ``RouteError``)
is routing's (``delivery.route.routing``)."""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from datetime import datetime
from typing import Protocol


@dataclass
class OutboundRecipient:
    id: int
    address: str
    orcpt: str = ""
    notify: str = ""


@dataclass
class OutboundMessage:
    id: int
    mail_from: str
    # The stored bytes, or None when the client should read them just in time
    # through ``deliver(load_body=...)`` (so a round holds one body per connection).
    data: bytes | None
    recipients: list[OutboundRecipient]
    body_type: str = ""
    smtputf8: bool = False
    ret: str = ""
    envid: str = ""
    # What the round's records say of it besides (tracking rows): its queue id
    # and its Message-ID header field.
    qid: str = ""
    header_id: str = ""


@dataclass
class RecipientResult:
    """The outcome of one try for one recipient."""

    recipient_id: int
    message_id: int
    outcome: str  # queues.models.AttemptOutcome value
    phase: str  # queues.models.AttemptPhase value
    code: int | None
    enhanced: str
    text: str
    host: str = ""
    ip: str = ""
    port: int | None = None
    started_at: datetime | None = None
    duration_ms: int = 0
    # "recipient", "message" or "connection": which kind of failure this was
    scope: str = "recipient"
    # the peer advertised DSN (it takes over NOTIFY=SUCCESS, RFC 3461 "relayed")
    peer_dsn: bool = False
    # The session's transport security (queues.models.Attempt fields): TLS
    # version and cipher ("" in cleartext), how the peer was verified
    # (none/ca/dane/mta-sts), the TLS policy level applied, AUTH mechanism used.
    tls_version: str = ""
    tls_cipher: str = ""
    tls_verified: str = ""
    tls_policy: str = ""
    auth_used: str = ""
    # What an MTA-STS "testing" policy would have refused (reported as an Event).
    tls_report: str = ""
    # A delivery's tracking event id (Attempt.event_id): the same in its
    # attempt row, its webhook and its event-log line, however often recorded.
    event_id: uuid.UUID = field(default_factory=uuid.uuid4)


@dataclass(frozen=True)
class HostFailure:
    """One target that could not be used, for per-host retry data."""

    host: str
    ip: str
    port: int
    phase: str
    code: int | None
    text: str
    # Exim error name without the _MX/_A suffix: refused, timeout_connect,
    # timeout, lost_connection, tls_required, auth_failed, or "" when only "*"
    # describes it
    error: str = ""
    tls_policy: str = ""  # the TLS policy level applied to this host


@dataclass
class BatchResult:
    results: list[RecipientResult] = field(default_factory=list)
    # True when at least one connection reached the peer's greeting
    connected: bool = False
    # the last per-connection error when every host failed (for the link)
    connection_error: str = ""
    host_failures: list[HostFailure] = field(default_factory=list)
    # True when ``still_owner()`` said the round lost its recipients: the
    # messages not started then have no result at all (another owner has them).
    abandoned: bool = False


class Peer(Protocol):
    """Where to connect: one SMTP server's name, address and port.

    ``delivery.route.routing.Target`` provides it (and tests' own small classes).
    """

    @property
    def host(self) -> str: ...
    @property
    def ip(self) -> str: ...
    @property
    def port(self) -> int: ...
