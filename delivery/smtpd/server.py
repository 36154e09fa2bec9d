"""The inbound SMTP server: aiosmtpd with our policy, and 250 only after the commit.

One ``InboundServer`` per process owns the listeners, a small pool of
database threads (``dbthreads.DatabaseExecutor``: ``message_accept`` is
synchronous Django ORM) and the categorizer doorbell (``doorbell.CoalescedBell``).
Each connection is an ``InboundSMTP`` protocol, which reaches aiosmtpd's
private members only through ``aiosmtpd_adapter.AiosmtpdSession``; the DATA
work lives in ``RelayHandler``.

Hot path per message: the header checked against its limits, the message
prepared (ids, headers, DKIM signature: ``prepare_message``) in a database
thread, then handed to the group committer (``groupcommit.GroupCommitter``:
the messages of every session waiting at that moment in one statement and one
transaction, in a committer thread), the reply once its transaction
committed, then a coalesced ring of the categorizer. The other database calls
(AUTH, account rates) run in the database threads too.

Back pressure: with a ``Monitor`` (delivery.backpressure), the server runs it
while it listens, counts the messages it holds uncommitted (the version
buckets), and asks it at every MAIL FROM whether to tarpit (an
``asyncio.sleep`` in that session only) or refuse with ``452 4.3.1``.
Connections, EHLO, RSET, NOOP and QUIT are never held back.

Limits (Postfix's anvil and smtpd_* limits): connections in total and per
client (``InboundServer.admit``; 421 and close, the listener goes on), a
session's lifetime, a budget of commands that move no message, and a DATA
deadline that grows with the bytes received (``DataDeadline``). A message's
data is held once, in a bytearray, while it is read and stored.

Submission (issue #11): besides the relay listeners (``smtp``), a server may
listen for ``submission`` (587: STARTTLS required before AUTH and MAIL, and
AUTH before MAIL) and ``submissions`` (465: implicit TLS, RFC 8314). AUTH
PLAIN and LOGIN are offered inside TLS on every listener; the password check
(``queues.services.accounts``) runs in the database threads. An
authenticated client relays to any domain from the senders its account
allows, and back pressure treats it as trusted. Certificates are re-read when
their files change (``TlsCertificate``), checked on each new connection.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import functools
import ipaddress
import logging
import os
import re
import resource
import ssl
from collections import Counter, defaultdict
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from aiosmtpd.smtp import SMTP, Envelope, Session, syntax
from django.conf import settings
from django.core.exceptions import ImproperlyConfigured
from django.db import connection

from delivery.backpressure.samplers import InFlight
from delivery.outage import OUTAGE, first_line, is_unavailable
from delivery.smtpd import authlimit, policy, replies
from delivery.smtpd.aiosmtpd_adapter import AiosmtpdSession
from delivery.smtpd.authlimit import AuthLimiter
from delivery.smtpd.dbthreads import DatabaseExecutor
from delivery.smtpd.doorbell import CoalescedBell
from delivery.smtpd.groupcommit import DEFAULT_COMMIT_THREADS, GroupCommitter
from queues import counters
from queues.accept import (
    IncomingEnvelope,
    IncomingRecipient,
    PreparedMessage,
    prepare_message,
    prepared_accept,
    prepared_accept_many,
    printable,
)
from queues.headers import author_addresses, header_end, header_shape_refusal
from queues.models import MessageSource
from queues.services import accounts

if TYPE_CHECKING:
    from delivery.backpressure.monitor import Monitor

log = logging.getLogger(__name__)

DEFAULT_DB_THREADS = 8
MAX_RECEIVED_HEADERS = 100  # more is a routing loop (RFC 5321 6.3)
COMMAND_LINE_LIMIT = 512  # RFC 5321 4.5.3.1.4
# MAIL/RCPT lines grow with their parameters: ORCPT alone may be 500 characters
# (RFC 3461 4.2), ENVID 100; aiosmtpd's line reader caps every line at 1001.
PARAMETER_LINE_LIMIT = 1000
# A database thread reconnects after storing a message this large (see _store).
RELEASE_CONNECTION_ABOVE = 8 * 1024 * 1024

# Listener kinds: the relay port, submission with STARTTLS (587), implicit TLS (465).
SMTP_LISTENER = "smtp"
SUBMISSION = "submission"
SUBMISSIONS = "submissions"
AUTH_MECHANISMS = ("PLAIN", "LOGIN")

_RECEIVED = re.compile(rb"^received[ \t]*:", re.IGNORECASE | re.MULTILINE)


# ----------------------------------------------------------------- configuration


@dataclass(frozen=True)
class InboundConfig:
    """What the server reads from settings, once, when it starts."""

    hostname: str
    accepted_domains: frozenset[str]
    relay_networks: tuple[policy.IPNetwork, ...]
    max_message_size: int
    max_recipients: int
    timeout: float
    # The certificate for STARTTLS and implicit TLS, re-read when its files change.
    tls: TlsCertificate | None = None
    # Limits (issue #9; Postfix's anvil and smtpd_* limits are the reference). 0 = no limit.
    max_connections: int = 1000
    max_connections_per_client: int = 50  # relay networks are exempt
    max_session_time: float = 3600.0
    junk_command_limit: int = 100
    min_data_rate: int = 500  # bytes/second during DATA
    # AUTH failures within AUTH_FAILURE_WINDOW (authlimit, shared in the cache); 0 = no limit
    max_auth_failures: int = 5  # per client address
    max_auth_failures_per_user: int = 10  # per username, from any address
    processes: int = 1  # runsmtp processes: each one's share of the limits when the cache is down
    # The message header (Postfix's header_size_limit, per field; a count of fields). 0 = none.
    max_header_fields: int = 1000
    max_header_size: int = 102400

    @classmethod
    def from_settings(cls) -> InboundConfig:
        return cls(
            hostname=settings.MAILRELAY_HOSTNAME,
            accepted_domains=frozenset(
                policy.domain_key(d) for d in settings.MAILRELAY_ACCEPTED_DOMAINS
            ),
            relay_networks=tuple(settings.MAILRELAY_RELAY_NETWORKS),
            max_message_size=settings.MAILRELAY_MAX_MESSAGE_SIZE,
            max_recipients=settings.MAILRELAY_MAX_RECIPIENTS,
            timeout=settings.MAILRELAY_SMTP_SERVER_TIMEOUT.total_seconds(),
            tls=tls_certificate(settings.MAILRELAY_TLS_CERT_FILE, settings.MAILRELAY_TLS_KEY_FILE),
            max_connections=settings.MAILRELAY_SMTP_MAX_CONNECTIONS,
            max_connections_per_client=settings.MAILRELAY_SMTP_MAX_CONNECTIONS_PER_CLIENT,
            max_session_time=settings.MAILRELAY_SMTP_MAX_SESSION_TIME.total_seconds(),
            junk_command_limit=settings.MAILRELAY_SMTP_JUNK_COMMAND_LIMIT,
            min_data_rate=settings.MAILRELAY_SMTP_MIN_DATA_RATE,
            max_auth_failures=settings.MAILRELAY_AUTH_MAX_FAILURES,
            max_auth_failures_per_user=settings.MAILRELAY_AUTH_MAX_FAILURES_PER_USER,
            max_header_fields=settings.MAILRELAY_SMTP_MAX_HEADER_FIELDS,
            max_header_size=settings.MAILRELAY_SMTP_MAX_HEADER_SIZE,
        )


def tls_context(cert_file: str, key_file: str) -> ssl.SSLContext | None:
    """A server context for these files, or None when no certificate is configured."""
    if not cert_file and not key_file:
        return None
    if not (cert_file and key_file):
        raise ImproperlyConfigured(
            "MAILRELAY_TLS_CERT_FILE and MAILRELAY_TLS_KEY_FILE must be set together"
        )
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.load_cert_chain(cert_file, key_file)
    return context


def tls_certificate(cert_file: str, key_file: str) -> TlsCertificate | None:
    """The server's certificate, or None when none is configured (no STARTTLS, no AUTH)."""
    if not cert_file and not key_file:
        return None
    return TlsCertificate(cert_file, key_file)


