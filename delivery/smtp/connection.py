"""One outbound SMTP session on one connection: replies, EHLO, STARTTLS, a transaction.

``Connection`` reads capped replies (``MAX_REPLY_LINES``, ``MAX_REPLY_BYTES``,
``READ_LIMIT`` per line: a hostile peer costs bounded memory), and sends one
message with ``send``: the envelope is built without the peer
(``build_envelope``, below), then exchanged pipelined or in lock-step
(``_pipelined``, ``_lockstep``), then the body is sent (``_send_body``) and the
final reply closes the transaction. A session that cannot go on raises
``SessionFailed``; a round that lost its claim raises ``ClaimLost`` before
the final dot. ``ClientConfig`` (``delivery.smtp.clientconfig``) is the frozen
configuration every connection of a round shares. AUTH to the next hop is the
round's (``delivery.smtp.auth.authenticate``), once the connection is
secured. ``SessionCache`` keeps the sessions a delivery task's round ends
with for its next round (at the end of this module).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import ssl
import threading
import time
from collections.abc import Awaitable, Callable, Coroutine, Mapping
from dataclasses import dataclass
from typing import NamedTuple, TypeVar

from delivery.smtp import dane, mta_sts, outcome
from delivery.smtp.clientconfig import ClientConfig
from delivery.smtp.failure import ClaimLost, SessionFailed
from delivery.smtp.outcome import BAD_RECIPIENT, BAD_SENDER, Recorder, Refusal, Security
from delivery.smtp.tls import ENHANCED as TLS_ENHANCED
from delivery.smtp.tls import TLS_REQUIRED, TlsRequirement
from delivery.smtp.tlscontext import client_context, peer_chain, sni
from delivery.smtp.types import (
    OutboundMessage,
    OutboundRecipient,
    Peer,
)
from queues.lib import header_end

log = logging.getLogger(__name__)

CRLF = b"\r\n"
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
ONE_WRITE = 64 * 1024  # a body up to this size goes with its final dot in one write
# Enhanced code for a reply we could not parse or would not read (RFC 3463: 4.5.0, other).
PROTOCOL_ENHANCED = outcome.PROTOCOL_ERROR_ENHANCED
END_OF_DATA = "end of data"
# Next hops on this port speak TLS from the first byte (RFC 8314 "submissions").
IMPLICIT_TLS_PORT = 465
_LINE_END = re.compile(rb"\r\n|\r|\n")


# Gives the bytes of a message whose ``data`` is None, when it is about to be sent.
LoadBody = Callable[[OutboundMessage], Awaitable[bytes]]


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


class Reply(NamedTuple):
    code: int
    lines: list[str]

    @property
    def text(self) -> str:
        """The reply text after the code, lines joined by a space; enhanced
        codes repeated on continuation lines are dropped."""
        if len(self.lines) == 1:
            return self.lines[0]
        return " ".join([self.lines[0], *(outcome.strip_enhanced(x) for x in self.lines[1:])])


# --- the envelope of one message for this peer: its MAIL and RCPT lines ----------------
#
# Pure (no socket, no clock, no database), so every rule is table-tested
# without a peer (``tests/test_smtp_envelope.py``). What the peer offered
# (its EHLO keywords) decides the parameters:
#
# - MAIL: ``SIZE`` (SIZE), ``BODY`` (8BITMIME), ``SMTPUTF8`` (SMTPUTF8),
#   ``RET`` and ``ENVID`` (DSN, RFC 3461), each only when offered;
# - RCPT: ``NOTIFY`` and ``ORCPT`` (DSN), only when offered.
#
# Some messages are refused here, before a command goes out: a CR, LF or NUL
# in an address or parameter (it would smuggle a command), a message over the
# peer's SIZE, and one that needs SMTPUTF8 from a peer without it.

DATA_LINE = b"DATA\r\n"
# BODY values we pass on (RFC 6152); BINARYMIME would need CHUNKING.
_BODY_TYPES = ("7BIT", "8BITMIME")


@dataclass(frozen=True, slots=True)
class Envelope:
    """The commands of one transaction, each line with its CRLF."""

    mail: bytes
    # The recipients to send, in order, and their RCPT lines (same length).
    rcpts: tuple[OutboundRecipient, ...]
    rcpt_lines: tuple[bytes, ...]
    # Recipients never sent because of an unsafe value: ``BAD_RECIPIENT``.
    refused: tuple[OutboundRecipient, ...] = ()


def unsafe(value: str) -> bool:
    """A CR or LF (or NUL) inside an address or parameter would smuggle a command."""
    return "\r" in value or "\n" in value or "\0" in value


def sender_refusal(msg: OutboundMessage) -> Refusal | None:
    """``BAD_SENDER`` when the sender, RET or ENVID is unsafe. Needs no body,
    so the client checks it before reading one."""
    if unsafe(msg.mail_from) or unsafe(msg.envid) or unsafe(msg.ret):
        return BAD_SENDER
    return None


def size_limit(extensions: Mapping[str, str]) -> int:
    """The peer's SIZE limit in bytes; 0 when it declared none (or nonsense)."""
    value = extensions.get("SIZE", "")
    return int(value) if value.isdigit() else 0


