"""The inbound SMTP protocol: one ``InboundSMTP`` per client connection.

It speaks the protocol (HELO/EHLO, MAIL, RCPT, DATA, the junk-command
budget, the DATA deadline; AUTH is ``auth.AuthCommand``, one of its bases)
and reaches aiosmtpd's private members only through
``aiosmtpd_adapter.AiosmtpdSession``. What it decides comes from
``policy`` (paths, parameters, relay) and from the server it belongs to
(``SessionHost``: connection counting, back pressure, the database threads);
what happens to a message once its data is in is the handler's
(``server.RelayHandler``). It reads no settings: only its frozen
``InboundConfig``.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections import defaultdict
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Protocol

from aiosmtpd.smtp import SMTP, Envelope, syntax

from delivery.smtpd import policy
from delivery.smtpd.aiosmtpd_adapter import AiosmtpdSession
from delivery.smtpd.auth import AUTH_MECHANISMS, AuthCommand
from delivery.smtpd.authlimit import AuthLimiter
from delivery.smtpd.config import SMTP_LISTENER, SUBMISSION, SUBMISSIONS, InboundConfig
from queues.accept import IncomingRecipient
from queues.services import accounts

if TYPE_CHECKING:
    from delivery.backpressure.monitor import Monitor

log = logging.getLogger(__name__)

COMMAND_LINE_LIMIT = 512  # RFC 5321 4.5.3.1.4
# MAIL/RCPT lines grow with their parameters: ORCPT alone may be 500 characters
# (RFC 3461 4.2), ENVID 100; aiosmtpd's line reader caps every line at 1001.
PARAMETER_LINE_LIMIT = 1000


class SessionHost(Protocol):
    """What a session needs of the server that accepted it (``server.InboundServer``)."""

    config: InboundConfig
    loop: asyncio.AbstractEventLoop | None
    monitor: Monitor | None
    auth_limiter: AuthLimiter

    @property
    def stopping(self) -> bool: ...

    def admit(self, session: InboundSMTP) -> str | None: ...

    def session_ended(self, session: InboundSMTP) -> None: ...

    async def in_database(self, function: Callable[..., object], *args, **kwargs) -> object: ...


class RelayEnvelope(Envelope):
    """aiosmtpd's envelope, plus the parsed parameters and our recipient rows."""

    def __init__(self) -> None:
        super().__init__()
        self.started = False  # MAIL accepted (mail_from is "" for the null sender)
        self.params = policy.MailParams()
        self.recipients: list[IncomingRecipient] = []


def append_unstuffed(body: bytearray, chunk: bytes, tail: bytes) -> None:
    """Append ``chunk`` to ``body`` without SMTP dot-stuffing (RFC 5321 4.5.2).

    ``tail`` is the last two bytes received before ``chunk``: a line that
    starts in this chunk lost its leading dot even if its CRLF came earlier.
    """
    if chunk[:1] == b"." and tail.endswith(b"\r\n"):
        chunk = chunk[1:]
    elif chunk[:2] == b"\n." and tail.endswith(b"\r"):
        chunk = b"\n" + chunk[2:]
    body += chunk.replace(b"\r\n.", b"\r\n")


class DataDeadline:
    """Postfix's DATA deadline (smtpd_min_data_rate with smtpd_per_request_deadline).

    It starts at the idle timeout; each read of N bytes moves it N/rate
    seconds later, never further than the idle timeout from now. So a client
    slower than ``rate`` bytes per second runs out of time, however often it
    sends a byte. A rate of 0 leaves only the idle timeout.
    """

    def __init__(self, now: float, timeout: float, rate: int) -> None:
        self.timeout = timeout
        self.rate = rate
        self.at = now + timeout
        self.credited = 0  # bytes already counted

    def received(self, total: int, now: float) -> None:
        """``total`` bytes have arrived since DATA; credit the new ones."""
        count, self.credited = total - self.credited, max(total, self.credited)
        if count <= 0:
            return
        if self.rate <= 0:
            self.at = now + self.timeout
        else:
            self.at = min(self.at + count / self.rate, now + self.timeout)


def command_argument(keyword: str, arg: str) -> str | None:
    """What follows ``keyword`` ("FROM:", "TO:") in a MAIL/RCPT argument, or None.

    As aiosmtpd's own (private) helper does: the keyword case-insensitively,
    the rest stripped.
    """
    if arg[: len(keyword)].upper() == keyword:
        return arg[len(keyword) :].strip()
    return None