class TlsCertificate:
    """The certificate and key files, re-read when they change (renewals need no restart).

    ``current()`` runs once per new connection: two ``stat`` calls, and a new
    SSLContext only when a file's mtime, size or inode changed. A renewal
    caught half-written (the key not matching the certificate yet) keeps the
    previous context until the files load together.
    """

    def __init__(self, cert_file: str, key_file: str) -> None:
        self.cert_file = cert_file
        self.key_file = key_file
        self.loads = 0  # contexts built: 1 at start, +1 per renewal picked up
        self._stamp: tuple[tuple[int, int, int], ...] | None = None
        self._failed_stamp: tuple[tuple[int, int, int], ...] | None = None
        context = tls_context(cert_file, key_file)  # fails at start on bad files
        assert context is not None
        self._context = context
        self._stamp = self._stat()
        self.loads = 1

    def _stat(self) -> tuple[tuple[int, int, int], ...]:
        stats = (os.stat(self.cert_file), os.stat(self.key_file))
        return tuple((st.st_mtime_ns, st.st_size, st.st_ino) for st in stats)

    def current(self) -> ssl.SSLContext:
        """The context for a new connection, rebuilt if the files changed since."""
        try:
            stamp = self._stat()
        except OSError as exc:
            log.warning("TLS certificate files: %s; keeping the loaded certificate", exc)
            return self._context
        if stamp == self._stamp or stamp == self._failed_stamp:
            return self._context
        try:
            context = tls_context(self.cert_file, self.key_file)
        except (OSError, ssl.SSLError, ValueError) as exc:
            self._failed_stamp = stamp  # not retried until the files change again
            log.warning("TLS certificate files changed but do not load (%s); keeping the old", exc)
            return self._context
        assert context is not None
        self._context, self._stamp, self.loads = context, stamp, self.loads + 1
        log.info("TLS certificate re-read from %s", self.cert_file)
        return context

    def listener_context(self) -> ssl.SSLContext:
        """The context of an implicit-TLS listener (asyncio fixes it at listen time).

        Its SNI callback, which OpenSSL calls on every ClientHello (with None
        when the client sends no name), switches the connection to
        ``current()``: so a renewal is picked up by the next handshake.
        """
        context = tls_context(self.cert_file, self.key_file)
        assert context is not None

        def switch(ssl_object: ssl.SSLObject, _name: str | None, _ctx: ssl.SSLContext) -> None:
            ssl_object.context = self.current()

        context.sni_callback = switch  # type: ignore[assignment]
        return context