def needs_smtputf8(msg: OutboundMessage, data: bytes) -> bool:
    """True when the message cannot go to a peer without SMTPUTF8: a non-ASCII
    envelope address, or a non-ASCII header in a message declared SMTPUTF8."""
    if not msg.mail_from.isascii():
        return True
    if any(not r.address.isascii() for r in msg.recipients):
        return True
    if msg.smtputf8:
        return not data[: header_end(data)].isascii()  # a copy of the header only
    return False


def build_envelope(
    msg: OutboundMessage, data: bytes, extensions: Mapping[str, str], host: str
) -> Envelope | Refusal:
    """The envelope of ``msg`` (body ``data``) for a peer named ``host`` that
    offered ``extensions`` (EHLO keywords in upper case → their parameters),
    or the refusal that decides the whole message without asking the peer.

    An envelope may have no recipient left to send (all refused): the
    message then needs no transaction at all.
    """
    refusal = sender_refusal(msg)
    if refusal is not None:
        return refusal
    limit = size_limit(extensions)
    if limit and len(data) > limit:
        text = f"message size {len(data)} exceeds size limit {limit} of {host}"
        return Refusal(outcome.MAIL, "5.3.4", text)
    utf8 = needs_smtputf8(msg, data)
    if utf8 and "SMTPUTF8" not in extensions:
        text = f"{host} does not support SMTPUTF8, which this message needs"
        return Refusal(outcome.MAIL, "5.6.7", text)
    mail = mail_line(msg, len(data), utf8 or msg.smtputf8, extensions)
    rcpts, lines, refused = rcpt_lines(msg.recipients, extensions)
    return Envelope(mail, rcpts, lines, refused)


def mail_line(
    msg: OutboundMessage, size: int, smtputf8: bool, extensions: Mapping[str, str]
) -> bytes:
    """``MAIL FROM:<...>`` with the parameters the peer offered. ``msg``'s
    values must be safe (``sender_refusal``)."""
    mail = "MAIL FROM:<" + msg.mail_from + ">"
    if "SIZE" in extensions:
        mail += f" SIZE={size}"
    body = msg.body_type.upper()
    if body in _BODY_TYPES and "8BITMIME" in extensions:
        mail += " BODY=" + body
    if smtputf8 and "SMTPUTF8" in extensions:
        mail += " SMTPUTF8"
    if "DSN" in extensions:
        if msg.ret:
            mail += " RET=" + msg.ret
        if msg.envid:
            mail += " ENVID=" + msg.envid
    return mail.encode() + CRLF


def rcpt_lines(
    recipients: list[OutboundRecipient], extensions: Mapping[str, str]
) -> tuple[tuple[OutboundRecipient, ...], tuple[bytes, ...], tuple[OutboundRecipient, ...]]:
    """(recipients to send, their ``RCPT TO:<...>`` lines, recipients refused
    for an unsafe address, NOTIFY or ORCPT)."""
    dsn = "DSN" in extensions
    sent: list[OutboundRecipient] = []
    lines: list[bytes] = []
    refused: list[OutboundRecipient] = []
    for rcpt in recipients:
        if unsafe(rcpt.address) or unsafe(rcpt.notify) or unsafe(rcpt.orcpt):
            refused.append(rcpt)
            continue
        line = "RCPT TO:<" + rcpt.address + ">"
        if dsn and rcpt.notify:
            line += " NOTIFY=" + rcpt.notify
        if dsn and rcpt.orcpt:
            line += " ORCPT=" + rcpt.orcpt
        sent.append(rcpt)
        lines.append(line.encode() + CRLF)
    return tuple(sent), tuple(lines), tuple(refused)


