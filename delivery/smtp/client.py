"""The outbound SMTP client: deliver a batch of messages to one destination.

A small asyncio SMTP client of our own rather than aiosmtplib, because it
needs three things aiosmtplib does not give cheaply:

- exact control of every reply: a rejected RCPT, a 421 in the middle of a
  pipelined group or a timeout must become a result for the right
  recipients, not an exception that loses the other replies;
- PIPELINING (RFC 2920): MAIL, every RCPT and DATA go out in one write and
  their replies are read in order, so a message costs two round trips;
- low CPU per message (the relay must pass several hundred messages a
  second on two cores): one ``bytes.replace`` for dot-stuffing, one write
  for the command group, a few large writes for the body.

It must also survive hostile peers: a reply is capped (``MAX_REPLY_LINES``,
``MAX_REPLY_BYTES``, ``READ_LIMIT`` per line) and anything past the cap is a
protocol failure that closes the connection, so a peer can cost a worker a
bounded amount of memory only. Bodies can be read just in time
(``deliver(load_body=...)``) so a round holds at most one per connection,
and a round that lost its recipients (``still_owner()``) starts nothing more:
it is asked before each connection, before each MAIL FROM and before each
final dot (a transaction abandoned after 354 is closed without the dot, so
the next hop has nothing to deliver).

The client never raises for network problems: every exception becomes a
``RecipientResult`` (see ``delivery.smtp.classify`` for how replies are judged).

One message goes through ``_Connection.send``: the envelope is built
without the peer (``delivery.smtp.envelope``), then exchanged pipelined or
in lock-step (``_pipelined``, ``_lockstep``), then the body is sent
(``_send_body``) and the final reply closes the transaction.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import ipaddress
import logging
import os
import re
import ssl
import time
from collections import deque
from collections.abc import Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from datetime import datetime
from typing import NamedTuple, Protocol

from delivery.smtp import classify as c
from delivery.smtp import dane, mta_sts
from delivery.smtp.auth import Credentials
from delivery.smtp.envelope import (
    BAD_RECIPIENT,
    DATA_LINE,
    Envelope,
    Refusal,
    build_envelope,
    sender_refusal,
)
from delivery.smtp.tls import ENHANCED as TLS_ENHANCED
from delivery.smtp.tls import MAY, TLS_REQUIRED, TlsRequirement
from delivery.smtp.types import (
    BatchResult,
    HostFailure,
    OutboundMessage,
    OutboundRecipient,
    RecipientResult,
)
from queues import clock
from queues.units import seconds

log = logging.getLogger(__name__)

CRLF = b"\r\n"
# RFC 5321 §4.5.3.2: the client waits up to 10 minutes for the reply to the
# final dot, longer than for any command.
MIN_DATA_TIMEOUT = 600.0
# How long a polite QUIT may hold a finished connection.
QUIT_TIMEOUT = 5.0
# Longest reply line we accept (RFC 5321 allows 512; be liberal). The
# StreamReader raises once its buffer holds this much without a newline, so a
# line that never ends costs at most about twice this.
READ_LIMIT = 64 * 1024
# Longest reply we accept, in lines and in bytes (line ends included). Real
# EHLO replies have a dozen lines; without a cap a peer sending endless
# "250-" lines grows the worker until the command timeout (~150 MB/s).
MAX_REPLY_LINES = 100
MAX_REPLY_BYTES = 64 * 1024
# The body goes out in slices of this size, each written once the previous
# one has drained: the transport copies what the socket did not take at once,
# so this bounds that copy instead of duplicating the whole message.
WRITE_CHUNK = 1024 * 1024
END_MARK = b".\r\n"
# Enhanced code for a reply we could not parse or would not read (RFC 3463:
# 4.5.0 other or undefined protocol status).
PROTOCOL_ENHANCED = c.PROTOCOL_ERROR_ENHANCED
END_OF_DATA = "end of data"
# Next hops on this port speak TLS from the first byte (RFC 8314 "submissions").
IMPLICIT_TLS_PORT = 465
AUTH_FAILED = "auth_failed"  # Exim's error name for a refused AUTH
VERIFIED_PEER = ("ca", "mta-sts", "dane")  # TlsSecurity.verified values that checked the peer
_LINE_END = re.compile(rb"\r\n|\r|\n")


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


@dataclass
class ClientConfig:
    helo_name: str
    connect_timeout: float = 30.0
    # Every command reply (greeting, EHLO, MAIL, RCPT, DATA, RSET).
    command_timeout: float = 300.0
    # Sending the message body and waiting for the reply to the final dot.
    data_timeout: float = MIN_DATA_TIMEOUT
    max_messages_per_connection: int = 20
    max_connections: int = 10
    # Per target: the TLS requirement (None: "may" everywhere) and the AUTH
    # credentials (None: no AUTH); see delivery.smtp.tls.RoundTls.
    tls_for: Callable[[Peer], TlsRequirement] | None = None
    auth_for: Callable[[Peer], Credentials | None] | None = None
    # Source addresses to bind (at most one IPv4, one IPv6; delivery.shaping):
    # the one of the target's family is used, none of it: the system's choice.
    source_address: tuple[str, ...] = ()
    # AUTH credentials over TLS whose certificate was not verified (MITM-able):
    # refused unless the operator allows it (MAILRELAY_SMTP_AUTH_ALLOW_UNVERIFIED_TLS).
    auth_over_unverified_tls: bool = False

    @classmethod
    def from_settings(cls) -> ClientConfig:
        from django.conf import settings

        command = seconds(settings.MAILRELAY_SMTP_CLIENT_TIMEOUT)
        data = settings.MAILRELAY_SMTP_DATA_TIMEOUT
        return cls(
            helo_name=settings.MAILRELAY_HOSTNAME,
            connect_timeout=seconds(settings.MAILRELAY_SMTP_CONNECT_TIMEOUT),
            command_timeout=command,
            data_timeout=seconds(data) if data is not None else max(command, MIN_DATA_TIMEOUT),
            max_messages_per_connection=int(settings.MAILRELAY_MAX_MESSAGES_PER_CONNECTION),
            max_connections=int(settings.MAILRELAY_MAX_CONNECTIONS_PER_DESTINATION),
            auth_over_unverified_tls=settings.MAILRELAY_SMTP_AUTH_ALLOW_UNVERIFIED_TLS,
        )


# --- helpers --------------------------------------------------------------------


def stuffed(data: bytes) -> bytes:
    """The body as it goes on the wire after DATA, without the final ``.CRLF``.

    ``data`` should be CRLF-normalised already; if a bare CR or LF slipped
    through anyway it is made a CRLF here, so that no receiver can read a
    different end of data than we meant (SMTP smuggling). A missing final
    CRLF is added so the terminator is on a line of its own, and every line
    starting with a dot gets one more (RFC 5321 §4.5.2).
    """
    crlf = data.count(CRLF)
    if data.count(b"\n") != crlf or data.count(b"\r") != crlf:  # three C scans: cheap
        data = _LINE_END.sub(CRLF, data)
    if data and not data.endswith(CRLF):
        data += CRLF
    if data.startswith(b"."):
        data = b"." + data
    # Returns ``data`` itself (no copy) when no line starts with a dot.
    return data.replace(b"\r\n.", b"\r\n..")


def _split_groups(messages: Sequence[OutboundMessage], size: int) -> list[list[OutboundMessage]]:
    """As few groups as ``size`` allows, balanced (45 at 20 → 15+15+15), so
    the connections finish together instead of one carrying a short tail."""
    size = max(1, size)
    count = -(-len(messages) // size)
    if not count:
        return []
    base, extra = divmod(len(messages), count)
    groups, start = [], 0
    for i in range(count):
        end = start + base + (1 if i < extra else 0)
        groups.append(list(messages[start:end]))
        start = end
    return groups


def _local_addr(sources: Sequence[str], peer: str) -> tuple[str, int] | None:
    """The source address of the peer's family to bind (port chosen by the system)."""
    if not sources:
        return None
    try:
        version = ipaddress.ip_address(peer.strip("[]")).version
    except ValueError:
        version = 4
    for source in sources:
        if ipaddress.ip_address(source).version == version:
            return (source, 0)
    return None