def parse_listen(text: str) -> tuple[str, int]:
    """``127.0.0.1:2525`` → ("127.0.0.1", 2525); ``[::1]:25``; ``*:25`` or ``:25`` = all."""
    text = text.strip()
    if text.startswith("["):
        host, sep, port = text[1:].partition("]:")
    else:
        host, sep, port = text.rpartition(":")
        if ":" in host:
            raise ValueError(f"{text!r}: write an IPv6 address as [addr]:port")
    if not sep or not port.isdigit() or int(port) > 65535:
        raise ValueError(f"{text!r} is not host:port (e.g. 127.0.0.1:2525 or [::1]:2525)")
    return ("" if host in ("", "*") else host), int(port)


def format_address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def client_key(ip: policy.IPAddress | None) -> str:
    """What the per-client connection limit counts: an IPv4 address, an IPv6 /64.

    One IPv6 host usually holds a whole /64, so counting addresses would not
    limit it at all.
    """
    if ip is None:
        return "unknown"
    if isinstance(ip, ipaddress.IPv6Address):
        if ip.ipv4_mapped is not None:
            return str(ip.ipv4_mapped)
        return str(ipaddress.ip_network(f"{ip}/64", strict=False))
    return str(ip)


FILE_LIMIT_SPARE = 256  # descriptors besides client sockets: listeners, database, logs, spool


def raise_file_limit(connections: int) -> tuple[int, int]:
    """Raise the soft RLIMIT_NOFILE towards the hard limit so ``connections`` fit.

    Returns (soft, needed). A soft limit below ``needed`` (a low hard limit)
    only means EMFILE past it: asyncio then pauses accepting for a second and
    resumes, and the sessions already open go on.
    """
    needed = connections + FILE_LIMIT_SPARE
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = needed if hard == resource.RLIM_INFINITY else min(needed, hard)
    if soft != resource.RLIM_INFINITY and soft < target:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        soft = target
    return soft, needed


# ----------------------------------------------------------------- committing


def _store(prepared: PreparedMessage, data: bytes | bytearray) -> str:
    """Runs in a committer thread: commit the prepared message, return its queue id."""
    try:
        qid = prepared_accept(prepared).qid
        if len(data) >= RELEASE_CONNECTION_ABOVE:
            # libpq's send buffer grew to the message's size and is only freed
            # with the connection: without this, each database thread would keep
            # the size of the largest message it ever stored.
            connection.close()
        return qid
    except BaseException:
        # After a failed COMMIT or a lost server the connection is broken or in
        # an unknown state: drop it so the next message on this thread reconnects.
        try:
            connection.close()
        except Exception:  # noqa: BLE001 - closing a broken connection may fail too
            log.debug("closing the failed database connection failed", exc_info=True)
        raise


def _store_batch(batch: Sequence[tuple[PreparedMessage, bytes | bytearray]]) -> list[object]:
    """Runs in a committer thread: the queue id of each message committed, or its exception.

    The messages come prepared (ids, headers, DKIM signature: ``_prepare``,
    in the sessions' database threads), so a batch costs its inserts only.
    One message takes ``_store`` (``message_accept``'s path); several are one
    group commit (``prepared_accept_many``), which stores a failed batch's
    messages one by one so each gets its own answer.
    """
    if len(batch) == 1:
        try:
            return [_store(*batch[0])]
        except Exception as exc:  # noqa: BLE001 - this message's session says 451
            return [exc]
    stored = prepared_accept_many([prepared for prepared, _data in batch])
    return [result if isinstance(result, Exception) else result.qid for result in stored]


def _in_thread(call: Callable[[], object]) -> object:
    """Runs in a database thread: one call; a failed connection is dropped (as in _store)."""
    try:
        return call()
    except BaseException:
        try:
            connection.close()
        except Exception:  # noqa: BLE001 - closing a broken connection may fail too
            log.debug("closing the failed database connection failed", exc_info=True)
        raise


# ----------------------------------------------------------------- the SMTP session


