"""What the parts of an inbound session share, declared once (as Postfix's
``smtpd.h`` declares the ``SMTPD_STATE`` that smtpd.c, smtpd_check.c and
smtpd_sasl_proto.c work on).

``session.InboundSMTP`` is one class made of parts in their own modules: the
commands before DATA (``commands.Commands``) and AUTH (``auth.AuthCommand``)
are bases of it, beside the DATA phase and the aiosmtpd adapter in
``session``. A part cannot import the session (it is one of its bases), so
what it uses of the whole — the session's state, its replies, its reader and
its server — is declared here: ``SessionState`` for type checkers (a part
names it as its base only under ``TYPE_CHECKING``; at run time the methods are
the session's own), and ``SessionHost``, what a session needs of the server
that accepted it (``server.InboundServer``).

Declarations only: nothing here runs for a message.
"""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

from aiosmtpd.smtp import Envelope, Session

from delivery.smtpd.authlimit import AuthLimiter
from delivery.smtpd.config import InboundConfig
from delivery.smtpd.policy import IPAddress
from queues.services.accounts import Grant

if TYPE_CHECKING:
    from delivery.backpressure.monitor import Monitor


class SessionHost(Protocol):
    """What a session needs of the server that accepted it (``server.InboundServer``)."""

    config: InboundConfig
    loop: asyncio.AbstractEventLoop | None
    monitor: Monitor | None
    auth_limiter: AuthLimiter

    @property
    def stopping(self) -> bool: ...

    def admit(self, session: SessionState) -> str | None: ...

    def session_ended(self, session: SessionState) -> None: ...

    async def in_database(self, function: Callable[..., object], *args, **kwargs) -> object: ...


class SessionState(Protocol):
    """What ``commands.Commands`` and ``auth.AuthCommand`` use of the session
    they are parts of (``session.InboundSMTP``, its adapter
    ``session.AiosmtpdSession`` and aiosmtpd's ``SMTP``)."""

    # the connection and its state
    server: SessionHost
    config: InboundConfig
    kind: str  # the listener: smtp, submission or submissions
    session: Session | None  # aiosmtpd's: the client's greeting, its TLS
    envelope: Envelope  # a session.RelayEnvelope
    hostname: str
    tls_context: ssl.SSLContext | None  # STARTTLS, when offered
    client_ip: IPAddress | None
    grant: Grant | None  # the account after a successful AUTH
    junk_commands: int

    @property
    def tls_active(self) -> bool: ...

    @property
    def may_relay(self) -> bool: ...

    @property
    def reader(self) -> asyncio.StreamReader: ...

    # the replies
    async def push(self, status: str | bytes) -> None: ...

    def write_raw(self, data: bytes) -> None: ...

    async def drain_writes(self) -> None: ...

    def _goodbye(self, reply: str = ...) -> None: ...

    # the transaction and the idle timer
    def reset_transaction(self) -> None: ...

    def restart_idle_timer(self) -> None: ...

    async def check_helo_needed(self, helo: str = "HELO") -> bool: ...

    # the junk budget (``commands.Commands``), which AUTH's refusals count against
    def count_junk(self) -> bool: ...