def _sni(host: str) -> str | None:
    try:
        ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        return host.rstrip(".") or None
    return None  # SNI carries names only (RFC 6066 §3)


_tls_context: ssl.SSLContext | None = None


def _client_tls_context() -> ssl.SSLContext:
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


def _tls_context_for(req: TlsRequirement) -> ssl.SSLContext:
    """The opportunistic context, or for ``verify``/``secure``/MTA-STS one that
    checks the chain against ``ca_file`` (the system store when empty) and the
    host name; built once per CA file (and again when the file changes)."""
    if req.verify not in ("ca", "mta-sts"):
        return _client_tls_context()
    stamp = os.stat(req.ca_file).st_mtime if req.ca_file else 0.0
    key = (req.ca_file, stamp)
    ctx = _verifying_contexts.get(key)
    if ctx is None:
        ctx = ssl.create_default_context(cafile=req.ca_file or None)
        _verifying_contexts[key] = ctx
    return ctx


def _peer_chain(ssl_object: ssl.SSLObject | None) -> list[bytes]:
    """The certificates the peer sent (DER, leaf first), for DANE."""
    if ssl_object is None:
        return []
    inner = getattr(ssl_object, "_sslobj", None)
    get_chain = getattr(inner, "get_unverified_chain", None)
    if get_chain is not None:  # private before Python 3.13, public after
        return [cert.public_bytes(2) for cert in get_chain() or []]  # 2: DER
    leaf = ssl_object.getpeercert(binary_form=True)
    return [leaf] if leaf else []


@dataclass(slots=True)
class _Security:
    """The transport security of one session (Attempt.tls_* and auth_used)."""

    policy: str = ""
    version: str = ""
    cipher: str = ""
    verified: str = ""
    auth: str = ""
    report: str = ""  # an MTA-STS "testing" failure, for an Event


class _Reply(NamedTuple):
    code: int
    lines: list[str]

    @property
    def text(self) -> str:
        """The reply text after the code, lines joined by a space; enhanced
        codes repeated on continuation lines are dropped."""
        if len(self.lines) == 1:
            return self.lines[0]
        return " ".join([self.lines[0], *(c.strip_enhanced(x) for x in self.lines[1:])])


class _ClaimLost(Exception):
    """The round lost its recipients in the middle of a transaction: the
    connection is dropped without the final dot and nothing is recorded."""


class _SessionFailed(Exception):
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
        return self.enhanced == PROTOCOL_ENHANCED


@dataclass(slots=True)
class _Failure:
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
    security: _Security | None = None

    @classmethod
    def of(
        cls, exc: _SessionFailed, target: Peer, tls_policy: str, security: _Security
    ) -> _Failure:
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
    c.GREETING: "the greeting",
    c.EHLO: "EHLO",
    c.STARTTLS: "STARTTLS",
    c.MAIL: "MAIL FROM",
    c.RCPT: "RCPT TO",
    c.DATA: "DATA",
    c.SESSION: "RSET",
}


class _Recorder:
    """The results of one message on one target, one per recipient."""

    __slots__ = ("msg", "target", "started", "t0", "decided", "peer_dsn", "security")

    def __init__(
        self,
        msg: OutboundMessage,
        target: Peer,
        started: datetime,
        t0: float,
        peer_dsn: bool = False,
        security: _Security | None = None,
    ):
        self.peer_dsn = peer_dsn
        self.security = security or _Security()
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