class RelayEnvelope(Envelope):
    """aiosmtpd's envelope, plus the parsed parameters and our recipient rows."""

    def __init__(self) -> None:
        super().__init__()
        self.started = False  # MAIL accepted (mail_from is "" for the null sender)
        self.params = policy.MailParams()
        self.recipients: list[IncomingRecipient] = []


def has_bare_line_ending(data: bytes) -> bool:
    """Any CR or LF that is not part of a CRLF pair (SMTP smuggling, CVE-2023-51764)."""
    crlf = data.count(b"\r\n")
    return data.count(b"\r") != crlf or data.count(b"\n") != crlf


def received_count(data: bytes | bytearray) -> int:
    # Cheaper than queues.headers.inspect_headers, which message_accept runs anyway;
    # counted in place (no copy of the header block, which may be the whole message).
    return sum(1 for _ in _RECEIVED.finditer(data, 0, header_end(data)))


def header_limit_refusal(data: bytes | bytearray, config: InboundConfig) -> str | None:
    """552 5.3.4 for a header of more fields, or a longer field, than configured:
    what every later step (parsing, DKIM signing) costs is bounded by them."""
    excess = header_shape_refusal(data, config.max_header_fields, config.max_header_size)
    if excess is None:
        return None
    kind, limit = excess
    reply = replies.TOO_MANY_HEADER_FIELDS if kind == "fields" else replies.HEADER_FIELD_TOO_LONG
    return reply.format(limit=limit)


def header_sender_refusal(grant: accounts.Grant, data: bytes | bytearray) -> str | None:
    """550 5.7.1 when a From or Sender address of the header is not one the
    account may use (as MAIL FROM is checked): signed, it would pass DKIM and
    DMARC as that address's domain. None when every one is allowed."""
    for field, address in author_addresses(data):
        if not grant.may_send_as(address):
            return replies.HEADER_SENDER_NOT_ALLOWED.format(
                address=printable(address)[:300], field=field, username=grant.username
            )
    return None


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


def decode_base64(text: str) -> bytes | None:
    """An AUTH response ("=" is the empty one, RFC 4954 4), or None if not base64."""
    text = text.strip()
    if text == "=":
        return b""
    try:
        return base64.b64decode(text.encode("ascii"), validate=True)
    except (binascii.Error, UnicodeEncodeError, ValueError):
        return None


def plain_credentials(response: bytes) -> tuple[str, str] | None:
    """(username, password) from a PLAIN response (RFC 4616), or None if malformed.

    An authorization identity other than the user's own is refused later (as
    a wrong password): mailrelay has no proxy authorization.
    """
    parts = response.split(b"\x00")
    if len(parts) != 3:
        return None
    authzid, authcid, password = (part.decode("utf-8", "replace") for part in parts)
    if authzid and authzid != authcid:
        return authcid, ""  # never matches: no account has an empty password
    return authcid, password


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


