"""The results of one message on one target: one ``RecipientResult`` per recipient.

``Recorder`` turns each reply (or the failure that ended the session) into
a classified result (``delivery.smtp.classify``), stamped with the target
and the session's transport security (``Security``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from datetime import datetime

from delivery.smtp import classify as c
from delivery.smtp.envelope import (
    Refusal,
)
from delivery.smtp.types import (
    OutboundMessage,
    OutboundRecipient,
    Peer,
    RecipientResult,
)

log = logging.getLogger(__name__)


@dataclass(slots=True)
class Security:
    """The transport security of one session (Attempt.tls_* and auth_used)."""

    policy: str = ""
    version: str = ""
    cipher: str = ""
    verified: str = ""
    auth: str = ""
    report: str = ""  # an MTA-STS "testing" failure, for an Event


class Recorder:
    """The results of one message on one target, one per recipient."""

    __slots__ = ("msg", "target", "started", "t0", "decided", "peer_dsn", "security")

    def __init__(
        self,
        msg: OutboundMessage,
        target: Peer,
        started: datetime,
        t0: float,
        peer_dsn: bool = False,
        security: Security | None = None,
    ):
        self.peer_dsn = peer_dsn
        self.security = security or Security()
        self.msg = msg
        self.target = target
        self.started = started
        self.t0 = t0
        self.decided: dict[int, RecipientResult] = {}

    def set(
        self,
        rcpt: OutboundRecipient,
        phase: str,
        code: int | None,
        text: str,
        cls: c.Classification | None = None,
    ) -> None:
        if cls is None:
            cls = c.classify(phase, code, text)
        t = self.target
        sec = self.security
        self.decided[rcpt.id] = RecipientResult(
            recipient_id=rcpt.id,
            message_id=self.msg.id,
            outcome=cls.outcome,
            phase=phase,
            code=code,
            enhanced=cls.enhanced,
            text=c.strip_enhanced(text),
            host=t.host,
            ip=t.ip,
            port=t.port or None,
            started_at=self.started,
            duration_ms=int((time.monotonic() - self.t0) * 1000),
            scope=cls.scope,
            peer_dsn=self.peer_dsn,
            tls_version=sec.version,
            tls_cipher=sec.cipher,
            tls_verified=sec.verified,
            tls_policy=sec.policy,
            auth_used=sec.auth,
            tls_report=sec.report,
        )

    def set_many(
        self,
        rcpts: Sequence[OutboundRecipient],
        phase: str,
        code: int | None,
        text: str,
        cls: c.Classification | None = None,
    ) -> None:
        if cls is None:
            cls = c.classify(phase, code, text)
        for rcpt in rcpts:
            self.set(rcpt, phase, code, text, cls)

    def fill(self, phase: str, code: int | None, text: str, enhanced: str = "") -> None:
        """Give every recipient without a result this one (``enhanced``
        overrides the classified enhanced status code when given)."""
        cls = c.classify(phase, code, text)
        if enhanced:
            cls = replace(cls, enhanced=enhanced)
        self.set_many(
            [r for r in self.msg.recipients if r.id not in self.decided], phase, code, text, cls
        )

    def refuse(self, rcpts: Sequence[OutboundRecipient], refusal: Refusal) -> None:
        """Give ``rcpts`` a result decided without asking the peer."""
        if rcpts:
            self.set_many(rcpts, refusal.phase, None, refusal.text, refusal.classification())

    def results(self) -> list[RecipientResult]:
        return [self.decided[r.id] for r in self.msg.recipients if r.id in self.decided]