# --- one SMTP session -----------------------------------------------------------


class _Connection:
    """One open SMTP session with one target, after a good EHLO."""

    def __init__(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        target: Peer,
        config: ClientConfig,
    ) -> None:
        self.reader = reader
        self.writer = writer
        self.target = target
        self.config = config
        self.extensions: dict[str, str] = {}
        self.tls = False
        self.security = _Security()
        # A transaction was left open (MAIL accepted, never finished by DATA).
        self.need_rset = False
        self.waiting_for = "greeting"
        # Asked before MAIL FROM and before the final dot: False once the round
        # lost its recipients (then nothing more goes on the wire).
        self.may_send: Callable[[], bool] = lambda: True

    # Reading and writing --------------------------------------------------------

    async def _read_reply(self) -> _Reply:
        """One reply, at most MAX_REPLY_LINES lines and MAX_REPLY_BYTES bytes
        (each line at most READ_LIMIT); past that, ``_ProtocolError``."""
        lines: list[str] = []
        size = 0
        while True:
            try:
                line = await self.reader.readline()
            except ValueError as exc:  # LimitOverrunError: READ_LIMIT and no newline
                raise _ProtocolError(f"reply line longer than {READ_LIMIT} bytes") from exc
            if not line.endswith(b"\n"):
                raise ConnectionResetError("connection closed by peer")
            code = line[:3]
            sep = line[3:4]
            if not code.isdigit() or sep not in (b" ", b"-", b"\r", b"\n"):
                raise _ProtocolError(f"malformed reply {line[:80]!r}")
            size += len(line)
            if size > MAX_REPLY_BYTES:
                raise _ProtocolError(f"reply longer than {MAX_REPLY_BYTES} bytes")
            lines.append(line[4:].rstrip(b"\r\n").decode("utf-8", "replace"))
            if sep != b"-":
                return _Reply(int(code), lines)
            if len(lines) >= MAX_REPLY_LINES:
                raise _ProtocolError(f"reply longer than {MAX_REPLY_LINES} lines")

    async def reply(self, waiting_for: str) -> _Reply:
        self.waiting_for = waiting_for
        return await self._read_reply()

    async def command(self, line: bytes, waiting_for: str, phase: str) -> _Reply:
        """Send one command and read its reply, within the command timeout."""
        try:
            async with asyncio.timeout(self.config.command_timeout):
                self.writer.write(line)
                await self.writer.drain()
                return await self.reply(waiting_for)
        except _SessionFailed:
            raise
        except Exception as exc:  # noqa: BLE001 - mapped to a result below
            raise self.lost(exc, phase, self.config.command_timeout) from exc

    def lost(self, exc: BaseException, phase: str, timeout: float) -> _SessionFailed:
        """The failure for an exception raised while talking to the peer."""
        if isinstance(exc, TimeoutError):
            text = f"timeout after {timeout:g}s waiting for reply to {self.waiting_for}"
        elif isinstance(exc, _ProtocolError):
            text = f"protocol error after {self.waiting_for}: {exc}"
        elif isinstance(exc, ssl.SSLError):
            text = f"TLS error after {self.waiting_for}: {exc}"
        else:
            why = str(exc) or type(exc).__name__
            text = f"lost connection while waiting for reply to {self.waiting_for}: {why}"
        # The peer may have taken the message before the reply was lost.
        note = " (the message may be delivered twice)" if self.waiting_for == END_OF_DATA else ""
        if isinstance(exc, _ProtocolError):
            # We close the connection, not the peer: no Exim name fits.
            return _SessionFailed(phase, None, text, note, "", PROTOCOL_ENHANCED)
        error = "timeout" if isinstance(exc, TimeoutError) else "lost_connection"
        return _SessionFailed(phase, None, text, note, error)

    # Session set-up ---------------------------------------------------------------

    async def hello(self, phase: str) -> None:
        """EHLO, or HELO when EHLO is refused with 5xx; raise on failure."""
        name = self.config.helo_name.encode("ascii", "replace")
        r = await self.command(b"EHLO " + name + CRLF, "EHLO", phase)
        if r.code // 100 == 2:
            ext: dict[str, str] = {}
            for line in r.lines[1:]:
                keyword, _, params = line.partition(" ")
                ext[keyword.upper()] = params.strip()
            self.extensions = ext
            return
        if r.code // 100 == 5:
            r = await self.command(b"HELO " + name + CRLF, "HELO", phase)
            if r.code // 100 == 2:
                self.extensions = {}
                return
        raise _SessionFailed(phase, r.code, r.text)

    async def starttls(self, context: ssl.SSLContext | None = None) -> bool:
        """STARTTLS and a fresh EHLO. Returns False when the peer declined
        (the session goes on in cleartext); raises when TLS broke the session."""
        r = await self.command(b"STARTTLS\r\n", "STARTTLS", c.STARTTLS)
        if r.code in c.CONNECTION_CODES:
            raise _SessionFailed(c.STARTTLS, r.code, r.text)
        if r.code != 220:
            log.info(
                "%s declined STARTTLS (%s %s); going on in cleartext",
                self.target.host,
                r.code,
                r.text,
            )
            return False
        # Bytes already waiting after the 220 were sent in cleartext and
        # would be read as if protected (CVE-2011-0411): refuse them.
        if getattr(self.reader, "_buffer", b""):
            raise _SessionFailed(c.STARTTLS, None, "data after the STARTTLS reply (injection?)")
        self.waiting_for = "TLS handshake"
        try:
            async with asyncio.timeout(self.config.command_timeout):
                await self.writer.start_tls(
                    context or _client_tls_context(), server_hostname=_sni(self.target.host)
                )
        except Exception as exc:  # noqa: BLE001 - any handshake failure
            why = str(exc) or type(exc).__name__
            if isinstance(exc, TimeoutError):
                why = f"timeout after {self.config.command_timeout:g}s"
            raise _SessionFailed(c.STARTTLS, None, f"TLS handshake failed: {why}") from exc
        self.tls_established()
        await self.hello(c.EHLO)
        return True

    def tls_established(self) -> None:
        """Note the TLS version and cipher of the session now encrypted."""
        self.tls = True
        ssl_object = self.writer.get_extra_info("ssl_object")
        if ssl_object is not None:
            self.security.version = ssl_object.version() or ""
            cipher = ssl_object.cipher()
            self.security.cipher = cipher[0] if cipher else ""

    def check_peer(self, req: TlsRequirement) -> None:
        """After TLS: DANE matching (the context did the CA/MTA-STS checks);
        record how the peer was verified. Raises when DANE finds no match."""
        if req.verify == "dane":
            chain = _peer_chain(self.writer.get_extra_info("ssl_object"))
            if dane.match(req.tlsa, chain) is None:
                raise _SessionFailed(
                    c.STARTTLS,
                    None,
                    f"TLS required ({req.level}) but no TLSA record of {self.target.host} "
                    "matches its certificate (DANE)",
                    error=TLS_REQUIRED,
                    enhanced=TLS_ENHANCED,
                )
            self.security.verified = "dane"
        elif req.verify in ("ca", "mta-sts"):
            self.security.verified = req.verify
        elif req.verify == "report":
            chain = _peer_chain(self.writer.get_extra_info("ssl_object"))
            problem = mta_sts.check_chain(chain, self.target.host, req.ca_file)
            self.security.verified = "none" if problem else "mta-sts"
            self.security.report = problem
        else:
            self.security.verified = "none"

    async def authenticate(self, creds: Credentials) -> None:
        """AUTH PLAIN, else LOGIN (RFC 4954); never in cleartext unless the
        credentials allow it, and over TLS only when the peer's certificate was
        verified (a ``verify``/``secure``/``dane`` or MTA-STS policy) unless the
        operator allows unverified TLS. A 5xx is Exim's ``auth_failed``: that
        next hop will refuse every connection the same way."""
        host = self.target.host
        if not self.tls and not creds.allow_cleartext:
            raise _SessionFailed(
                c.EHLO,
                None,
                f"refusing to send AUTH credentials to {host} without TLS "
                "(add allow-cleartext to its MAILRELAY_SMTP_AUTH line to allow it)",
                error=TLS_REQUIRED,
                enhanced=TLS_ENHANCED,
            )
        unverified = self.tls and self.security.verified not in VERIFIED_PEER
        if unverified and not (creds.allow_cleartext or self.config.auth_over_unverified_tls):
            raise _SessionFailed(
                c.EHLO,
                None,
                f"refusing to send AUTH credentials to {host}: its TLS certificate was not "
                f"verified (TLS policy {self.security.policy or 'may'}; give it the level verify, "
                "secure or dane, or set MAILRELAY_SMTP_AUTH_ALLOW_UNVERIFIED_TLS)",
                error=TLS_REQUIRED,
                enhanced=TLS_ENHANCED,
            )
        offered = self.extensions.get("AUTH", "").upper().split()
        if "PLAIN" in offered:
            mechanism = "PLAIN"
            r = await self.command(b"AUTH PLAIN " + creds.plain() + CRLF, "AUTH", c.EHLO)
        elif "LOGIN" in offered:
            mechanism = "LOGIN"
            r = await self._auth_login(creds)
        else:
            raise _SessionFailed(
                c.EHLO,
                None,
                f"{host} offers no AUTH PLAIN or LOGIN (offered: {' '.join(offered) or 'none'}); "
                "credentials are configured for it",
                error=AUTH_FAILED,
                enhanced="4.7.0",
            )
        if r.code == 235:
            self.security.auth = mechanism
            return
        error = AUTH_FAILED if r.code // 100 == 5 else ""
        # Say plainly what failed (the reply text is often just "failed"), and
        # keep the peer's enhanced code in its own field.
        label = "authentication failed (auth_failed)" if error else "authentication deferred"
        raise _SessionFailed(
            c.EHLO,
            r.code,
            f"{label}: {c.strip_enhanced(r.text)}",
            error=error,
            enhanced=c.parse_enhanced(r.text),
            in_reply_to=f"AUTH {mechanism}",
        )

    async def _auth_login(self, creds: Credentials) -> _Reply:
        """AUTH LOGIN: the user name and the password, each after a 334."""
        r = await self.command(b"AUTH LOGIN\r\n", "AUTH", c.EHLO)
        for secret in (creds.username, creds.password):
            if r.code != 334:
                return r
            answer = base64.b64encode(secret.encode()) + CRLF
            r = await self.command(answer, "AUTH", c.EHLO)
        return r

    # Sending one message ----------------------------------------------------------

    async def rset(self) -> None:
        r = await self.command(b"RSET\r\n", "RSET", c.SESSION)
        if r.code // 100 != 2:
            raise _SessionFailed(c.SESSION, r.code, r.text)
        self.need_rset = False

    async def send(
        self, msg: OutboundMessage, rec: _Recorder, load_body: LoadBody | None = None
    ) -> None:
        """Send one message; put a result for each recipient in ``rec``.

        Raises ``_SessionFailed`` when the session breaks (no reply or 421):
        results already in ``rec`` stand, the caller fills in the rest.

        Steps:
        1. refuse an unsafe sender or MAIL parameter (5.1.7) before reading
           the body; read it (``load_body`` when ``msg.data`` is None; a
           failure defers the message, 4.3.0);
        2. build the envelope (``delivery.smtp.envelope``), which may refuse
           the whole message (SIZE 5.3.4, SMTPUTF8 5.6.7) or some recipients
           (5.1.3) without asking the peer;
        3. MAIL, RCPT and DATA, pipelined or in lock-step (``_exchange``);
           a MAIL failure goes to every recipient, a RCPT failure to its own;
        4. on 354 send the body (``_send_body``) and give the final reply to
           the accepted recipients (``_end_transaction``); any other DATA
           reply goes to them too. Until a final reply, the next message
           starts with RSET (``need_rset``).
        """
        refusal = sender_refusal(msg)
        if refusal is not None:
            rec.refuse(msg.recipients, refusal)
            return
        data = await self._read_body(msg, rec, load_body)
        if data is None:
            return
        envelope = build_envelope(msg, data, self.extensions, self.target.host)
        if isinstance(envelope, Refusal):
            rec.refuse(msg.recipients, envelope)
            return
        rec.refuse(envelope.refused, BAD_RECIPIENT)
        if not envelope.rcpts:
            return

        reply, accepted = await self._exchange(envelope, rec)
        if reply is None:
            return  # lock-step stopped before DATA: MAIL refused or no RCPT accepted
        if reply.code != 354:
            if accepted:
                rec.set_many(accepted, c.DATA, reply.code, reply.text)
            return

        self.waiting_for = END_OF_DATA
        try:
            async with asyncio.timeout(self.config.data_timeout):
                await self._send_body(data if accepted else None)
                del data  # the final reply may take minutes: hold no body while waiting
                reply = await self.reply(END_OF_DATA)
        except _ClaimLost:
            raise
        except Exception as exc:  # noqa: BLE001
            raise self.lost(exc, c.SESSION, self.config.data_timeout) from exc
        self._end_transaction(reply, accepted, rec)

    async def _read_body(
        self, msg: OutboundMessage, rec: _Recorder, load_body: LoadBody | None
    ) -> bytes | None:
        """The message's bytes: given, or read now through ``load_body``.
        None when they cannot be read: the message is deferred (4.3.0) and
        the session goes on with the next one."""
        if msg.data is not None:
            return msg.data
        try:
            if load_body is None:
                raise LookupError("no body given and no load_body to read it")
            return await load_body(msg)
        except Exception as exc:  # noqa: BLE001 - that message waits, the session goes on
            log.warning("cannot read the body of message %s: %r", msg.id, exc)
            text = f"cannot read the message body: {exc}"
            rec.refuse(msg.recipients, Refusal(c.MAIL, "4.3.0", text))
            return None

    async def _exchange(
        self, envelope: Envelope, rec: _Recorder
    ) -> tuple[_Reply | None, list[OutboundRecipient]]:
        """MAIL, RCPT and DATA, all within one command timeout. Returns the
        reply to DATA (None when DATA was not sent) and the recipients accepted."""
        if not self.may_send():
            raise _ClaimLost("before MAIL FROM")
        self.waiting_for = "MAIL FROM"
        try:
            async with asyncio.timeout(self.config.command_timeout):
                if "PIPELINING" in self.extensions:
                    return await self._pipelined(envelope, rec)
                return await self._lockstep(envelope, rec)
        except _SessionFailed:
            raise
        except Exception as exc:  # noqa: BLE001 - mapped to a result by lost()
            raise self.lost(exc, c.SESSION, self.config.command_timeout) from exc

    async def _pipelined(
        self, envelope: Envelope, rec: _Recorder
    ) -> tuple[_Reply, list[OutboundRecipient]]:
        """RFC 2920: MAIL, every RCPT and DATA in one write, then their replies
        in order, so a message costs two round trips whatever the replies."""
        self.writer.write(b"".join([envelope.mail, *envelope.rcpt_lines, DATA_LINE]))
        await self.writer.drain()
        self.need_rset = True  # until a final-dot reply closes the transaction
        mail_ok = await self._mail_reply(envelope, rec)
        accepted: list[OutboundRecipient] = []
        for rcpt in envelope.rcpts:
            if not mail_ok:
                # Read and checked for 421 only: a 503 "need MAIL" says
                # nothing about the recipient.
                await self._checked_reply("RCPT TO", c.RCPT)
            elif await self._rcpt_reply(rcpt, rec):
                accepted.append(rcpt)
        return await self._checked_reply("DATA", c.DATA), accepted

    async def _lockstep(
        self, envelope: Envelope, rec: _Recorder
    ) -> tuple[_Reply | None, list[OutboundRecipient]]:
        """Without PIPELINING: one command, one reply; no RCPT after a failed
        MAIL and no DATA when no recipient was accepted (the DATA reply is
        then None)."""
        write, drain = self.writer.write, self.writer.drain
        write(envelope.mail)
        await drain()
        self.need_rset = True  # until a final-dot reply closes the transaction
        if not await self._mail_reply(envelope, rec):
            return None, []
        accepted: list[OutboundRecipient] = []
        for rcpt, line in zip(envelope.rcpts, envelope.rcpt_lines, strict=True):
            write(line)
            await drain()
            if await self._rcpt_reply(rcpt, rec):
                accepted.append(rcpt)
        if not accepted:
            return None, accepted
        write(DATA_LINE)
        await drain()
        return await self._checked_reply("DATA", c.DATA), accepted

    async def _checked_reply(self, waiting_for: str, phase: str) -> _Reply:
        """The next reply; a 421 ends the session (``_SessionFailed``)."""
        r = await self.reply(waiting_for)
        if r.code in c.CONNECTION_CODES:
            raise _SessionFailed(phase, r.code, r.text)
        return r

    async def _mail_reply(self, envelope: Envelope, rec: _Recorder) -> bool:
        """Whether MAIL was accepted; if not, its reply goes to every recipient sent."""
        r = await self._checked_reply("MAIL FROM", c.MAIL)
        if r.code // 100 == 2:
            return True
        rec.set_many(envelope.rcpts, c.MAIL, r.code, r.text)
        return False

    async def _rcpt_reply(self, rcpt: OutboundRecipient, rec: _Recorder) -> bool:
        """Whether ``rcpt`` was accepted; if not, it gets the reply."""
        r = await self._checked_reply("RCPT TO", c.RCPT)
        if r.code // 100 == 2:
            return True
        rec.set(rcpt, c.RCPT, r.code, r.text)
        return False

    async def _send_body(self, data: bytes | None) -> None:
        """Write the dot-stuffed body in WRITE_CHUNK slices, then the final dot.
        The slices are views (no copy); waiting for each to drain keeps the
        transport's own copy of what the socket has not taken to one slice.

        ``data`` None writes the lone dot: the peer said 354 with no recipient
        accepted (it should not, RFC 2920 §3.1) and the empty transaction ends."""
        if data is not None:
            wire = stuffed(data)
            with memoryview(wire) as view:
                for start in range(0, len(view), WRITE_CHUNK):
                    self.writer.write(view[start : start + WRITE_CHUNK])
                    await self.writer.drain()
        if not self.may_send():
            raise _ClaimLost("before the final dot")
        self.writer.write(END_MARK)
        await self.writer.drain()

    def _end_transaction(
        self, reply: _Reply, accepted: list[OutboundRecipient], rec: _Recorder
    ) -> None:
        """The reply to the final dot closes the transaction (no RSET needed);
        it goes to the accepted recipients, unless it is a 421."""
        self.need_rset = False
        if reply.code in c.CONNECTION_CODES:
            raise _SessionFailed(c.DATA, reply.code, reply.text)
        if accepted:
            rec.set_many(accepted, c.DATA, reply.code, reply.text)

    # Ending -------------------------------------------------------------------------

    async def quit(self) -> None:
        """QUIT politely and close; a peer that does not answer is not our problem."""
        try:
            async with asyncio.timeout(min(self.config.command_timeout, QUIT_TIMEOUT)):
                self.writer.write(b"QUIT\r\n")
                await self.writer.drain()
                await self._read_reply()
        except Exception:  # noqa: BLE001 - the messages are done already
            pass
        await self.close()

    async def close(self) -> None:
        self.writer.close()
        try:
            async with asyncio.timeout(1.0):
                await self.writer.wait_closed()
        except Exception:  # noqa: BLE001 - closing anyway
            pass

    def abort(self) -> None:
        transport = self.writer.transport
        if transport is not None:
            transport.abort()