class InboundSMTP(AiosmtpdSession):
    """One client connection (aiosmtpd's private members only through AiosmtpdSession)."""

    # aiosmtpd sizes its stream reader with this. Commands are still held to
    # command_size_limits; message data is read in large blocks (smtp_DATA),
    # so let the reader buffer up to 64 KiB before it pauses the socket.
    line_length_limit = 65536

    def __init__(
        self, server: InboundServer, handler: RelayHandler, kind: str = SMTP_LISTENER
    ) -> None:
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
            self.write_raw(replies.TIMEOUT.encode() + b"\r\n")

    def shutdown(self, reply: str = replies.SHUTTING_DOWN) -> None:
        """Say 421 and close, but only after the reply to a message being committed."""
        if self.storing:
            self._close_after_reply = reply
        else:
            self._goodbye(reply)

    def _session_expired(self) -> None:
        log.info("%s: session time limit reached", self.client_ip)
        self.shutdown(replies.SESSION_TOO_LONG)

    def count_junk(self) -> bool:
        """One more command that moves no message; True (and 421, closed) past the limit."""
        self.junk_commands += 1
        limit = self.config.junk_command_limit
        if limit and self.junk_commands > limit:
            log.info("%s: more than %d junk commands; closing", self.client_ip, limit)
            self._goodbye(replies.TOO_MANY_JUNK_COMMANDS)
            return True
        return False

    async def bad_command(self, reply: str) -> None:
        """A malformed MAIL or RCPT: its error reply, but it counts toward the junk
        command limit like a command that moves no message (421 and closed past it)."""
        if not self.count_junk():
            await self.push(reply)

    def _goodbye(self, reply: str = replies.SHUTTING_DOWN) -> None:
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
            status = replies.enhance(status)
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
            await self._push_lines([replies.HELO_SYNTAX])
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
            await self._push_lines([replies.EHLO_SYNTAX])
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
            await self.push(replies.NESTED_MAIL)
            return
        if self.kind == SUBMISSION and not self.tls_active:
            await self.push(replies.STARTTLS_FIRST)
            return
        if self.kind != SMTP_LISTENER and self.grant is None:
            await self.push(replies.AUTH_REQUIRED)  # RFC 6409 4.1: submission needs AUTH
            return
        rest = command_argument("FROM:", arg or "")
        if rest is None:
            await self.bad_command(replies.MAIL_SYNTAX)
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
        await self.push(replies.SENDER_OK)

    @syntax("RCPT TO: <address>", extended=" [SP <mail-parameters>]")
    async def smtp_RCPT(self, arg: str | None) -> None:
        if await self.check_helo_needed():
            return
        assert self.session is not None
        envelope = self.envelope
        assert isinstance(envelope, RelayEnvelope)
        if not envelope.started:
            await self.push(replies.NEED_MAIL)
            return
        rest = command_argument("TO:", arg or "")
        if rest is None:
            await self.bad_command(replies.RCPT_SYNTAX)
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
            await self.push(replies.TOO_MANY_RECIPIENTS)
            return
        envelope.recipients.append(
            IncomingRecipient(recipient.address, orcpt=params.orcpt, notify=params.notify)
        )
        envelope.rcpt_tos.append(recipient.address)
        await self.push(replies.RECIPIENT_OK)

    @syntax("DATA")
    async def smtp_DATA(self, arg: str | None) -> None:
        if await self.check_helo_needed():
            return
        envelope = self.envelope
        assert isinstance(envelope, RelayEnvelope)
        if not envelope.started:
            await self.push(replies.NEED_MAIL)
            return
        if not envelope.recipients:
            await self.push(replies.NO_VALID_RECIPIENTS)
            return
        if arg:
            await self.push(replies.DATA_SYNTAX)
            return
        await self.push(replies.START_DATA)
        data = await self._read_data()
        if data is None:
            self.end_transaction()
            await self.push(replies.MESSAGE_TOO_BIG)
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
        self._goodbye(replies.DATA_TOO_SLOW)

    async def _account_refusal(self, grant: accounts.Grant, address: str) -> str | None:
        """The reply refusing an authenticated MAIL FROM, or None: its sender, its rate."""
        if not grant.may_send_as(address):
            log.info("%s: account %s may not send as <%s>", self.client_ip, grant.username, address)
            return replies.SENDER_NOT_ALLOWED.format(address=address, username=grant.username)
        if grant.max_messages_per_hour:
            try:
                limited = await self.server.in_database(accounts.rate_limited, grant)
            except Exception:
                log.exception("could not check the rate of account %s", grant.username)
                return replies.INTERNAL_ERROR
            if limited:
                log.info("%s: account %s over its rate", self.client_ip, grant.username)
                return replies.ACCOUNT_RATE_LIMITED.format(
                    username=grant.username, limit=grant.max_messages_per_hour
                )
        return None

    # --- AUTH (RFC 4954; PLAIN RFC 4616, LOGIN)

    @syntax("AUTH <mechanism> [initial-response]")
    async def smtp_AUTH(self, arg: str | None) -> None:
        if await self.check_helo_needed("EHLO"):
            return
        assert self.session is not None
        refusal = self._auth_refusal()
        if refusal is not None:
            if refusal == replies.AUTH_LOCKED_OUT:
                self._goodbye(refusal)
            else:
                await self.push(refusal)
            return
        words = (arg or "").split()
        if not 1 <= len(words) <= 2:
            await self.push(replies.AUTH_SYNTAX)
            return
        mechanism = words[0].upper()
        if mechanism not in AUTH_MECHANISMS:
            await self.push(replies.AUTH_MECHANISM)
            return
        initial = words[1] if len(words) == 2 else None
        if mechanism == "PLAIN":
            credentials = await self._plain(initial)
        else:
            credentials = await self._login(initial)
        if credentials is None:
            return  # the reply (501) was sent
        await self._check_credentials(mechanism, *credentials)

    def _auth_refusal(self) -> str | None:
        assert self.session is not None
        if not self.session.extended_smtp:
            return replies.AUTH_NEEDS_EHLO
        if not self.tls_active:
            return replies.AUTH_NEEDS_TLS
        if self.server.auth_limiter.locked_out(client_key(self.client_ip)):
            return replies.AUTH_LOCKED_OUT
        if self.grant is not None:
            return replies.AUTH_ALREADY
        envelope = self.envelope
        if isinstance(envelope, RelayEnvelope) and envelope.started:
            return replies.AUTH_IN_TRANSACTION
        return None

    async def _challenge(self, prompt: bytes) -> bytes | None:
        """Send a 334 challenge and read the client's base64 answer; None (and 501) if
        it aborts with "*" or is not base64. The answer is never logged."""
        await self.push("334 " + base64.b64encode(prompt).decode("ascii"))
        line = await self._answer_line()
        self.restart_idle_timer()
        if line is None:
            log.warning("%s: AUTH answer too long; refused", self.client_ip)
            await self.push(replies.AUTH_LINE_TOO_LONG)
            return None
        answer = line.strip()
        if answer == b"*":
            await self.push(replies.AUTH_ABORTED)
            return None
        return await self._decoded(answer.decode("ascii", "replace"))

    async def _answer_line(self) -> bytes | None:
        """The client's answer to a 334, to its LF; None when it is longer than the
        reader's limit (64 KiB): then it is read to its end and dropped, in step."""
        reader = self.reader
        too_long = False
        while True:
            try:
                line = await reader.readuntil(b"\n")
            except asyncio.LimitOverrunError as exc:
                await reader.read(exc.consumed)  # bytes that hold no LF: dropped
                too_long = True
                continue
            except asyncio.IncompleteReadError:
                raise asyncio.CancelledError() from None  # the client went away mid-AUTH
            return None if too_long else line

    async def _decoded(self, text: str) -> bytes | None:
        """``text`` decoded from base64; None (and 501) when it is not base64."""
        decoded = decode_base64(text)
        if decoded is None:
            await self.push(replies.AUTH_BAD_BASE64)
        return decoded

    async def _first_response(self, initial: str | None, prompt: bytes):
        """The client's first answer: given with AUTH (RFC 4954 initial response)
        or asked for with ``prompt``; None after a bad or aborted answer."""
        if initial is None:
            return await self._challenge(prompt)
        return await self._decoded(initial)

    async def _plain(self, initial: str | None) -> tuple[str, str] | None:
        response = await self._first_response(initial, b"")
        if response is None:
            return None
        credentials = plain_credentials(response)
        if credentials is None:
            await self.push(replies.AUTH_BAD_PLAIN)
        return credentials

    async def _login(self, initial: str | None) -> tuple[str, str] | None:
        username = await self._first_response(initial, b"Username:")
        if username is None:
            return None
        password = await self._challenge(b"Password:")
        if password is None:
            return None
        return username.decode("utf-8", "replace"), password.decode("utf-8", "replace")

    async def _check_credentials(self, mechanism: str, username: str, password: str) -> None:
        """Reserve the attempt, check the hash (a database thread: it costs
        milliseconds), then 235, 535, or the lockout (``authlimit``)."""
        try:
            outcome = await self.server.in_database(
                authlimit.attempt,
                self.server.auth_limiter,
                client_key(self.client_ip),
                username,
                password,
            )
        except Exception:
            log.exception("%s: AUTH could not be checked", self.client_ip)
            await self.push(replies.AUTH_UNAVAILABLE)
            return
        del password
        assert isinstance(outcome, authlimit.Outcome)
        if outcome.refused == authlimit.ADDRESS:
            log.warning("%s: AUTH refused: too many failures from this address", self.client_ip)
            self._goodbye(replies.AUTH_LOCKED_OUT)
            return
        if outcome.refused == authlimit.USERNAME:
            log.warning(
                "%s: AUTH refused for %r: too many failures", self.client_ip, username[:150]
            )
            if not self.count_junk():  # costs no hash: bounded as junk commands are
                await self.push(replies.AUTH_ACCOUNT_LOCKED)
            return
        if outcome.grant is not None:
            self.grant = outcome.grant
            log.info("%s: authenticated as %s (%s)", self.client_ip, username, mechanism)
            await self.push(replies.AUTH_OK)
            return
        log.warning("%s: AUTH %s failed for %r", self.client_ip, mechanism, username[:150])
        client = str(self.client_ip) if self.client_ip else None
        try:
            await self.server.in_database(
                accounts.record_auth_failure,
                client,
                username,
                mechanism,
                locked_out=outcome.locked is not None,
                locked=outcome.locked or authlimit.ADDRESS,
            )
        except Exception:  # noqa: BLE001 - the reply matters more than the event
            log.warning("could not record an AUTH failure event", exc_info=True)
        await self.push(replies.AUTH_FAILED)

    @junk_command
    @syntax("VRFY <address>")
    async def smtp_VRFY(self, arg: str | None) -> None:
        # Answer without looking anything up: a relay has no mailboxes to verify.
        await self.push(replies.CANNOT_VRFY if arg else replies.VRFY_SYNTAX)


