"""The inbound SMTP protocol: one ``InboundSMTP`` per client connection.

It speaks the protocol: the connection's life cycle, the replies, and DATA
with its deadline, here; the commands before DATA (HELO/EHLO, MAIL, RCPT,
the junk-command budget) are ``commands.Commands`` and AUTH is
``auth.AuthCommand``, two of its bases. It reaches aiosmtpd's private
members only through the aiosmtpd adapter, ``AiosmtpdSession`` (below: a
class wall; ``aiosmtpd_members`` lists the private members it relies on,
checked against the installed aiosmtpd). What it decides comes from
``policy`` (paths, parameters, relay; every reply named) and from the server
it belongs to (``state.SessionHost``: connection counting, back pressure, the
database threads; ``state.SessionState`` declares what the bases use of the
session); what happens to a message once its data is in is the
handler's (``server.RelayHandler``), with the checks of the data here. It
reads no settings: only its frozen ``InboundConfig``.

In the order of the file: the adapter (with aiosmtpd's command loop, lean:
``AiosmtpdSession._command_loop``); the envelope and the DATA reader's
helpers (dot-unstuffing, the deadline); the checks of the message data; the
enhanced status codes of the replies; the Received header's "with" keyword
(``protocol_keyword``); ``InboundSMTP``.
"""

from __future__ import annotations

import asyncio
import logging
import re
import socket
import ssl
from collections import defaultdict
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from aiosmtpd import _get_or_new_eventloop
from aiosmtpd.smtp import (
    BOGUS_LIMIT,
    DATA_SIZE_DEFAULT,
    MISSING,
    SMTP,
    Envelope,
    _AuthMechAttr,
    login_always_fail,
    sanitized_log,
    syntax,
)
from aiosmtpd.smtp import __ident__ as _AIOSMTPD_IDENT
from aiosmtpd.smtp import log as _aiosmtpd_log

from delivery.smtpd import aiosmtpd_members, command_errors, policy
from delivery.smtpd.auth import AuthCommand
from delivery.smtpd.commands import Commands
from delivery.smtpd.config import SMTP_LISTENER, SUBMISSIONS
from delivery.smtpd.state import SessionHost
from queues.accept import IncomingRecipient
from queues.lib import header_end, header_shape_refusal
from queues.services import accounts

log = logging.getLogger(__name__)

COMMAND_LINE_LIMIT = 512  # RFC 5321 4.5.3.1.4
# MAIL/RCPT lines grow with their parameters: ORCPT alone may be 500 characters
# (RFC 3461 4.2), ENVID 100; aiosmtpd's line reader caps every line at 1001.
PARAMETER_LINE_LIMIT = 1000


# --- the aiosmtpd adapter: the one place that touches aiosmtpd's private members


# The options ``AiosmtpdSession.__init__`` sets up itself; any other option
# (AUTH callbacks, call limits, PROXY protocol) goes through aiosmtpd's own __init__.
FAST_INIT_OPTIONS = frozenset(
    {
        "data_size_limit",
        "enable_SMTPUTF8",
        "decode_data",
        "hostname",
        "ident",
        "tls_context",
        "timeout",
        "loop",
    }
)


class _BoundOnUse(Mapping[str, Any]):
    """``{"MAIL": session.smtp_MAIL, …}`` (or ``{"DATA": handler.handle_DATA, …}``)
    as aiosmtpd builds it, bound when looked up (a session uses a handful of its
    ~15 commands and one or two hooks; binding them all cost more)."""

    __slots__ = ("_names", "_obj")

    def __init__(self, obj: object, names: dict[str, str]) -> None:
        self._obj = obj
        self._names = names

    def __getitem__(self, key: str) -> Any:
        return getattr(self._obj, self._names[key])

    def __iter__(self) -> Iterator[str]:
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)


