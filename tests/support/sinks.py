"""Real SMTP sinks for tests: aiosmtpd servers on loopback addresses.

Linux routes all of 127.0.0.0/8 to ``lo``, so sinks on 127.0.0.2, 127.0.0.3,
... on one port play several MX hosts. Each sink runs an aiosmtpd
``Controller`` in its own thread and records what it received.

Fixtures:

- ``smtp_port``: a port free on 127.0.0.1 to 127.0.0.9 at once;
- ``sink_factory(host="127.0.0.2", port=None, **behaviour)``: start a sink
  (``port`` defaults to ``smtp_port``); every sink stops at teardown;
- ``sink``: one default sink on 127.0.0.2.

Behaviour knobs (``SinkBehaviour`` fields, passed as keywords):

- ``greeting="421 4.3.2 busy"``: sent instead of 220, then the sink hangs up;
- ``ehlo_reply="502 5.5.2 no"``: reject EHLO (the client falls back to HELO);
- ``pipelining``, ``dsn``, ``smtputf8``, ``eightbitmime``: advertise or not
  (DSN parameters are accepted only when ``dsn``; aiosmtpd answers 555
  otherwise, so a client that sends them anyway fails loudly);
- ``size_limit``: the SIZE advertised and enforced (0: no SIZE);
- ``tls=True``: offer STARTTLS with a self-signed certificate;
  ``tls_broken=True``: offer STARTTLS but fail every handshake;
- ``mail_replies={"sender@x": "550 5.7.1 no"}``: reply to MAIL by sender;
- ``rcpt_replies={"temp@x": "450 4.2.1 busy"}``: reply to RCPT by address;
- ``rcpt_tempfail={"later@x": 2}``: ``tempfail_reply`` that many times for
  that address, then accept;
- ``data_replies={"sender@x": "451 4.3.0 later"}`` / ``data_reply``: reply
  to the final dot by sender / for all;
- ``delays={"greeting": 2.0, "MAIL": 1.0, "RCPT": ..., "DATA": ...}``:
  seconds before the reply (for client timeouts; "DATA" is the final reply);
- ``drop_after_data={3}``: after receiving the 3rd message (1-based, per
  sink) hang up without replying;
- any reply starting with ``421`` hangs up after it is sent;
- ``auth={"user": "pass"}``: offer AUTH PLAIN/LOGIN (``auth_mechanisms``),
  only inside TLS unless ``auth_require_tls=False``; ``auth_required`` makes
  MAIL need it; attempts are recorded in ``auth_attempts``;
- ``implicit_tls=True``: TLS from the first byte (port 465 style);
- ``command_size_limit=4096``: accept command lines up to that many octets
  (aiosmtpd's default is RFC 5321's 512, plus its extensions' room);
- ``certificate=(cert, key)`` (a factory keyword): serve that certificate
  (e.g. issued by a test's trustme CA) instead of the default self-signed one.

Nothing listening is the way to refuse connections: pass ``refuse=True`` to
get a sink object that is never started, or just point a target at an
address where no sink runs.

Recording (thread-safe): ``messages`` (accepted, ``ReceivedMessage`` with
envelope, raw ESMTP options and the exact bytes), ``dropped`` and
``rejected`` messages, ``connections`` (count), ``peak_connections``,
``per_connection()`` (messages per connection, in connection order),
``commands`` ((connection, verb) pairs), and ``wait_for(n, timeout)`` /
``await wait_for_async(n, timeout)`` to wait for n accepted messages without
polling.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import socket
import ssl
import threading
from collections.abc import Callable, Collection, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import trustme
from aiosmtpd.controller import Controller
from aiosmtpd.smtp import SMTP, AuthResult

SINK_HOSTS = tuple(f"127.0.0.{i}" for i in range(2, 10))
DSN_PARAMS = ("RET", "ENVID", "NOTIFY", "ORCPT")


@dataclass
class SinkBehaviour:
    greeting: str | None = None
    ehlo_reply: str | None = None
    pipelining: bool = True
    dsn: bool = False
    smtputf8: bool = True
    eightbitmime: bool = True
    size_limit: int = 10 * 1024 * 1024
    tls: bool = False
    tls_broken: bool = False
    mail_replies: Mapping[str, str] = field(default_factory=dict)
    rcpt_replies: Mapping[str, str] = field(default_factory=dict)
    rcpt_tempfail: Mapping[str, int] = field(default_factory=dict)
    tempfail_reply: str = "450 4.2.1 try again later"
    data_replies: Mapping[str, str] = field(default_factory=dict)
    data_reply: str | None = None
    delays: Mapping[str, float] = field(default_factory=dict)
    drop_after_data: Collection[int] = ()
    # AUTH (aiosmtpd's PLAIN and LOGIN): username -> password; empty: no AUTH.
    auth: Mapping[str, str] = field(default_factory=dict)
    auth_required: bool = False  # 530 to MAIL before a successful AUTH
    auth_require_tls: bool = True  # AUTH offered only inside TLS
    auth_mechanisms: Collection[str] = ("PLAIN", "LOGIN")
    # TLS from the first byte (port 465 style) instead of STARTTLS.
    implicit_tls: bool = False
    # Longest command line accepted (None: aiosmtpd's 512 and its extensions' room).
    command_size_limit: int | None = None


@dataclass
class ReceivedMessage:
    mail_from: str
    rcpt_tos: list[str]
    mail_options: list[str]  # as sent, case kept
    rcpt_options: list[list[str]]  # one list per recipient, as sent
    data: bytes  # exactly the bytes received (dot-unstuffed)
    connection: int  # serial number of the connection, from 1
    tls: bool


def find_free_port(hosts: Collection[str] = ("127.0.0.1", *SINK_HOSTS)) -> int:
    """A port nobody listens on at any of ``hosts`` right now.

    The kernel picks it (so parallel test runs do not collide on a guess),
    then it is checked on every other address.
    """
    for _ in range(50):
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        if all(_bindable(h, port) for h in hosts):
            return port
    raise RuntimeError("no port free on all loopback sink addresses")


def _bindable(host: str, port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def make_certificate(directory: Path, name: str = "sink.test") -> tuple[Path, Path]:
    """A throw-away certificate for ``name`` and its key (EC P-256: fast), as PEM
    files in ``directory``; issued by a throw-away trustme CA, in process."""
    issued = trustme.CA().issue_cert(name)
    cert, key = directory / f"{name}-cert.pem", directory / f"{name}-key.pem"
    # The leaf first, then the CA: a server sends the chain, a client that
    # trusts the CA (none here) could verify it.
    cert.write_bytes(b"".join(pem.bytes() for pem in issued.cert_chain_pems))
    issued.private_key_pem.write_to_path(str(key))
    return cert, key


class _SinkSMTP(SMTP):
    """aiosmtpd's SMTP with the sink's greeting, DSN parameters, hang-ups and
    bookkeeping."""

    def __init__(self, sink: Sink, counted: bool, **kwargs) -> None:
        limit = sink.behaviour.command_size_limit
        if limit is not None:  # the stream reader is sized in SMTP.__init__
            self.line_length_limit = max(SMTP.line_length_limit, limit)
        super().__init__(_SinkHandler(sink), **kwargs)
        self.sink = sink
        # The controller's own start-up probe is neither counted nor served
        # the odd behaviours.
        self.counted = counted
        self.conn_id = 0
        self.greeted = False
        self.raw_arg = ""
        if limit is not None:
            # Per connection (aiosmtpd's dict is class-level and every EHLO grows it).
            self.command_size_limit = limit
            self.command_size_limits = collections.defaultdict(lambda: limit)

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        first = self.transport is None
        super().connection_made(transport)
        if first:
            self.sink._live.add(self)
            if self.counted:
                self.conn_id = self.sink._connection_opened()

    def connection_lost(self, error: Exception | None) -> None:
        self.sink._live.discard(self)
        if self.counted and self.conn_id:
            self.sink._connection_closed()
            self.conn_id = 0
        super().connection_lost(error)

    async def push(self, status: str | bytes) -> None:
        if not self.greeted:
            self.greeted = True
            if self.counted:
                behaviour = self.sink.behaviour
                delay = behaviour.delays.get("greeting")
                if delay:
                    await asyncio.sleep(delay)
                if behaviour.greeting is not None:
                    await super().push(behaviour.greeting)
                    self._hang_up()
                    return
        await super().push(status)
        text = status.decode() if isinstance(status, bytes) else status
        if self.counted and text.startswith("421"):
            self._hang_up()

    def _hang_up(self) -> None:
        if self.transport is not None:
            self.transport.close()

    def _getparams(self, params):  # type: ignore[override]
        result = super()._getparams(params)
        # aiosmtpd knows no DSN: accept its parameters when we advertise it.
        if result is not None and self.sink.behaviour.dsn:
            for name in DSN_PARAMS:
                result.pop(name, None)
        return result

    async def smtp_STARTTLS(self, arg: str) -> None:
        if self.counted and self.sink.behaviour.tls_broken:
            # Agree, then answer the client's ClientHello with cleartext.
            self.sink._command(self, "STARTTLS")
            await super().push("220 2.0.0 Ready to start TLS")
            await self._reader.read(5)
            self._writer.write(b"this is not TLS\r\n")
            self._hang_up()
            return
        await super().smtp_STARTTLS(arg)

    async def smtp_MAIL(self, arg: str | None) -> None:
        self.raw_arg = arg or ""
        await super().smtp_MAIL(arg)

    async def smtp_RCPT(self, arg: str | None) -> None:
        self.raw_arg = arg or ""
        await super().smtp_RCPT(arg)

    def raw_params(self, keyword: str) -> list[str]:
        """The parameters of the current MAIL/RCPT command, case kept."""
        arg = self._strip_command_keyword(keyword, self.raw_arg)
        if arg is None:
            return []
        _, params = self._getaddr(arg)
        return (params or "").split()


class _SinkHandler:
    def __init__(self, sink: Sink) -> None:
        self.sink = sink
        self.b = sink.behaviour
        # Recipient keys match case-insensitively.
        self.rcpt_replies = {k.lower(): v for k, v in self.b.rcpt_replies.items()}

    async def _delay(self, name: str) -> None:
        delay = self.b.delays.get(name)
        if delay:
            await asyncio.sleep(delay)

    async def handle_EHLO(self, server, session, envelope, hostname, responses):
        self.sink._command(server, "EHLO")
        await self._delay("EHLO")
        if self.b.ehlo_reply is not None:
            session.extended_smtp = False
            return [self.b.ehlo_reply]
        session.host_name = hostname
        out = [r for r in responses if not r.endswith("HELP")]
        if not self.b.eightbitmime:
            out = [r for r in out if "8BITMIME" not in r]
        if self.b.pipelining:
            out.append("250-PIPELINING")
        if self.b.dsn:
            out.append("250-DSN")
        out.append("250 HELP")
        return out

    async def handle_HELO(self, server, session, envelope, hostname):
        self.sink._command(server, "HELO")
        session.host_name = hostname
        return f"250 {server.hostname}"

    def handle_STARTTLS(self, server, session, envelope) -> bool:
        self.sink._command(server, "STARTTLS")
        return True

    async def handle_MAIL(self, server, session, envelope, address, mail_options):
        self.sink._command(server, "MAIL")
        await self._delay("MAIL")
        reply = self.b.mail_replies.get(address)
        if reply is not None and not reply.startswith("2"):
            return reply
        envelope.mail_from = address
        envelope.mail_options.extend(mail_options)
        envelope.raw_mail_options = server.raw_params("FROM:")
        envelope.raw_rcpt_options = []
        return reply or "250 2.1.0 OK"

    async def handle_RCPT(self, server, session, envelope, address, rcpt_options):
        self.sink._command(server, "RCPT")
        await self._delay("RCPT")
        key = address.lower()
        reply = self.rcpt_replies.get(key)
        if reply is None:
            reply = self.sink._tempfail(key)
        if reply is not None and not reply.startswith("2"):
            return reply
        envelope.rcpt_tos.append(address)
        envelope.rcpt_options.extend(rcpt_options)
        envelope.raw_rcpt_options.append(server.raw_params("TO:"))
        return reply or "250 2.1.5 OK"

    async def handle_RSET(self, server, session, envelope):
        self.sink._command(server, "RSET")
        return "250 2.0.0 OK"

    async def handle_QUIT(self, server, session, envelope):
        self.sink._command(server, "QUIT")
        return "221 2.0.0 Bye"

    async def handle_DATA(self, server, session, envelope):
        self.sink._command(server, "DATA")
        await self._delay("DATA")
        received = ReceivedMessage(
            mail_from=envelope.mail_from,
            rcpt_tos=list(envelope.rcpt_tos),
            mail_options=list(getattr(envelope, "raw_mail_options", [])),
            rcpt_options=list(getattr(envelope, "raw_rcpt_options", [])),
            data=envelope.original_content,
            connection=server.conn_id,
            tls=session.ssl is not None or self.sink.behaviour.implicit_tls,
        )
        ordinal = self.sink._data_received()
        if ordinal in self.b.drop_after_data:
            self.sink._record(received, "dropped")
            server.transport.abort()
            # Unwind aiosmtpd's session as a lost connection would.
            raise asyncio.CancelledError
        reply = self.b.data_replies.get(envelope.mail_from, self.b.data_reply)
        if reply is not None and not reply.startswith("2"):
            self.sink._record(received, "rejected")
            return reply
        self.sink._record(received, "messages")
        return reply or "250 2.0.0 OK queued"


class _SinkController(Controller):
    def __init__(self, sink: Sink, **kwargs) -> None:
        super().__init__(None, **kwargs)
        self.sink = sink

    def factory(self) -> SMTP:
        return _SinkSMTP(self.sink, self.sink.started, **self.SMTP_kwargs)


class Sink:
    """One SMTP sink server; see the module docstring."""

    def __init__(
        self,
        host: str,
        port: int,
        behaviour: SinkBehaviour,
        tls_context: ssl.SSLContext | None = None,
    ) -> None:
        self.host = host
        self.port = port
        self.behaviour = behaviour
        self.tls_context = tls_context
        self.started = False
        self.messages: list[ReceivedMessage] = []
        self.dropped: list[ReceivedMessage] = []
        self.rejected: list[ReceivedMessage] = []
        self.commands: list[tuple[int, str]] = []
        self.connections = 0
        self.active_connections = 0
        self.peak_connections = 0
        self._per_connection: dict[int, int] = {}
        self._data_count = 0
        self._tempfail_left = {k.lower(): n for k, n in behaviour.rcpt_tempfail.items()}
        self._cond = threading.Condition()
        self._controller: _SinkController | None = None
        self._live: set[_SinkSMTP] = set()  # open sessions (touched in the sink thread)
        # (mechanism, login, success) per AUTH attempt
        self.auth_attempts: list[tuple[str, str, bool]] = []

    # life cycle -----------------------------------------------------------------

    def start(self) -> Sink:
        kwargs = {
            "hostname": self.host,
            "port": self.port,
            "enable_SMTPUTF8": self.behaviour.smtputf8,
            "data_size_limit": self.behaviour.size_limit or None,
            "ready_timeout": 5.0,
        }
        b = self.behaviour
        if self.tls_context is not None and b.implicit_tls:
            kwargs["ssl_context"] = self.tls_context
        elif self.tls_context is not None:
            kwargs["tls_context"] = self.tls_context
        if b.auth:
            kwargs["authenticator"] = self._authenticate
            kwargs["auth_required"] = b.auth_required
            # aiosmtpd counts only STARTTLS as TLS; an implicit-TLS session is one too.
            kwargs["auth_require_tls"] = b.auth_require_tls and not b.implicit_tls
            kwargs["auth_exclude_mechanism"] = [
                m for m in ("PLAIN", "LOGIN") if m not in b.auth_mechanisms
            ]
        self._controller = _SinkController(self, **kwargs)
        self._controller.start()
        self.started = True
        return self

    def stop(self) -> None:
        if self._controller is not None:
            # Close the sessions still open (a client gave up on a slow
            # reply), so no socket outlives the sink; then stop the loop.
            with contextlib.suppress(Exception):
                done = threading.Event()
                self._controller.loop.call_soon_threadsafe(self._close_live, done)
                done.wait(2.0)
            with contextlib.suppress(Exception):
                self._controller.stop()
            self._controller = None
        self.started = False

    def _close_live(self, done: threading.Event) -> None:
        for session in list(self._live):
            if session.transport is not None:
                session.transport.abort()
        done.set()

    def _authenticate(self, server, session, envelope, mechanism, auth_data) -> AuthResult:
        login = auth_data.login.decode("utf-8", "replace")
        password = auth_data.password.decode("utf-8", "replace")
        ok = self.behaviour.auth.get(login) == password
        with self._cond:
            self.auth_attempts.append((mechanism, login, ok))
        return AuthResult(success=ok, handled=False)

    # bookkeeping (called from the sink's thread) ----------------------------------

    def _connection_opened(self) -> int:
        with self._cond:
            self.connections += 1
            self.active_connections += 1
            self.peak_connections = max(self.peak_connections, self.active_connections)
            self._per_connection[self.connections] = 0
            self._cond.notify_all()
            return self.connections

    def _connection_closed(self) -> None:
        with self._cond:
            self.active_connections -= 1
            self._cond.notify_all()

    def _command(self, server: _SinkSMTP, verb: str) -> None:
        if server.counted:
            with self._cond:
                self.commands.append((server.conn_id, verb))

    def _tempfail(self, address: str) -> str | None:
        left = self._tempfail_left.get(address, 0)
        if left <= 0:
            return None
        self._tempfail_left[address] = left - 1
        return self.behaviour.tempfail_reply

    def _data_received(self) -> int:
        with self._cond:
            self._data_count += 1
            return self._data_count

    def _record(self, message: ReceivedMessage, where: str) -> None:
        with self._cond:
            getattr(self, where).append(message)
            if where == "messages" and message.connection in self._per_connection:
                self._per_connection[message.connection] += 1
            self._cond.notify_all()

    # reading (from the test) -------------------------------------------------------

    def per_connection(self) -> list[int]:
        """Messages accepted on each connection, in connection order."""
        with self._cond:
            return [self._per_connection[k] for k in sorted(self._per_connection)]

    def verbs(self, connection: int | None = None) -> list[str]:
        with self._cond:
            return [v for conn, v in self.commands if connection in (None, conn)]

    def wait_until(self, predicate: Callable[[], bool], timeout: float = 5.0) -> bool:
        with self._cond:
            return self._cond.wait_for(predicate, timeout)

    def wait_for(self, n: int, timeout: float = 5.0) -> bool:
        """Wait until ``n`` messages were accepted; False on timeout."""
        return self.wait_until(lambda: len(self.messages) >= n, timeout)

    async def wait_for_async(self, n: int, timeout: float = 5.0) -> bool:
        return await asyncio.to_thread(self.wait_for, n, timeout)

    def wait_idle(self, timeout: float = 5.0) -> bool:
        """Wait until every connection to the sink has closed."""
        return self.wait_until(lambda: self.active_connections == 0, timeout)

    def __repr__(self) -> str:
        return f"<Sink {self.host}:{self.port} messages={len(self.messages)}>"


# --- fixtures ------------------------------------------------------------------------


@pytest.fixture(scope="session")
def sink_certificate(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return make_certificate(tmp_path_factory.mktemp("sink-tls"))


def _server_tls_context(cert: Path, key: Path) -> ssl.SSLContext:
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(cert, key)
    return ctx


@pytest.fixture
def smtp_port() -> int:
    """A port free on 127.0.0.1-127.0.0.9, for sinks playing several hosts."""
    return find_free_port()


@pytest.fixture
def sink_factory(smtp_port: int, request: pytest.FixtureRequest) -> Iterator[Callable[..., Sink]]:
    sinks: list[Sink] = []

    def factory(
        host: str = "127.0.0.2",
        port: int | None = None,
        *,
        refuse: bool = False,
        certificate: tuple[Path, Path] | None = None,
        **behaviour,
    ) -> Sink:
        b = SinkBehaviour(**behaviour)
        tls_context = None
        if b.tls or b.tls_broken or b.implicit_tls:
            cert, key = certificate or request.getfixturevalue("sink_certificate")
            tls_context = _server_tls_context(cert, key)
        sink = Sink(host, smtp_port if port is None else port, b, tls_context)
        if not refuse:
            sinks.append(sink)
            sink.start()
        return sink

    yield factory
    for sink in sinks:
        sink.stop()


@pytest.fixture
def sink(sink_factory: Callable[..., Sink]) -> Sink:
    """A default sink on 127.0.0.2:``smtp_port``."""
    return sink_factory()