class RelayHandler:
    """The aiosmtpd handler: what happens to a message once its data is in."""

    def __init__(self, server: InboundServer) -> None:
        self.server = server

    async def handle_DATA(self, smtp: InboundSMTP, session: Session, envelope: Envelope) -> str:  # noqa: N802
        assert isinstance(envelope, RelayEnvelope)
        data = envelope.original_content or b""
        try:
            if has_bare_line_ending(data):
                log.warning("rejected message with bare CR/LF from %s", smtp.client_ip)
                return replies.BARE_LINE_ENDING
            if refusal := header_limit_refusal(data, smtp.config):
                log.info("%s: %s", smtp.client_ip, refusal)
                return refusal
            if received_count(data) > MAX_RECEIVED_HEADERS:
                return replies.TOO_MANY_HOPS
            if smtp.grant is not None and (refusal := header_sender_refusal(smtp.grant, data)):
                log.info("%s: %s", smtp.client_ip, refusal)
                return refusal
            params = envelope.params
            incoming = IncomingEnvelope(
                mail_from=envelope.mail_from or "",
                recipients=envelope.recipients,
                body_type=params.body,
                smtputf8=params.smtputf8,
                ret=params.ret,
                envid=params.envid,
                declared_size=params.size,
                client_address=str(smtp.client_ip) if smtp.client_ip else None,
                client_helo=session.host_name or "",
                client_name="",  # no reverse DNS on the hot path
                protocol=protocol_keyword(
                    extended=session.extended_smtp,
                    tls=smtp.tls_active,
                    utf8=params.smtputf8,
                    auth=smtp.grant is not None,
                ),
                source=MessageSource.SMTP,
                auth_account=smtp.grant.username if smtp.grant is not None else "",
                # DKIM vouches only for our own clients' mail (README "DKIM"), never
                # for what the internet hands in for an accepted domain.
                dkim_sign=smtp.may_relay,
            )
        except Exception:
            log.exception("could not prepare a message from %s", smtp.client_ip)
            return replies.INTERNAL_ERROR
        try:
            qid = await counters.timed_accept(self.server.store(incoming, data))
        except Exception as exc:
            if not is_unavailable(exc):
                log.exception("could not store a message from %s", smtp.client_ip)
                return replies.STORE_FAILED
            # The database is away (a failover): one line per 451, the outage
            # itself once as it starts and once as it ends (delivery.outage).
            OUTAGE.failed(exc)
            log.warning("451 4.3.0 message from %s not stored: %s", smtp.client_ip, first_line(exc))
            return replies.STORE_FAILED
        OUTAGE.recovered()
        log.info(
            "%s: from=<%s> nrcpt=%d size=%d client=%s",
            qid,
            incoming.mail_from,
            len(incoming.recipients),
            len(data),
            smtp.client_ip,
        )
        return replies.QUEUED.format(qid=qid)

    async def handle_exception(self, error: Exception) -> str:
        log.error("inbound SMTP session error", exc_info=error)
        return replies.INTERNAL_ERROR