class AiosmtpdSession(SMTP):
    """aiosmtpd's SMTP protocol with its private members behind named methods.

    The one place that touches aiosmtpd's private members (the wall stays a
    class: ``InboundSMTP`` and its bases use only these methods and the public
    API). aiosmtpd 1.4's public API (``push``, ``check_helo_needed``,
    ``session``, ``envelope``, ``transport``, ``smtp_*`` with ``@syntax``, the
    handler hooks) does not cover what the relay needs: reading DATA in blocks
    from the connection's reader, writing a reply without aiosmtpd's own
    ``push`` (enhanced status codes, a 421 just before closing), moving the
    idle timer to the DATA deadline, knowing that ``connection_made`` is the
    STARTTLS layer's, calling the DATA hook after our own DATA reader, refusing
    a connection without a greeting. ``aiosmtpd_members.RELIED_ON`` lists every
    private member used here; ``tests/test_aiosmtpd_adapter.py`` checks them
    against the installed aiosmtpd.

    Subclasses override the hooks (``envelope_class``, ``serves_client``,
    ``before_idle_close``) instead of aiosmtpd's private methods.

    ``__init__`` sets the same attributes as aiosmtpd's, but without its
    per-connection ``dir()``/``inspect.getmembers()`` scans of the protocol
    and the handler (a quarter of the ingress's CPU per message): the names
    are found once per class (``aiosmtpd_members.scan``) and only bound per
    connection. The handler's ``handle_*``/``auth_*`` hooks are therefore
    looked up on its class (``dir`` of the instance, once per handler class), and the
    "Available AUTH mechanisms" line aiosmtpd logs per connection is not
    logged. ``tests/test_aiosmtpd_adapter.py`` compares the attributes with
    those aiosmtpd's own __init__ sets.
    """

    # What a new transaction's envelope is (aiosmtpd builds it after RSET, HELO/EHLO, DATA).
    envelope_class: type[Envelope] = Envelope
    # The idle deadline (loop time) and whether ``_timeout_handle`` is the idle
    # timer that re-arms itself for it (``_reset_timeout``); class defaults, so the
    # fast __init__ sets exactly aiosmtpd's attributes.
    _idle_at: float = 0.0
    _idle_armed: bool = False
    _quitting: bool = False  # QUIT answered: the command loop ends

    def __init__(self, handler: Any, **options: Any) -> None:
        tls_context = options.get("tls_context")
        if not FAST_INIT_OPTIONS.issuperset(options) or (
            tls_context is not None
            and (
                tls_context.verify_mode not in {ssl.CERT_NONE, ssl.CERT_OPTIONAL}
                or tls_context.check_hostname
            )
        ):
            # Options set up by aiosmtpd alone, or a context it warns about: its own path.
            super().__init__(handler, **options)
            return
        self.__ident__ = options.get("ident") or _AIOSMTPD_IDENT
        self.loop = loop = options.get("loop") or _get_or_new_eventloop()
        asyncio.StreamReaderProtocol.__init__(
            self,
            asyncio.StreamReader(loop=loop, limit=self.line_length_limit),
            client_connected_cb=self._cb_client_connected,
            loop=loop,
        )
        self.event_handler = handler
        data_size_limit = options.get("data_size_limit", DATA_SIZE_DEFAULT)
        assert data_size_limit is None or isinstance(data_size_limit, int)
        self.data_size_limit = data_size_limit
        self.enable_SMTPUTF8 = options.get("enable_SMTPUTF8", False)
        self._decode_data = options.get("decode_data", False)
        self.command_size_limits.clear()
        self.hostname = options.get("hostname") or socket.getfqdn()
        self.tls_context = tls_context
        self.require_starttls = tls_context and False  # as aiosmtpd: None or False
        self._timeout_duration = options.get("timeout", 300)
        self._timeout_handle = None
        self._tls_handshake_okay = True
        self._tls_protocol = None
        self._original_transport = None
        self.session = None
        self.envelope = None
        self.transport = None
        self._handler_coroutine = None
        self._auth_require_tls = True
        self._proxy_timeout = None
        self._auth_callback = login_always_fail
        self._authenticator = None
        self._auth_required = False
        scan = aiosmtpd_members.scan(type(self), handler)
        auth: dict[str, _AuthMechAttr] = {}
        for obj, names in ((self, scan.auth_methods), (handler, scan.handler_auth)):
            for name in names:
                method = getattr(obj, name)
                mechanism = getattr(
                    method, "__auth_mechanism_name__", name.replace("auth_", "").replace("__", "-")
                )
                auth[mechanism] = _AuthMechAttr(method, obj is self)
        self._auth_methods = auth
        self._handle_hooks = _BoundOnUse(handler, scan.handle_hooks)
        self._ehlo_hook_ver = scan.ehlo_hook_ver
        self._smtp_methods = _BoundOnUse(self, scan.smtp_methods)
        self._enforce_call_limit = False

    # --- hooks for subclasses

    def serves_client(self) -> bool:
        """False: run no command loop (and send no greeting) on this connection."""
        return True

    def before_idle_close(self) -> None:
        """Called when the idle timer fires, just before aiosmtpd closes the connection."""

    # --- the connection

    @property
    def starttls_begun(self) -> bool:
        """STARTTLS ran: ``connection_made`` is now the TLS layer's, not a new client's."""
        return self._original_transport is not None

    @property
    def reader(self) -> asyncio.StreamReader:
        """The connection's reader (aiosmtpd reads commands from it line by line)."""
        return self._reader

    def buffered_bytes(self) -> int:
        """Bytes received and waiting in the reader, not yet returned by a read."""
        return len(self._reader._buffer)  # type: ignore[attr-defined]

    def write_raw(self, data: bytes) -> None:
        """Queue bytes for the client as they are (aiosmtpd's ``push`` adds its own encoding)."""
        self._writer.write(data)

    async def drain_writes(self) -> None:
        """Wait until the socket takes what was written (flow control)."""
        await self._writer.drain()

    # --- the transaction

    def reset_transaction(self) -> None:
        """Start over with a new envelope, as RSET does (aiosmtpd's RSET state)."""
        self._set_rset_state()

    def end_transaction(self) -> None:
        """A new envelope after DATA (aiosmtpd's post-DATA state); the old one is dropped."""
        self._set_post_data_state()

    async def run_data_hook(self) -> Any:
        """The handler's ``handle_DATA`` for the current envelope; its reply."""
        return await self._call_handler_hook("DATA")

    # --- the idle timer (aiosmtpd's ``timeout``)

    def restart_idle_timer(self) -> None:
        """The idle timeout counts again from now."""
        self._reset_timeout()

    def move_idle_timer(self, when: float, callback: Callable[[], None]) -> None:
        """Replace the idle timer by ``callback`` at loop time ``when``.

        It takes the idle timer's place, so ``connection_lost`` cancels it and
        ``restart_idle_timer`` puts the idle timeout back.
        """
        if self._timeout_handle is not None:
            self._timeout_handle.cancel()
        self._timeout_handle = self.loop.call_at(when, callback)
        self._idle_armed = False

    # --- aiosmtpd's private hooks, overridden here only

    def _create_envelope(self) -> Envelope:
        return self.envelope_class()

    def _reset_timeout(self, duration: float | None = None) -> None:
        # aiosmtpd makes a new idle timer on every command; here the deadline moves,
        # and the armed timer re-arms itself for what is left of it (``_idle_due``).
        when = self.loop.time() + (duration or self._timeout_duration)
        self._idle_at = when
        handle = self._timeout_handle
        if handle is not None:
            if self._idle_armed and handle.when() <= when and not handle.cancelled():
                return
            handle.cancel()
        self._timeout_handle = self.loop.call_at(when, self._idle_due)
        self._idle_armed = True

    def _idle_due(self) -> None:
        if self.loop.time() < self._idle_at:  # a command came since the timer was armed
            self._timeout_handle = self.loop.call_at(self._idle_at, self._idle_due)
            return
        self._idle_armed = False
        self._timeout_cb()

    @syntax("QUIT")
    async def smtp_QUIT(self, arg: str | None) -> None:
        """aiosmtpd's QUIT, but the task ends by returning, not by cancelling itself
        (its CancelledError's traceback would hold the session in a cycle)."""
        if arg:
            await self.push("501 Syntax: QUIT")
            return
        status = await self._call_handler_hook("QUIT")
        await self.push("221 Bye" if status is MISSING else status)
        self._quitting = True
        assert self.transport is not None
        self.transport.close()

    def connection_lost(self, error: Exception | None) -> None:
        super().connection_lost(error)  # cancels the session's task if it still runs
        task = self._handler_coroutine
        if task is None or task.done():
            self._unbind()
        else:
            task.add_done_callback(self._unbind)

    def _unbind(self, _task: object = None) -> None:
        """Drop what refers back to the session (bound methods, the writer), so it
        goes with its last reference, not at the garbage collector's next pass."""
        self._smtp_methods = self._auth_methods = {}
        self._client_connected_cb = None
        self._writer = None

    async def _handle_client(self) -> None:
        if not self.serves_client():
            return
        if self._proxy_timeout is not None or self._enforce_call_limit or self.require_starttls:
            await super()._handle_client()  # aiosmtpd's options this loop leaves to it
            return
        await self._command_loop()

    async def _command_loop(self) -> None:
        """aiosmtpd 1.4's command loop (``SMTP._handle_client``), its replies and their
        order unchanged, without its per-line ``sanitized_log`` calls (a regular
        expression and a list per line for a logger, ``mail.log``, that the relay
        runs at WARNING): a line is logged only when that logger would write it.
        ``tests/test_aiosmtpd_adapter.py`` plays the same lines to both loops."""
        assert self.session is not None
        peer = self.session.peer
        chatty = _aiosmtpd_log.isEnabledFor(logging.INFO)
        if chatty:
            _aiosmtpd_log.info("%r handling connection", peer)
        await self.push(f"220 {self.hostname} {self.__ident__}")
        bogus_budget = BOGUS_LIMIT
        reader = self._reader
        while self.transport is not None and not self._quitting:
            try:
                try:
                    line: bytes = await reader.readuntil()
                except asyncio.LimitOverrunError as error:
                    await command_errors.discard_long_line(reader, error.consumed)
                    await self.push("500 Command line too long")
                    continue
                line = line.rstrip(b"\r\n")
                if chatty:
                    sanitized_log(_aiosmtpd_log.info, "%r >> %r", peer, line)
                if not line:
                    await self.push("500 Error: bad syntax")
                    continue
                command_bytes, _, arg_bytes = line.partition(b" ")
                try:
                    command = command_bytes.upper().decode("ascii")
                except UnicodeDecodeError:
                    await self.push("500 Error: bad syntax")
                    continue
                arg = _command_argument(arg_bytes, self.enable_SMTPUTF8)
                if arg is _NOT_ASCII:
                    await self.push("500 Error: strict ASCII mode")
                    continue
                limit = (
                    self.command_size_limits[command]
                    if self.session.extended_smtp
                    else self.command_size_limit
                )
                if len(line) > limit:
                    await self.push("500 Command line too long")
                    continue
                if not self._tls_handshake_okay and command != "QUIT":
                    await self.push("554 Command refused due to lack of security")
                    continue
                method = self._smtp_methods.get(command)
                if method is None:
                    _aiosmtpd_log.warning("%r unrecognised: %s", peer, command)
                    bogus_budget -= 1
                    if bogus_budget < 1:
                        _aiosmtpd_log.warning("%r too many bogus commands", peer)
                        await self.push("502 5.5.1 Too many unrecognized commands, goodbye.")
                        self.transport.close()
                        continue
                    await self.push(f'500 Error: command "{command}" not recognized')
                    continue
                self._reset_timeout()
                await method(arg)
            except (asyncio.CancelledError, ConnectionResetError):
                _aiosmtpd_log.info("%r Connection lost during _handle_client()", peer)
                self._writer.close()
                raise
            except Exception as error:  # noqa: BLE001 - aiosmtpd's: the handler's reply to it
                await command_errors.answer(self, error)

    def _timeout_cb(self) -> None:
        self.before_idle_close()
        super()._timeout_cb()