class _ProtocolError(Exception):
    pass


# --- the batch ------------------------------------------------------------------


@dataclass(slots=True)
class _TargetState:
    # Nothing answered (refused, unreachable, connect or greeting timeout):
    # later connections of this batch skip the target instead of waiting again.
    dead: bool = False
    # The TLS handshake failed: tried again in cleartext after every other
    # target (RFC 7435 opportunistic TLS must not make mail undeliverable).
    tls_broken: bool = False


StillOwner = Callable[[], bool]
LoadBody = Callable[[OutboundMessage], Awaitable[bytes]]
# Called with a finished message's results; what it returns (when not None) is
# awaited before the same connection starts its next transaction.
OnSent = Callable[[list[RecipientResult]], Awaitable[object] | None]


class _Batch:
    def __init__(
        self,
        targets: Sequence[Peer],
        config: ClientConfig,
        still_owner: StillOwner | None = None,
        load_body: LoadBody | None = None,
        on_sent: OnSent | None = None,
    ) -> None:
        self.targets = list(targets)
        self.config = config
        self.still_owner = still_owner
        self.load_body = load_body
        self.on_sent = on_sent
        # still_owner() said False once: nothing new starts from then on.
        self.abandoned = False
        self.states = [_TargetState() for _ in self.targets]
        self.results: list[RecipientResult] = []
        self.connected = False
        self.last_failure: _Failure | None = None
        self.connection_error = ""
        self.host_failures: list[HostFailure] = []

    def owner(self) -> bool:
        """Whether the round may start something new (a connection, a message).
        Once it may not, it never may again: the recipients have a new owner."""
        if self.abandoned or self.still_owner is None:
            return not self.abandoned
        try:
            owner = self.still_owner()
        except Exception:  # a broken check must not send a second copy: assume lost
            log.exception("still_owner() failed; the round stops as if it lost ownership")
            owner = False
        if not owner:
            log.info("delivery round lost ownership of its recipients; stopping")
            self.abandoned = True
        return not self.abandoned

    def candidates(self) -> Iterator[tuple[int, bool]]:
        """(target index, use STARTTLS) in the order to try them; lazy, so a
        target marked dead by another connection meanwhile is skipped."""
        for i, state in enumerate(self.states):
            if not state.dead and not state.tls_broken:
                yield i, True
        for i, state in enumerate(self.states):
            if state.tls_broken and not state.dead:
                yield i, False

    def _fail(self, failure: _Failure) -> _Failure:
        self.last_failure = failure
        t = failure.target
        self.host_failures.append(
            HostFailure(
                t.host,
                t.ip,
                t.port,
                failure.phase,
                failure.code,
                failure.text,
                failure.error,
                failure.tls_policy,
            )
        )
        log.info("delivery to %s failed: %s", failure.target.host, failure.describe())
        return failure

    def requirement(self, target: Peer) -> TlsRequirement:
        return self.config.tls_for(target) if self.config.tls_for is not None else MAY

    async def open(self, index: int, use_tls: bool) -> _Connection | _Failure:
        """Connect, read the greeting, EHLO, STARTTLS when offered (or when the
        TLS policy requires it: never cleartext then), AUTH when configured."""
        target = self.targets[index]
        state = self.states[index]
        cfg = self.config
        req = self.requirement(target)
        if req.refuse:  # e.g. an MX that the MTA-STS policy does not list
            state.dead = True
            text = c.strip_enhanced(req.refuse)
            return self._fail(
                _Failure(c.CONNECT, None, text, target, TLS_REQUIRED, TLS_ENHANCED, "", req.level)
            )
        implicit = target.port == IMPLICIT_TLS_PORT
        try:
            async with asyncio.timeout(cfg.connect_timeout):
                reader, writer = await asyncio.open_connection(
                    target.ip or target.host,
                    target.port,
                    limit=READ_LIMIT,
                    local_addr=_local_addr(cfg.source_address, target.ip or target.host),
                    ssl=_tls_context_for(req) if implicit else None,
                    server_hostname=_sni(target.host) or target.host if implicit else None,
                )
        except ssl.SSLError as exc:  # implicit TLS (port 465): the handshake failed
            state.dead = True
            return self._fail(
                _Failure(
                    c.STARTTLS,
                    None,
                    f"TLS handshake failed (implicit TLS, port {target.port}): {exc}",
                    target,
                    TLS_REQUIRED,
                    TLS_ENHANCED,
                    "",
                    req.level,
                )
            )
        except TimeoutError:
            state.dead = True
            return self._fail(
                _Failure(
                    c.CONNECT,
                    None,
                    f"connect timeout after {cfg.connect_timeout:g}s",
                    target,
                    "timeout_connect",
                )
            )
        except Exception as exc:  # noqa: BLE001 - refused, unreachable, DNS
            state.dead = True
            errno = getattr(exc, "errno", None)
            why = os.strerror(errno) if errno else str(exc) or type(exc).__name__
            return self._fail(
                _Failure(c.CONNECT, None, f"connect failed: {why}", target, "refused")
            )

        conn = _Connection(reader, writer, target, cfg)
        conn.security.policy = req.level
        if implicit:
            conn.tls_established()
        try:
            try:
                async with asyncio.timeout(cfg.command_timeout):
                    greeting = await conn.reply("greeting")
            except Exception as exc:  # noqa: BLE001
                state.dead = True
                raise conn.lost(exc, c.GREETING, cfg.command_timeout) from exc
            if greeting.code // 100 != 2:
                # A 4xx/5xx greeting may be per connection (too many from us),
                # so the target stays available to the other connections.
                raise _SessionFailed(c.GREETING, greeting.code, greeting.text)
            self.connected = True
            await conn.hello(c.EHLO)
            await self._secure(conn, state, req, use_tls)
            creds = cfg.auth_for(target) if cfg.auth_for is not None else None
            if creds is not None:
                try:
                    await conn.authenticate(creds)
                except _SessionFailed as exc:
                    if exc.error:  # refused for good, or no way to send it: same next time
                        state.dead = True
                    raise
            return conn
        except _SessionFailed as exc:
            if exc.protocol:
                # It would do the same to every connection of this batch.
                state.dead = True
            await _discard(conn, polite=exc.code is not None)
            return self._fail(_Failure.of(exc, target, req.level, conn.security))
        except Exception as exc:  # a bug must not escape as an exception
            log.exception("unexpected error opening %s", target.host)
            conn.abort()
            return self._fail(_Failure(c.SESSION, None, f"internal error: {exc!r}", target))
        except BaseException:  # cancelled: leave no socket behind
            conn.abort()
            raise

    async def _secure(
        self, conn: _Connection, state: _TargetState, req: TlsRequirement, use_tls: bool
    ) -> None:
        """STARTTLS as the policy says. At ``may`` a broken handshake is
        retried later in cleartext (``tls_broken``); when TLS is required a
        missing or failed TLS is a per-connection failure (4.7.5,
        ``tls_required``) and the target is not tried again in this round."""
        host = conn.target.host
        offered = "STARTTLS" in conn.extensions
        if not conn.tls and req.level != "none" and offered and (use_tls or req.require):
            try:
                await conn.starttls(_tls_context_for(req))
            except _SessionFailed as exc:
                if exc.code is None and req.require:
                    state.dead = True
                    raise _SessionFailed(
                        c.STARTTLS,
                        None,
                        f"TLS required ({req.level}) but the TLS handshake with {host} "
                        f"failed: {exc.text.removeprefix('TLS handshake failed: ')}",
                        error=TLS_REQUIRED,
                        enhanced=TLS_ENHANCED,
                    ) from exc
                if exc.code is None:
                    state.tls_broken = True
                raise
        if req.verify == "report" and not conn.tls:
            conn.security.report = (
                f"{host} offered no STARTTLS" if not offered else (f"no TLS with {host}")
            )
        if req.require and not conn.tls:
            state.dead = True
            raise _SessionFailed(
                c.STARTTLS,
                None,
                f"TLS required ({req.level}) but not offered by {host}",
                error=TLS_REQUIRED,
                enhanced=TLS_ENHANCED,
            )
        if conn.tls:
            try:
                conn.check_peer(req)
            except _SessionFailed:
                state.dead = True
                raise

    async def run_group(self, group: list[OutboundMessage]) -> None:
        """Deliver one connection's messages, walking the targets.

        Steps:
        1. take the next candidate target and open a session (connect,
           greeting, EHLO/HELO, STARTTLS); on failure remember it and go on;
        2. send the messages one after the other over that session, RSET
           first when the previous transaction was left open;
        3. when the session breaks (no reply, timeout, 421) the message in
           progress is deferred with that error and the rest continue on
           the next target;
        4. when no target is left, every remaining message is deferred with
           the last connection error (which becomes the batch's error).
        """
        remaining = deque(group)
        group_started = clock.now()
        group_t0 = time.monotonic()
        failure: _Failure | None = None
        for index, use_tls in self.candidates():
            if not remaining or not self.owner():
                break
            opened = await self.open(index, use_tls)
            if isinstance(opened, _Failure):
                failure = opened
                continue
            failure = await self._session(opened, remaining)
        # Messages never started get no result once the round lost ownership.
        if remaining and self.owner():
            self._defer_remaining(remaining, failure, group_started, group_t0)

    async def _session(
        self, conn: _Connection, remaining: deque[OutboundMessage]
    ) -> _Failure | None:
        rec: _Recorder | None = None
        conn.may_send = self.owner
        recorded: Awaitable[object] | None = None
        try:
            while remaining and self.owner():
                if recorded is not None:
                    # The previous message's outcome is durable before the next
                    # transaction starts: a crash re-sends at most one message
                    # per open connection.
                    await recorded
                    recorded = None
                    continue  # ownership is asked again
                if conn.need_rset:
                    await conn.rset()
                rec = _Recorder(
                    remaining[0],
                    conn.target,
                    clock.now(),
                    time.monotonic(),
                    peer_dsn="DSN" in conn.extensions,
                    security=conn.security,
                )
                await conn.send(remaining[0], rec, self.load_body)
                done = rec.results()
                self.results.extend(done)
                if self.on_sent is not None and done:
                    recorded = self.on_sent(done)  # recorded now, not when the round ends
                remaining.popleft()
                rec = None
            if recorded is not None:
                await recorded
            await conn.quit()
            return None
        except _ClaimLost as exc:
            # Nothing of the message in progress is recorded: its recipients
            # have (or will have) a new owner, and the next hop has no copy.
            log.warning("delivery to %s stopped %s: the claim was lost", conn.target.host, exc)
            conn.abort()
            return None
        except _SessionFailed as exc:
            conn.abort()
            if rec is not None:
                rec.fill(exc.phase, exc.code, exc.text + exc.note, exc.enhanced)
                self.results.extend(rec.results())
                remaining.popleft()
            return self._fail(_Failure.of(exc, conn.target, conn.security.policy, conn.security))
        except Exception as exc:  # a bug must not lose results or escape
            log.exception("unexpected error delivering to %s", conn.target.host)
            conn.abort()
            text = f"internal error: {exc!r}"
            if rec is not None:
                rec.fill(c.SESSION, None, text)
                self.results.extend(rec.results())
                remaining.popleft()
            return self._fail(_Failure(c.SESSION, None, text, conn.target))
        except BaseException:  # cancelled: leave no socket behind
            conn.abort()
            raise

    def _defer_remaining(
        self,
        remaining: deque[OutboundMessage],
        failure: _Failure | None,
        started: datetime,
        t0: float,
    ) -> None:
        failure = failure or self.last_failure
        if failure is None:  # no target at all
            failure = _Failure(c.CONNECT, None, "no host to deliver to", _NoPeer())
        self.connection_error = failure.describe()
        security = failure.security or _Security(policy=failure.tls_policy)
        for msg in remaining:
            rec = _Recorder(msg, failure.target, started, t0, security=security)
            rec.fill(failure.phase, failure.code, failure.text, failure.enhanced)
            self.results.extend(rec.results())
        remaining.clear()