# ----------------------------------------------------------------- the server


class InboundServer:
    """Listeners, database threads and the doorbell of one ingress process."""

    def __init__(
        self,
        config: InboundConfig,
        *,
        db_threads: int = DEFAULT_DB_THREADS,
        monitor: Monitor | None = None,
        commit_threads: int | None = None,
        reuse_port: bool = False,
    ) -> None:
        self.config = config
        self.reuse_port = reuse_port  # several runsmtp processes share the ports
        self.db_threads = db_threads
        # Committer threads (group commit); no more than the database threads asked for.
        self.commit_threads = commit_threads or min(db_threads, DEFAULT_COMMIT_THREADS)
        self.monitor = monitor
        # Messages received and not yet committed: the monitor's version buckets.
        self.uncommitted = monitor.uncommitted if monitor is not None else InFlight()
        self.sessions: set[InboundSMTP] = set()
        self.per_client: Counter[str] = Counter()  # open sessions per client_key
        self.addresses: list[tuple[str, int]] = []
        self.bound: dict[str, list[tuple[str, int]]] = {}  # listener kind → its addresses
        self.auth_limiter = AuthLimiter(
            config.max_auth_failures,
            config.max_auth_failures_per_user,
            processes=config.processes,
        )
        self._listeners: list[asyncio.Server] = []
        self._stores: set[asyncio.Future] = set()
        self._stopping = False
        self._no_sessions = asyncio.Event()
        self.loop: asyncio.AbstractEventLoop | None = None
        self._executor: DatabaseExecutor | None = None
        self._committer: GroupCommitter | None = None
        self._bell: CoalescedBell | None = None

    async def start(
        self,
        addresses: Sequence[tuple[str, int]],
        *,
        submission: Sequence[tuple[str, int]] = (),
        submissions: Sequence[tuple[str, int]] = (),
    ) -> list[tuple[str, int]]:
        """Listen on every (host, port); returns the bound addresses (port 0 → real port).

        ``addresses`` are relay listeners (port 25), ``submission`` STARTTLS-then-AUTH
        listeners (587), ``submissions`` implicit-TLS listeners (465); ``self.bound``
        has each kind's bound addresses.
        """
        if (submission or submissions) and self.config.tls is None:
            raise ImproperlyConfigured(
                "submission listeners need MAILRELAY_TLS_CERT_FILE and MAILRELAY_TLS_KEY_FILE"
            )
        self.loop = asyncio.get_running_loop()
        self._executor = DatabaseExecutor(self.db_threads)
        self._committer = GroupCommitter(self.commit_threads, store_batch=_store_batch)
        self._bell = CoalescedBell(self.loop, self._executor)
        handler = RelayHandler(self)
        try:
            if self.monitor is not None:
                await self.monitor.start()  # judged from the first session on
            kinds = (
                (SMTP_LISTENER, addresses),
                (SUBMISSION, submission),
                (SUBMISSIONS, submissions),
            )
            for kind, listen in kinds:
                for host, port in listen:
                    await self._listen(handler, kind, host, port)
        except BaseException:
            await self.stop()
            raise
        return list(self.addresses)

    async def _listen(self, handler: RelayHandler, kind: str, host: str, port: int) -> None:
        assert self.loop is not None
        tls = self.config.tls
        listener = await self.loop.create_server(
            functools.partial(InboundSMTP, self, handler, kind),
            host=host or None,
            port=port,
            reuse_address=True,
            reuse_port=self.reuse_port or None,
            backlog=512,
            ssl=tls.listener_context() if kind == SUBMISSIONS and tls is not None else None,
        )
        self._listeners.append(listener)
        for sock in listener.sockets:
            bound = sock.getsockname()
            self.addresses.append((bound[0], bound[1]))
            self.bound.setdefault(kind, []).append((bound[0], bound[1]))

    async def in_database(self, function: Callable[..., object], *args, **kwargs) -> object:
        """Run a synchronous ORM call in a database thread (never on the event loop)."""
        assert self.loop is not None and self._executor is not None
        call = functools.partial(function, *args, **kwargs)
        return await self.loop.run_in_executor(self._executor, _in_thread, call)

    async def store(self, envelope: IncomingEnvelope, data: bytes) -> str:
        """Prepare and commit a message (group commit, ``groupcommit``); ring
        the categorizer after it.

        The message is prepared first (queue id, headers, DKIM signature) in
        a database thread of this session's own, so its signing, however
        long, holds up no other session: the committer threads, which every
        session's commit waits on, only insert. The commit runs to its end
        even if the client goes away meanwhile (shielded), and the ring
        follows every commit, replied to or not. The queue id comes back only
        once the message's transaction committed.
        """
        assert self.loop is not None and self._committer is not None
        self.uncommitted.add()  # received, not committed: from now on
        try:
            prepared = await self.in_database(prepare_message, envelope, data)
            assert isinstance(prepared, PreparedMessage)
            committed = self._committer.submit(prepared, data)
        except BaseException:
            self.uncommitted.done()
            raise
        future = asyncio.wrap_future(committed, loop=self.loop)
        self._stores.add(future)
        future.add_done_callback(self._stored)
        return await asyncio.shield(future)

    def _stored(self, future: asyncio.Future) -> None:
        self._stores.discard(future)
        self.uncommitted.done()
        if not future.cancelled() and future.exception() is None:
            assert self._bell is not None
            self._bell.request()

    @property
    def stopping(self) -> bool:
        return self._stopping

    def admit(self, session: InboundSMTP) -> str | None:
        """Count a new connection in, or return the 421 that refuses it (Postfix's anvil)."""
        config = self.config
        if config.max_connections and len(self.sessions) >= config.max_connections:
            log.warning("refused %s: %d connections open", session.client_ip, len(self.sessions))
            return replies.TOO_MANY_CONNECTIONS
        if session.kind != SMTP_LISTENER and self.auth_limiter.locked_out(
            client_key(session.client_ip)
        ):
            log.warning("refused %s: too many AUTH failures", session.client_ip)
            return replies.AUTH_LOCKED_OUT
        if not session.trusted:
            key = client_key(session.client_ip)
            limit = config.max_connections_per_client
            if limit and self.per_client[key] >= limit:
                log.warning("refused %s: %d connections from %s", session.client_ip, limit, key)
                return replies.TOO_MANY_FROM_CLIENT
            self.per_client[key] += 1
            session.counted_as = key
        self.sessions.add(session)
        return None

    def session_ended(self, session: InboundSMTP) -> None:
        self.sessions.discard(session)
        if session.counted_as is not None:
            key, session.counted_as = session.counted_as, None
            self.per_client[key] -= 1
            if self.per_client[key] <= 0:
                del self.per_client[key]
        if self._stopping and not self.sessions:
            self._no_sessions.set()

    async def stop(self, grace: float = 30.0) -> None:
        """Stop listening, let commits in progress answer, close every session, clean up."""
        if self._stopping:
            return
        self._stopping = True
        for listener in self._listeners:
            listener.close()
        for session in list(self.sessions):
            session.shutdown()
        if self.sessions:
            try:
                await asyncio.wait_for(self._no_sessions.wait(), grace)
            except TimeoutError:
                for session in list(self.sessions):
                    if session.transport is not None:
                        session.transport.abort()
        if self._stores:
            await asyncio.wait(set(self._stores))
        if self._committer is not None:
            assert self.loop is not None
            await self.loop.run_in_executor(None, self._committer.shutdown)
        if self._bell is not None:
            await self._bell.flush()
        if self._executor is not None:
            assert self.loop is not None
            # Joining the threads blocks; do it off the event loop.
            await self.loop.run_in_executor(None, self._executor.shutdown)
        for listener in self._listeners:
            await listener.wait_closed()
        if self.monitor is not None:
            await self.monitor.stop()