# Not a str: "strict ASCII mode" (aiosmtpd's) for an argument that is not ASCII.
_NOT_ASCII = object()


def _command_argument(arg_bytes: bytes, smtputf8: bool) -> Any:
    """A command's argument as aiosmtpd decodes it: None, text, or ``_NOT_ASCII``."""
    if not arg_bytes:
        return None
    arg_bytes = arg_bytes.strip()
    if smtputf8:  # any bytes, kept as they came (surrogateescape)
        return str(arg_bytes, encoding="utf-8", errors="surrogateescape")
    try:
        return str(arg_bytes, encoding="ascii", errors="strict")
    except UnicodeDecodeError:
        return _NOT_ASCII


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


# --- the message data, before it is stored (the handler's checks: server.RelayHandler)

MAX_RECEIVED_HEADERS = 100  # more is a routing loop (RFC 5321 6.3)
_RECEIVED = re.compile(rb"^received[ \t]*:", re.IGNORECASE | re.MULTILINE)


def has_bare_line_ending(data: bytes | bytearray) -> bool:
    """Any CR or LF that is not part of a CRLF pair (SMTP smuggling, CVE-2023-51764)."""
    crlf = data.count(b"\r\n")
    return data.count(b"\r") != crlf or data.count(b"\n") != crlf