# --- one SMTP session -----------------------------------------------------------


class Connection:
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
        self.security = Security()
        # A transaction was left open (MAIL accepted, never finished by DATA).
        self.need_rset = False
        self.waiting_for = "greeting"
        # Asked before MAIL FROM and before the final dot: False once the round
        # lost its recipients (then nothing more goes on the wire).
        self.may_send: Callable[[], bool] = lambda: True
        # Messages sent over this session (at most max_messages_per_connection,
        # over all the rounds that take it from a SessionCache), and what a kept
        # session must share with a new one to stand for it (client._Batch).
        self.sent = 0
        self.session_key: tuple | None = None

    # Reading and writing --------------------------------------------------------

    async def _read_reply(self) -> Reply:
        """One reply, at most MAX_REPLY_LINES lines and MAX_REPLY_BYTES bytes
        (each line at most READ_LIMIT); past that, ``ProtocolError``."""
        lines: list[str] = []
        size = 0
        while True:
            try:
                line = await self.reader.readline()
            except ValueError as exc:  # LimitOverrunError: READ_LIMIT and no newline
                raise ProtocolError(f"reply line longer than {READ_LIMIT} bytes") from exc
            if not line.endswith(b"\n"):
                raise ConnectionResetError("connection closed by peer")
            code = line[:3]
            sep = line[3:4]
            if not code.isdigit() or sep not in (b" ", b"-", b"\r", b"\n"):
                raise ProtocolError(f"malformed reply {line[:80]!r}")
            size += len(line)
            if size > MAX_REPLY_BYTES:
                raise ProtocolError(f"reply longer than {MAX_REPLY_BYTES} bytes")
            lines.append(line[4:].rstrip(b"\r\n").decode("utf-8", "replace"))
            if sep != b"-":
                return Reply(int(code), lines)
            if len(lines) >= MAX_REPLY_LINES:
                raise ProtocolError(f"reply longer than {MAX_REPLY_LINES} lines")

    async def reply(self, waiting_for: str) -> Reply:
        self.waiting_for = waiting_for
        return await self._read_reply()

    async def command(self, line: bytes, waiting_for: str, phase: str) -> Reply:
        """Send one command and read its reply, within the command timeout."""
        try:
            async with asyncio.timeout(self.config.command_timeout):
                self.writer.write(line)
                await self.writer.drain()
                return await self.reply(waiting_for)
        except SessionFailed:
            raise
        except Exception as exc:  # noqa: BLE001 - mapped to a result below
            raise self.lost(exc, phase, self.config.command_timeout) from exc

    def lost(self, exc: BaseException, phase: str, timeout: float) -> SessionFailed:
        """The failure for an exception raised while talking to the peer."""
        if isinstance(exc, TimeoutError):
            text = f"timeout after {timeout:g}s waiting for reply to {self.waiting_for}"
        elif isinstance(exc, ProtocolError):
            text = f"protocol error after {self.waiting_for}: {exc}"
        elif isinstance(exc, ssl.SSLError):
            text = f"TLS error after {self.waiting_for}: {exc}"
        else:
            why = str(exc) or type(exc).__name__
            text = f"lost connection while waiting for reply to {self.waiting_for}: {why}"
        # The peer may have taken the message before the reply was lost.
        note = " (the message may be delivered twice)" if self.waiting_for == END_OF_DATA else ""
        if isinstance(exc, ProtocolError):
            # We close the connection, not the peer: no Exim name fits.
            return SessionFailed(phase, None, text, note, "", PROTOCOL_ENHANCED)
        error = "timeout" if isinstance(exc, TimeoutError) else "lost_connection"
        return SessionFailed(phase, None, text, note, error)

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
        raise SessionFailed(phase, r.code, r.text)

    async def starttls(self, context: ssl.SSLContext | None = None) -> bool:
        """STARTTLS and a fresh EHLO. Returns False when the peer declined
        (the session goes on in cleartext); raises when TLS broke the session."""
        r = await self.command(b"STARTTLS\r\n", "STARTTLS", outcome.STARTTLS)
        if r.code in outcome.CONNECTION_CODES:
            raise SessionFailed(outcome.STARTTLS, r.code, r.text)
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
            raise SessionFailed(
                outcome.STARTTLS, None, "data after the STARTTLS reply (injection?)"
            )
        self.waiting_for = "TLS handshake"
        try:
            async with asyncio.timeout(self.config.command_timeout):
                await self.writer.start_tls(
                    context or client_context(), server_hostname=sni(self.target.host)
                )
        except Exception as exc:  # noqa: BLE001 - any handshake failure
            why = str(exc) or type(exc).__name__
            if isinstance(exc, TimeoutError):
                why = f"timeout after {self.config.command_timeout:g}s"
            raise SessionFailed(outcome.STARTTLS, None, f"TLS handshake failed: {why}") from exc
        self.tls_established()
        await self.hello(outcome.EHLO)
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
            chain = peer_chain(self.writer.get_extra_info("ssl_object"))
            if dane.match(req.tlsa, chain) is None:
                raise SessionFailed(
                    outcome.STARTTLS,
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
            chain = peer_chain(self.writer.get_extra_info("ssl_object"))
            problem = mta_sts.check_chain(chain, self.target.host, req.ca_file)
            self.security.verified = "none" if problem else "mta-sts"
            self.security.report = problem
        else:
            self.security.verified = "none"

    # Sending one message ----------------------------------------------------------

    async def rset(self) -> None:
        r = await self.command(b"RSET\r\n", "RSET", outcome.SESSION)
        if r.code // 100 != 2:
            raise SessionFailed(outcome.SESSION, r.code, r.text)
        self.need_rset = False

    async def send(
        self, msg: OutboundMessage, rec: Recorder, load_body: LoadBody | None = None
    ) -> None:
        """Send one message; put a result for each recipient in ``rec``.

        Raises ``SessionFailed`` when the session breaks (no reply or 421):
        results already in ``rec`` stand, the caller fills in the rest.

        Steps:
        1. refuse an unsafe sender or MAIL parameter (5.1.7) before reading
           the body; read it (``load_body`` when ``msg.data`` is None; a
           failure defers the message, 4.3.0);
        2. build the envelope (``build_envelope``), which may refuse
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
                rec.set_many(accepted, outcome.DATA, reply.code, reply.text)
            return

        self.waiting_for = END_OF_DATA
        try:
            async with asyncio.timeout(self.config.data_timeout):
                await self._send_body(data if accepted else None)
                del data  # the final reply may take minutes: hold no body while waiting
                reply = await self.reply(END_OF_DATA)
        except ClaimLost:
            raise
        except Exception as exc:  # noqa: BLE001
            raise self.lost(exc, outcome.SESSION, self.config.data_timeout) from exc
        self._end_transaction(reply, accepted, rec)

    async def _read_body(
        self, msg: OutboundMessage, rec: Recorder, load_body: LoadBody | None
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
            rec.refuse(msg.recipients, Refusal(outcome.MAIL, "4.3.0", text))
            return None

    async def _exchange(
        self, envelope: Envelope, rec: Recorder
    ) -> tuple[Reply | None, list[OutboundRecipient]]:
        """MAIL, RCPT and DATA, all within one command timeout. Returns the
        reply to DATA (None when DATA was not sent) and the recipients accepted."""
        if not self.may_send():
            raise ClaimLost("before MAIL FROM")
        self.waiting_for = "MAIL FROM"
        try:
            async with asyncio.timeout(self.config.command_timeout):
                if "PIPELINING" in self.extensions:
                    return await self._pipelined(envelope, rec)
                return await self._lockstep(envelope, rec)
        except SessionFailed:
            raise
        except Exception as exc:  # noqa: BLE001 - mapped to a result by lost()
            raise self.lost(exc, outcome.SESSION, self.config.command_timeout) from exc

    async def _pipelined(
        self, envelope: Envelope, rec: Recorder
    ) -> tuple[Reply, list[OutboundRecipient]]:
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
                await self._checked_reply("RCPT TO", outcome.RCPT)
            elif await self._rcpt_reply(rcpt, rec):
                accepted.append(rcpt)
        return await self._checked_reply("DATA", outcome.DATA), accepted

    async def _lockstep(
        self, envelope: Envelope, rec: Recorder
    ) -> tuple[Reply | None, list[OutboundRecipient]]:
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
        return await self._checked_reply("DATA", outcome.DATA), accepted

    async def _checked_reply(self, waiting_for: str, phase: str) -> Reply:
        """The next reply; a 421 ends the session (``SessionFailed``)."""
        r = await self.reply(waiting_for)
        if r.code in outcome.CONNECTION_CODES:
            raise SessionFailed(phase, r.code, r.text)
        return r

    async def _mail_reply(self, envelope: Envelope, rec: Recorder) -> bool:
        """Whether MAIL was accepted; if not, its reply goes to every recipient sent."""
        r = await self._checked_reply("MAIL FROM", outcome.MAIL)
        if r.code // 100 == 2:
            return True
        rec.set_many(envelope.rcpts, outcome.MAIL, r.code, r.text)
        return False

    async def _rcpt_reply(self, rcpt: OutboundRecipient, rec: Recorder) -> bool:
        """Whether ``rcpt`` was accepted; if not, it gets the reply."""
        r = await self._checked_reply("RCPT TO", outcome.RCPT)
        if r.code // 100 == 2:
            return True
        rec.set(rcpt, outcome.RCPT, r.code, r.text)
        return False

    async def _send_body(self, data: bytes | None) -> None:
        """Write the dot-stuffed body in WRITE_CHUNK slices (views: the transport
        copies at most one slice the socket has not taken), then the final dot; a
        body of ONE_WRITE bytes or less goes in one write with its dot (one send).

        ``data`` None writes the lone dot: the peer said 354 with no recipient
        accepted (it should not, RFC 2920 §3.1) and the empty transaction ends."""
        wire = b"" if data is None else stuffed(data)
        if len(wire) > ONE_WRITE:
            with memoryview(wire) as view:
                for start in range(0, len(view), WRITE_CHUNK):
                    self.writer.write(view[start : start + WRITE_CHUNK])
                    await self.writer.drain()
        if not self.may_send():
            raise ClaimLost("before the final dot")
        self.writer.write(END_MARK if len(wire) > ONE_WRITE else wire + END_MARK)
        await self.writer.drain()

    def _end_transaction(
        self, reply: Reply, accepted: list[OutboundRecipient], rec: Recorder
    ) -> None:
        """The reply to the final dot closes the transaction (no RSET needed);
        it goes to the accepted recipients, unless it is a 421."""
        self.need_rset = False
        if reply.code in outcome.CONNECTION_CODES:
            raise SessionFailed(outcome.DATA, reply.code, reply.text)
        if accepted:
            rec.set_many(accepted, outcome.DATA, reply.code, reply.text)

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


class ProtocolError(Exception):
    pass


async def discard(conn: Connection, *, polite: bool) -> None:
    """Give up a session that could not be set up: QUIT without waiting when
    the peer is still talking to us, else just drop it."""
    if polite:
        with contextlib.suppress(Exception):
            conn.writer.write(b"QUIT\r\n")
        await conn.close()
    else:
        conn.abort()


# --- sessions kept between a delivery task's rounds ------------------------------

# How long an idle session is kept for the next round (Postfix's
# smtp_connection_cache_time_limit), and how long its liveness RSET may take
# (Postfix's smtp_rset_timeout).
KEEP_IDLE = 2.0
RSET_TIMEOUT = 20.0

T = TypeVar("T")


class SessionCache:
    """Postfix's connection cache, for one delivery task: a session that
    finished its group is kept (``keep``) instead of QUIT, and a later round
    of the task to the same target, under the same TLS requirement, AUTH
    account and source address, goes on over it (``take``) instead of
    connecting, greeting, EHLO, STARTTLS and AUTH again (bench/README.md
    "Session 18": a connection cost the client 0.6 ms of CPU, and the next
    hop a TCP and a TLS handshake).

    A kept session is idle: no transaction is open on it, so a task that
    loses its claim has nothing in flight there (``close(polite=False)``
    drops it without a word). One session still carries at most
    ``max_messages_per_connection`` messages over all its rounds; one idle
    for ``KEEP_IDLE`` seconds is QUIT when the next round starts or a
    connection looks for one; one is taken only after an RSET
    answered 250, so a peer that closed it meanwhile costs a new connection,
    never a message's try. A session belongs to an event loop: the cache runs
    one in a thread of its own for the task's life, and the rounds run their
    exchange there (``run``).
    """

    def __init__(self, keep_idle: float = KEEP_IDLE) -> None:
        self.keep_idle = keep_idle
        self._idle: dict[tuple, list[tuple[Connection, float]]] = {}
        self._loop: asyncio.AbstractEventLoop | None = None  # from the first round on
        self._thread: threading.Thread | None = None

    def run(self, coro: Coroutine[object, object, T]) -> T:
        """Run ``coro`` on the cache's loop; blocks this thread until it ends,
        and cancels what it left running then (as ``asyncio.run`` does)."""
        if self._loop is None:
            self._loop = asyncio.new_event_loop()
            self._thread = threading.Thread(
                target=self._loop.run_forever, name="smtp-sessions", daemon=True
            )
            self._thread.start()
        return asyncio.run_coroutine_threadsafe(self._alone(coro), self._loop).result()

    async def _alone(self, coro: Coroutine[object, object, T]) -> T:
        """Let go of the sessions idle too long (those of every target), run
        ``coro``, then cancel what it left running."""
        await self._let_go(time.monotonic() - self.keep_idle)
        try:
            return await coro
        finally:
            left = [task for task in asyncio.all_tasks() if task is not asyncio.current_task()]
            for task in left:
                task.cancel()
            await asyncio.gather(*left, return_exceptions=True)

    async def _let_go(self, idle_since: float) -> None:
        """QUIT, without waiting for the reply, the sessions kept before ``idle_since``."""
        stale = []
        for kept in self._idle.values():
            stale += [entry for entry in kept if entry[1] < idle_since]
            kept[:] = [entry for entry in kept if entry[1] >= idle_since]
        await _discard_all([conn for conn, _since in stale])

    def keep(self, conn: Connection) -> bool:
        """Keep ``conn`` (idle, after its group) when it may carry more."""
        if conn.session_key is None or conn.sent >= conn.config.max_messages_per_connection:
            return False
        self._idle.setdefault(conn.session_key, []).append((conn, time.monotonic()))
        return True

    async def take(self, key: tuple, count: int, limit: int) -> Connection | None:
        """A kept session for ``key`` that may carry ``count`` more messages
        (``limit`` in all) and answers an RSET; those idle too long, dead, or
        without room for ``count`` are closed."""
        await self._let_go(time.monotonic() - self.keep_idle)
        kept = self._idle.get(key, [])
        # One without room for this group would only idle beside the new
        # connection the group opens, past the link's connection limit.
        full = [entry for entry in kept if entry[0].sent + count > limit]
        for entry in full:
            kept.remove(entry)
        await _discard_all([conn for conn, _since in full])
        while True:
            # Taken off the list before any await: the round's other
            # connections look at the same list meanwhile.
            entry = next((e for e in kept if e[0].sent + count <= limit), None)
            if entry is None:
                return None
            kept.remove(entry)
            if await _answers(entry[0]):
                return entry[0]

    def close(self, polite: bool = True) -> None:
        """QUIT (``polite``) or drop every kept session, and stop the loop
        (once: a closed cache stays closed)."""
        if self._loop is None or self._thread is None or self._loop.is_closed():
            return

        async def drop() -> None:
            kept = [conn for entries in self._idle.values() for conn, _ in entries]
            self._idle.clear()
            if polite:
                await asyncio.gather(*(conn.quit() for conn in kept))
            else:
                for conn in kept:
                    conn.abort()

        try:
            # Not through run(): letting the idle ones go first would QUIT them.
            asyncio.run_coroutine_threadsafe(drop(), self._loop).result()
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join()
            self._loop.close()


async def _discard_all(conns: list[Connection]) -> None:
    """QUIT without waiting, side by side: a peer slow to close costs one ``close`` (1 s)."""
    await asyncio.gather(*(discard(conn, polite=True) for conn in conns))


async def _answers(conn: Connection) -> bool:
    """RSET on a kept session: 250 within ``RSET_TIMEOUT``, else it is dropped."""
    try:
        async with asyncio.timeout(RSET_TIMEOUT):
            await conn.rset()
        return True
    except Exception:  # noqa: BLE001 - closed by the peer, a 421, silence
        conn.abort()
        return False