def protocol_keyword(*, extended: bool, tls: bool, utf8: bool, auth: bool = False) -> str:
    """The Received "with" keyword (RFC 3848: ESMTPS, ESMTPA, ESMTPSA; RFC 6531 3.7.3)."""
    if not extended:
        return "SMTP"
    return ("UTF8SMTP" if utf8 else "ESMTP") + ("S" if tls else "") + ("A" if auth else "")


def junk_command(
    method: Callable[[InboundSMTP, str | None], Awaitable[None]],
) -> Callable[[InboundSMTP, str | None], Awaitable[None]]:
    """Count a command that does not advance a transaction (smtpd_junk_command_limit)."""

    @functools.wraps(method)  # keeps aiosmtpd's @syntax attributes (HELP text)
    async def counted(self: InboundSMTP, arg: str | None) -> None:
        if self.count_junk():
            return
        await method(self, arg)

    return counted


class InboundSMTP(AuthCommand, AiosmtpdSession):
    """One client connection (aiosmtpd's private members only through AiosmtpdSession)."""

    # aiosmtpd sizes its stream reader with this. Commands are still held to
    # command_size_limits; message data is read in large blocks (smtp_DATA),
    # so let the reader buffer up to 64 KiB before it pauses the socket.
    line_length_limit = 65536

    def __init__(self, server: SessionHost, handler: object, kind: str = SMTP_LISTENER) -> None:
        config = server.config
        # STARTTLS with the certificate as it is now (a renewal counts from the next
        # connection); an implicit-TLS connection is encrypted already: no STARTTLS.
        starttls = config.tls.current() if config.tls and kind != SUBMISSIONS else None
        super().__init__(
            handler,
            data_size_limit=config.max_message_size or None,
            enable_SMTPUTF8=True,
            decode_data=False,
            hostname=config.hostname,
            ident="ESMTP mailrelay",
            tls_context=starttls,
            timeout=config.timeout,
            loop=server.loop,
        )
        self.server = server
        self.config = config
        # aiosmtpd keeps these limits in a class-level dict that every EHLO
        # grows; keep our own, fixed, per connection.
        self.command_size_limits = defaultdict(
            lambda: COMMAND_LINE_LIMIT, {"MAIL": PARAMETER_LINE_LIMIT, "RCPT": PARAMETER_LINE_LIMIT}
        )
        self.client_ip: policy.IPAddress | None = None
        self.trusted = False
        self.kind = kind
        self.implicit_tls = False  # a submissions (465) connection: TLS from the start
        self.grant: accounts.Grant | None = None  # the account after a successful AUTH
        self._greeted = False
        self.storing = False  # a message is being committed; its reply is not sent yet
        self._close_after_reply: str | None = None  # the 421 to send once that reply is out
        self.junk_commands = 0
        self.refused = False  # over a connection limit: 421 instead of the greeting
        self.counted_as: str | None = None  # the per-client key, when counted
        self._session_timer: asyncio.TimerHandle | None = None
        self._data_deadline = DataDeadline(0.0, config.timeout, config.min_data_rate)
        self._data_read = 0  # bytes of the current DATA taken from the reader

    envelope_class = RelayEnvelope

    # --- connection life cycle

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        starttls = self.starttls_begun  # the TLS layer's connection_made: same client
        super().connection_made(transport)
        self.grant = None  # RFC 3207 4.2: STARTTLS forgets what came before
        if not starttls:
            assert self.session is not None
            self.implicit_tls = transport.get_extra_info("ssl_object") is not None
            peer = self.session.peer
            self.client_ip = policy.client_ip(peer[0] if isinstance(peer, tuple) else None)
            self.trusted = policy.is_trusted(self.client_ip, self.config.relay_networks)
            refusal = self.server.admit(self)
            if refusal is not None:
                self.refused = True
                self._goodbye(refusal)
                return
            if self.server.stopping:  # accepted just as the listeners closed
                self._goodbye()
            elif self.config.max_session_time > 0:
                self._session_timer = self.loop.call_later(
                    self.config.max_session_time, self._session_expired
                )

    def serves_client(self) -> bool:
        # Over a limit, the 421 is sent and the connection closing: no greeting.
        return not self.refused

    @property
    def tls_active(self) -> bool:
        """Is the session encrypted (after STARTTLS, or on an implicit-TLS listener)?"""
        return self.implicit_tls or (self.session is not None and self.session.ssl is not None)

    @property
    def may_relay(self) -> bool:
        """Relay to any domain: a relay network, or an authenticated account."""
        return self.trusted or self.grant is not None

    def connection_lost(self, error: Exception | None) -> None:
        if self._session_timer is not None:
            self._session_timer.cancel()
        try:
            super().connection_lost(error)
        finally:
            self.server.session_ended(self)

    def before_idle_close(self) -> None:
        # RFC 5321 4.5.3.2: say why before closing an idle session (aiosmtpd just closes).
        transport = self.transport
        if transport is not None and not transport.is_closing():
            self.write_raw(policy.TIMEOUT.encode() + b"\r\n")

    def shutdown(self, reply: str = policy.SHUTTING_DOWN) -> None:
        """Say 421 and close, but only after the reply to a message being committed."""
        if self.storing:
            self._close_after_reply = reply
        else:
            self._goodbye(reply)

    def _session_expired(self) -> None:
        log.info("%s: session time limit reached", self.client_ip)
        self.shutdown(policy.SESSION_TOO_LONG)

    def count_junk(self) -> bool:
        """One more command that moves no message; True (and 421, closed) past the limit."""
        self.junk_commands += 1
        limit = self.config.junk_command_limit
        if limit and self.junk_commands > limit:
            log.info("%s: more than %d junk commands; closing", self.client_ip, limit)
            self._goodbye(policy.TOO_MANY_JUNK_COMMANDS)
            return True
        return False

    async def bad_command(self, reply: str) -> None:
        """A malformed MAIL or RCPT: its error reply, but it counts toward the junk
        command limit like a command that moves no message (421 and closed past it)."""
        if not self.count_junk():
            await self.push(reply)

    def _goodbye(self, reply: str = policy.SHUTTING_DOWN) -> None:
        transport = self.transport
        if transport is None or transport.is_closing():
            return
        self.write_raw(reply.encode() + b"\r\n")
        transport.close()

    # Commands that do not advance a transaction (Postfix counts the same ones).
    smtp_NOOP = junk_command(SMTP.smtp_NOOP)
    smtp_RSET = junk_command(SMTP.smtp_RSET)
    smtp_HELP = junk_command(SMTP.smtp_HELP)
    smtp_EXPN = junk_command(SMTP.smtp_EXPN)

    # --- replies

    async def push(self, status: str | bytes) -> None:
        if isinstance(status, bytes):
            status = status.decode("utf-8", "replace")
        if self._greeted:
            status = policy.enhance(status)
        else:
            self._greeted = True  # the greeting carries no enhanced code
        # Replies may echo client text; never fail on undecodable bytes.
        self.write_raw(status.encode("utf-8", "replace") + b"\r\n")
        await self.drain_writes()

    async def _push_lines(self, lines: Sequence[str]) -> None:
        """A reply written as given (HELO/EHLO replies carry no enhanced codes)."""
        self.write_raw("".join(line + "\r\n" for line in lines).encode("utf-8", "replace"))
        await self.drain_writes()

    # --- commands

    @junk_command
    @syntax("HELO hostname")
    async def smtp_HELO(self, hostname: str | None) -> None:
        if not hostname:
            await self._push_lines([policy.HELO_SYNTAX])
            return
        self.reset_transaction()
        assert self.session is not None
        self.session.extended_smtp = False
        self.session.host_name = hostname
        await self._push_lines([f"250 {self.hostname}"])

    @junk_command
    @syntax("EHLO hostname")
    async def smtp_EHLO(self, hostname: str | None) -> None:
        if not hostname:
            await self._push_lines([policy.EHLO_SYNTAX])
            return
        self.reset_transaction()
        assert self.session is not None
        self.session.extended_smtp = True
        self.session.host_name = hostname
        size = self.config.max_message_size
        lines = [
            self.hostname,
            "PIPELINING",
            f"SIZE {size}" if size else "SIZE",
            "8BITMIME",
            "SMTPUTF8",
            "ENHANCEDSTATUSCODES",
            "DSN",
        ]
        if self.tls_context and not self.tls_active:  # not offered again inside TLS
            lines.append("STARTTLS")
        if self.tls_active:  # never advertised in cleartext (RFC 4954 4; RFC 8314)
            lines.append("AUTH " + " ".join(AUTH_MECHANISMS))
        await self._push_lines([f"250-{line}" for line in lines[:-1]] + [f"250 {lines[-1]}"])

    @syntax("MAIL FROM: <address>", extended=" [SP <mail-parameters>]")
    async def smtp_MAIL(self, arg: str | None) -> None:
        if await self.check_helo_needed():
            return
        assert self.session is not None
        envelope = self.envelope
        assert isinstance(envelope, RelayEnvelope)
        if envelope.started:
            await self.push(policy.NESTED_MAIL)
            return
        if self.kind == SUBMISSION and not self.tls_active:
            await self.push(policy.STARTTLS_FIRST)
            return
        if self.kind != SMTP_LISTENER and self.grant is None:
            await self.push(policy.AUTH_REQUIRED)  # RFC 6409 4.1: submission needs AUTH
            return
        rest = command_argument("FROM:", arg or "")
        if rest is None:
            await self.bad_command(policy.MAIL_SYNTAX)
            return
        try:
            sender, params = policy.parse_mail(
                rest, extended=self.session.extended_smtp, max_size=self.config.max_message_size
            )
        except policy.Refused as refused:
            await self.bad_command(refused.reply)
            return
        if self.grant is not None:
            refusal = await self._account_refusal(self.grant, sender.address if sender else "")
            if refusal is not None:
                await self.push(refusal)
                return
        monitor = self.server.monitor
        if monitor is not None:
            decision = monitor.mail_from_decision(self.may_relay)
            if decision.refuse_reply is not None:
                log.debug("back pressure: refused MAIL FROM of %s", self.client_ip)
                await self.push(decision.refuse_reply)
                return
            if decision.delay_seconds > 0:
                # Tarpit: only this session waits; aiosmtpd cancels the sleep
                # if the client goes away, and stop() says 421 meanwhile.
                await asyncio.sleep(decision.delay_seconds)
                self.restart_idle_timer()
        envelope.started = True
        envelope.mail_from = sender.address if sender else ""
        envelope.params = params
        envelope.smtp_utf8 = params.smtputf8
        await self.push(policy.SENDER_OK)

    @syntax("RCPT TO: <address>", extended=" [SP <mail-parameters>]")
    async def smtp_RCPT(self, arg: str | None) -> None:
        if await self.check_helo_needed():
            return
        assert self.session is not None
        envelope = self.envelope
        assert isinstance(envelope, RelayEnvelope)
        if not envelope.started:
            await self.push(policy.NEED_MAIL)
            return
        rest = command_argument("TO:", arg or "")
        if rest is None:
            await self.bad_command(policy.RCPT_SYNTAX)
            return
        try:
            recipient, params = policy.parse_rcpt(
                rest, extended=self.session.extended_smtp, utf8=envelope.params.smtputf8
            )
        except policy.Refused as refused:
            await self.bad_command(refused.reply)
            return
        refusal = policy.recipient_refusal(
            recipient, trusted=self.may_relay, accepted_domains=self.config.accepted_domains
        )
        if refusal is not None:
            log.info("refused <%s> from %s: %s", recipient.address, self.client_ip, refusal)
            await self.push(refusal)
            return
        if len(envelope.recipients) >= self.config.max_recipients:
            await self.push(policy.TOO_MANY_RECIPIENTS)
            return
        envelope.recipients.append(
            IncomingRecipient(recipient.address, orcpt=params.orcpt, notify=params.notify)
        )
        envelope.rcpt_tos.append(recipient.address)
        await self.push(policy.RECIPIENT_OK)

    @syntax("DATA")
    async def smtp_DATA(self, arg: str | None) -> None:
        if await self.check_helo_needed():
            return
        envelope = self.envelope
        assert isinstance(envelope, RelayEnvelope)
        if not envelope.started:
            await self.push(policy.NEED_MAIL)
            return
        if not envelope.recipients:
            await self.push(policy.NO_VALID_RECIPIENTS)
            return
        if arg:
            await self.push(policy.DATA_SYNTAX)
            return
        await self.push(policy.START_DATA)
        data = await self._read_data()
        if data is None:
            self.end_transaction()
            await self.push(policy.MESSAGE_TOO_BIG)
            return
        envelope.original_content = envelope.content = data
        del data  # the envelope holds the only reference: reset after DATA frees it
        self.storing = True
        try:
            status = await self.run_data_hook()
            self.end_transaction()
            if status.startswith("250"):
                self.junk_commands = 0  # a message accepted: the budget starts again
            await self.push(status)
        finally:
            self.storing = False
        if self._close_after_reply is not None:
            self._goodbye(self._close_after_reply)

    async def _read_data(self) -> bytearray | None:
        """Read message data up to CRLF.CRLF and undo dot-stuffing; None if too big.

        Reads in blocks ending at ".\r\n" instead of line by line: per-line
        reads cost more CPU than the rest of the session. Only CRLF.CRLF ends
        the data (a bare LF or CR next to the dot does not: SMTP smuggling);
        stray CR/LF are left in for RelayHandler to refuse. Lines may be longer
        than RFC 5321's 1000 octets (as Postfix and Exchange accept them); only
        the size limit applies.

        The message is held once: each block is unstuffed and appended to one
        bytearray (no list of blocks joined and then replaced: that was three
        copies). The DATA phase has a deadline (``DataDeadline``): a client
        slower than MAILRELAY_SMTP_MIN_DATA_RATE is cut off.
        """
        reader = self.reader
        limit = self.data_size_limit
        body: bytearray | None = bytearray()
        size = 0  # bytes on the wire (stuffed): what the size limit counts
        tail = b"\r\n"  # the CRLF that ended the DATA command starts the first line
        self._data_deadline = DataDeadline(
            self.loop.time(), self.config.timeout, self.config.min_data_rate
        )
        self._data_read = 0
        self._arm_data_timer()
        while True:
            try:
                chunk = await reader.readuntil(b".\r\n")
                maybe_end = True
            except asyncio.LimitOverrunError as exc:
                # no ".\r\n" in the reader's buffer: take what cannot be part of one
                chunk = await reader.read(exc.consumed)
                maybe_end = False
            except asyncio.IncompleteReadError:
                # The client went away mid-message: end the session as aiosmtpd
                # does for a lost connection (its loop treats this as a close).
                if self.transport is not None:
                    self.transport.close()
                raise asyncio.CancelledError() from None
            self._data_read += len(chunk)
            self._data_deadline.received(self._data_read, self.loop.time())
            self._arm_data_timer()
            end = maybe_end and (tail + chunk[:-3])[-2:] == b"\r\n"
            if end:
                chunk = chunk[:-3]
            size += len(chunk)
            if body is not None and limit and size > limit:
                body = None  # too big: keep reading to the end, but keep nothing
            if body is not None:
                append_unstuffed(body, chunk, tail)
            if end:
                self.restart_idle_timer()
                return body
            tail = (tail + chunk[-2:])[-2:]

    def _arm_data_timer(self) -> None:
        """aiosmtpd's idle timer, moved to the DATA deadline (which includes the idle timeout)."""
        self.move_idle_timer(self._data_deadline.at, self._data_timeout_cb)

    def _data_timeout_cb(self) -> None:
        # readuntil() returns only at a ".\r\n" or a full buffer: bytes that
        # arrived meanwhile wait in the reader's buffer. Credit them now.
        buffered = self.buffered_bytes()
        now = self.loop.time()
        self._data_deadline.received(self._data_read + buffered, now)
        if self._data_deadline.at > now:
            self._arm_data_timer()
            return
        log.info("%s: DATA too slow or idle; closing", self.client_ip)
        self._goodbye(policy.DATA_TOO_SLOW)

    async def _account_refusal(self, grant: accounts.Grant, address: str) -> str | None:
        """The reply refusing an authenticated MAIL FROM, or None: its sender, its rate."""
        if not grant.may_send_as(address):
            log.info("%s: account %s may not send as <%s>", self.client_ip, grant.username, address)
            return policy.SENDER_NOT_ALLOWED.format(address=address, username=grant.username)
        if grant.max_messages_per_hour:
            try:
                limited = await self.server.in_database(accounts.rate_limited, grant)
            except Exception:
                log.exception("could not check the rate of account %s", grant.username)
                return policy.INTERNAL_ERROR
            if limited:
                log.info("%s: account %s over its rate", self.client_ip, grant.username)
                return policy.ACCOUNT_RATE_LIMITED.format(
                    username=grant.username, limit=grant.max_messages_per_hour
                )
        return None

    @junk_command
    @syntax("VRFY <address>")
    async def smtp_VRFY(self, arg: str | None) -> None:
        # Answer without looking anything up: a relay has no mailboxes to verify.
        await self.push(policy.CANNOT_VRFY if arg else policy.VRFY_SYNTAX)