def received_count(data: bytes | bytearray) -> int:
    # Cheaper than queues.lib.inspect_headers, which message_accept runs anyway;
    # counted in place (no copy of the header block, which may be the whole message).
    return sum(1 for _ in _RECEIVED.finditer(data, 0, header_end(data)))


def header_limit_refusal(data: bytes | bytearray, max_fields: int, max_size: int) -> str | None:
    """552 5.3.4 for a header of more fields, or a longer field, than configured:
    what every later step (parsing, DKIM signing) costs is bounded by them."""
    excess = header_shape_refusal(data, max_fields, max_size)
    if excess is None:
        return None
    kind, limit = excess
    reply = policy.TOO_MANY_HEADER_FIELDS if kind == "fields" else policy.HEADER_FIELD_TOO_LONG
    return reply.format(limit=limit)


# --- enhanced status codes (RFC 3463) for the replies ``policy`` does not name
#
# ENHANCEDSTATUSCODES is advertised: ``InboundSMTP.push`` gives every reply after
# the greeting a code; aiosmtpd's own replies get theirs here.

# aiosmtpd's own replies whose class default is not the best code
_BUILTIN = {
    "502 EXPN not implemented": policy.EXPN_DISABLED,
}

# By reply code, the closest RFC 3463 code; the class default otherwise.
_BY_CODE = {
    "214": "2.0.0",
    "220": "2.0.0",  # STARTTLS "Ready to start TLS" (the greeting is never enhanced)
    "221": "2.0.0",
    "235": "2.7.0",
    "250": "2.0.0",
    "252": "2.0.0",
    "421": "4.3.2",
    "450": "4.2.0",
    "451": "4.3.0",
    "452": "4.3.1",
    "454": "4.7.0",
    "500": "5.5.2",
    "501": "5.5.4",
    "502": "5.5.1",
    "503": "5.5.1",
    "504": "5.5.4",
    "530": "5.7.0",
    "535": "5.7.8",
    "538": "5.7.11",
    "550": "5.0.0",
    "552": "5.3.4",
    "553": "5.1.3",
    "554": "5.0.0",
    "555": "5.5.4",
}
_CLASS_DEFAULT = {"2": "2.0.0", "3": "", "4": "4.0.0", "5": "5.0.0"}
_HAS_ENHANCED = re.compile(r"^\d{3}[ -][245]\.\d{1,3}\.\d{1,3}(?: |$)")


