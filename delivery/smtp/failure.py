"""How a session fails, and a connection-level failure at one target, as a round's
batch remembers it.

``SessionFailed`` is what a session that cannot go on raises (no reply, a
timeout, a protocol error, a 421), ``ClaimLost`` what a round that lost its
recipients raises before a final dot (``delivery.smtp.connection``).

``TargetFailure`` is what a target that could not be used leaves the round
(``delivery.smtp.client``): the phase, reply and Exim error name of the
failure, and the session's TLS (and AUTH) as far as it got. The batch turns
it into the target's retry data (``types.HostFailure``), into the results of
the message it stopped and of those that found no target left, and into the
link's error text (``describe``).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from delivery.smtp import outcome
from delivery.smtp.outcome import Security
from delivery.smtp.types import Peer


class ClaimLost(Exception):
    """The round lost its recipients in the middle of a transaction: the
    connection is dropped without the final dot and nothing is recorded."""


class SessionFailed(Exception):
    """The session cannot go on: no reply (lost, timeout, protocol error) or a 421."""

    def __init__(
        self,
        phase: str,
        code: int | None,
        text: str,
        note: str = "",
        error: str = "",
        enhanced: str = "",
        in_reply_to: str = "",
    ) -> None:
        super().__init__(text)
        self.in_reply_to = in_reply_to
        self.phase = phase
        self.code = code
        self.text = text
        # Exim error name when no reply came: "timeout" or "lost_connection";
        # "" for a protocol error (Exim names none; only "*" rules match it)
        self.error = error
        # Added for the message in progress only, not for those never sent.
        self.note = note
        # Enhanced code overriding the one classify() picks ("" = keep it).
        self.enhanced = enhanced

    @property
    def protocol(self) -> bool:
        """The peer broke the protocol (a reply too long or malformed)."""
        return self.enhanced == outcome.PROTOCOL_ERROR_ENHANCED


@dataclass(slots=True)
class TargetFailure:
    """A connection-level failure at one target, remembered for deferrals."""

    phase: str
    code: int | None
    text: str
    target: Peer
    error: str = ""  # Exim error name (see delivery.smtp.types.HostFailure)
    enhanced: str = ""  # overrides the classified enhanced code when set
    in_reply_to: str = ""  # the command answered, when the phase does not say (AUTH)
    tls_policy: str = ""
    # the failed session's TLS (and AUTH) as far as it got, for the attempts
    security: Security | None = None

    @classmethod
    def of(
        cls, exc: SessionFailed, target: Peer, tls_policy: str, security: Security
    ) -> TargetFailure:
        return cls(
            exc.phase,
            exc.code,
            exc.text,
            target,
            exc.error,
            exc.enhanced,
            exc.in_reply_to,
            tls_policy,
            replace(security),
        )

    def describe(self) -> str:
        t = self.target
        where = f"{t.host}[{t.ip}]:{t.port}" if t.ip and t.ip != t.host else f"{t.host}:{t.port}"
        if self.code is None:
            return f"{where}: {self.text}"
        command = self.in_reply_to or _IN_REPLY_TO.get(self.phase, self.phase)
        return f"{where} said: {self.code} {self.text} (in reply to {command})"


_IN_REPLY_TO = {
    outcome.GREETING: "the greeting",
    outcome.EHLO: "EHLO",
    outcome.STARTTLS: "STARTTLS",
    outcome.MAIL: "MAIL FROM",
    outcome.RCPT: "RCPT TO",
    outcome.DATA: "DATA",
    outcome.SESSION: "RSET",
}


@dataclass(frozen=True)
class NoPeer:
    """The target of a failure when there was no target at all."""

    host: str = ""
    ip: str = ""
    port: int = 0