@dataclass(frozen=True)
class _NoPeer:
    host: str = ""
    ip: str = ""
    port: int = 0


async def _discard(conn: _Connection, *, polite: bool) -> None:
    """Give up a session that could not be set up: QUIT without waiting when
    the peer is still talking to us, else just drop it."""
    if polite:
        with contextlib.suppress(Exception):
            conn.writer.write(b"QUIT\r\n")
        await conn.close()
    else:
        conn.abort()


async def deliver(
    targets: Sequence[Peer],
    messages: Sequence[OutboundMessage],
    config: ClientConfig,
    *,
    still_owner: StillOwner | None = None,
    load_body: LoadBody | None = None,
    on_sent: OnSent | None = None,
) -> BatchResult:
    """Deliver ``messages`` to one destination, trying ``targets`` in order.

    ``still_owner()`` (cheap, synchronous) is asked before opening each
    connection, before each MAIL FROM and before each final dot; once it says
    False nothing more is sent: a transaction past 354 is dropped without its
    final dot (the connection is closed: the next hop delivers nothing), the
    messages not finished get no result at all and ``abandoned`` is set.

    ``load_body(msg)`` gives the bytes of a message whose ``data`` is None;
    it is awaited when that message is about to be sent (the bytes are
    needed for MAIL's SIZE and the SMTPUTF8 check) and the bytes are dropped
    when its transaction is over: at most one body per open connection. When
    it raises, that message is deferred (4.3.0) and the session goes on.

    ``on_sent(results)`` (cheap, synchronous) is called with a message's
    results as soon as its transaction is over, so the caller can record a
    delivery before the round ends; when it returns an awaitable, the
    connection awaits it before its next transaction (the outcome is durable
    first: a crash re-sends at most the message in flight on each
    connection). The returned ``BatchResult`` still holds every result.

    Steps:
    1. split the messages into balanced groups of at most
       ``max_messages_per_connection``, one group per connection;
    2. run up to ``max_connections`` connections at once, each taking the
       next group while groups remain and the round is still the owner
       (``_Batch.run_group``);
    3. return one result per recipient of every message attempted (of every
       message unless abandoned), whether any connection got a 2xx greeting,
       and the last connection error when some messages found no usable target.

    Never raises for network problems; cancellation propagates.
    """
    batch = _Batch(targets, config, still_owner, load_body, on_sent)
    groups = deque(_split_groups(messages, config.max_messages_per_connection))

    async def worker() -> None:
        while groups and batch.owner():
            await batch.run_group(groups.popleft())

    workers = min(max(1, config.max_connections), len(groups))
    if workers:
        await asyncio.gather(*(worker() for _ in range(workers)))
    return BatchResult(
        results=batch.results,
        connected=batch.connected,
        connection_error=batch.connection_error,
        host_failures=batch.host_failures,
        abandoned=batch.abandoned,
    )