def enhance(reply: str) -> str:
    """Give a reply an enhanced status code if it lacks one (1xx/3xx are left alone)."""
    known = _BUILTIN.get(reply)
    if known is not None:
        return known
    if _HAS_ENHANCED.match(reply) or len(reply) < 3 or not reply[:3].isdigit():
        return reply
    code = reply[:3]
    enhanced = _BY_CODE.get(code) or _CLASS_DEFAULT.get(code[0], "")
    if not enhanced:
        return reply
    sep = reply[3:4] or " "
    text = reply[4:]
    return f"{code}{sep}{enhanced} {text}" if text else f"{code}{sep}{enhanced}"


def protocol_keyword(*, extended: bool, tls: bool, utf8: bool, auth: bool = False) -> str:
    """The Received "with" keyword (RFC 3848: ESMTPS, ESMTPA, ESMTPSA; RFC 6531 3.7.3)."""
    if not extended:
        return "SMTP"
    return ("UTF8SMTP" if utf8 else "ESMTP") + ("S" if tls else "") + ("A" if auth else "")


class InboundSMTP(AuthCommand, Commands, AiosmtpdSession):
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

    def _goodbye(self, reply: str = policy.SHUTTING_DOWN) -> None:
        transport = self.transport
        if transport is None or transport.is_closing():
            return
        self.write_raw(reply.encode() + b"\r\n")
        transport.close()

    # --- replies

    async def push(self, status: str | bytes) -> None:
        if isinstance(status, bytes):
            status = status.decode("utf-8", "replace")
        if self._greeted:
            status = enhance(status)
        else:
            self._greeted = True  # the greeting carries no enhanced code
        # Replies may echo client text; never fail on undecodable bytes.
        self.write_raw(status.encode("utf-8", "replace") + b"\r\n")
        await self.drain_writes()

    # --- DATA (the commands before it: ``commands.Commands``; AUTH: ``auth.AuthCommand``)

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
