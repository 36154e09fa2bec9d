"""The real inbound SMTP server on loopback, for tests.

``ingress`` starts it with the current settings on 127.0.0.1 and an
ephemeral port; ``start_ingress`` starts it after a test changed settings
(``settings.MAILRELAY_RELAY_NETWORKS = [...]``) or with config overrides
(``start_ingress(max_recipients=3)``). The server runs in a background
thread with its own event loop; the thread commits for real, so both
fixtures need the transactional database (they request it).

``start_ingress(submission=True, submissions=True)`` also listens for
submission (STARTTLS, then AUTH) and implicit TLS; ``tls_files`` makes a test
CA (trustme) and a certificate for 127.0.0.1 and points the settings at it.
"""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import smtplib
import socket
import ssl
import threading
import uuid
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import pytest
import trustme

from delivery.smtpd.config import InboundConfig
from delivery.smtpd.server import InboundServer


class SMTPRefused(AssertionError):
    """A command of ``Ingress.send`` got a reply other than the one expected."""

    def __init__(self, command: str, code: int, text: bytes) -> None:
        super().__init__(f"{command}: {code} {text.decode(errors='replace')}")
        self.command = command
        self.code = code
        self.text = text.decode(errors="replace")


class Ingress:
    """A running server: ``host``, ``port``, and helpers to talk to it."""

    def __init__(
        self,
        config: InboundConfig,
        db_threads: int = 4,
        *,
        submission: bool = False,
        submissions: bool = False,
    ) -> None:
        self.config = config
        self.server = InboundServer(config, db_threads=db_threads)
        self.host = "127.0.0.1"
        self.port = 0
        self.submission_port = 0  # STARTTLS, AUTH required (587-style); 0 = not listening
        self.submissions_port = 0  # implicit TLS (465-style)
        self._submission = submission
        self._submissions = submissions
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run, name="ingress", daemon=True)
        self._ready = threading.Event()
        self._error: BaseException | None = None

    # --- life cycle

    def start(self) -> Ingress:
        self._thread.start()
        if not self._ready.wait(10):
            raise RuntimeError("the ingress server did not start")
        if self._error is not None:
            raise self._error
        return self

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        try:
            start = self.server.start(
                [(self.host, 0)],
                submission=[(self.host, 0)] if self._submission else (),
                submissions=[(self.host, 0)] if self._submissions else (),
            )
            bound = self._loop.run_until_complete(start)
            self.port = bound[0][1]
            if self._submission:
                self.submission_port = self.server.bound["submission"][0][1]
            if self._submissions:
                self.submissions_port = self.server.bound["submissions"][0][1]
        except BaseException as exc:  # noqa: BLE001 - reported to start()
            self._error = exc
            self._ready.set()
            self._loop.close()
            return
        self._ready.set()
        try:
            self._loop.run_forever()
        finally:
            self._loop.close()

    def stop(self) -> None:
        """Stop the server: sessions closed, database threads' connections closed."""
        if not self._thread.is_alive():
            return
        future = asyncio.run_coroutine_threadsafe(self.server.stop(grace=5), self._loop)
        future.result(20)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)

    # --- clients

    def smtp(self, helo: str = "client.test") -> smtplib.SMTP:
        client = smtplib.SMTP(self.host, self.port, local_hostname=helo, timeout=10)
        client.ehlo()
        return client

    def send(
        self,
        data: bytes,
        *,
        mail_from: str = "sender@example.org",
        rcpt_to: Sequence[str] = ("rcpt@example.net",),
        mail_options: Sequence[str] = (),
        rcpt_options: Sequence[str] = (),
        helo: str = "client.test",
    ) -> tuple[int, str]:
        """One message in one session; returns the DATA reply.

        Raises ``SMTPRefused`` if MAIL or a RCPT is not answered 250.
        """
        with smtplib.SMTP(self.host, self.port, local_hostname=helo, timeout=10) as client:
            client.ehlo()
            code, text = client.mail(mail_from, list(mail_options))
            if code != 250:
                raise SMTPRefused("MAIL", code, text)
            for address in rcpt_to:
                code, text = client.rcpt(address, list(rcpt_options))
                if code != 250:
                    raise SMTPRefused(f"RCPT {address}", code, text)
            code, text = client.data(data)
            return code, text.decode(errors="replace")

    def raw(self) -> RawClient:
        """A socket client for what smtplib will not send (bare LF, pipelining)."""
        return RawClient(self.host, self.port)


class RawClient:
    """Line-level SMTP over a plain socket; ``reply()`` reads one (multi-line) reply."""

    def __init__(self, host: str, port: int, timeout: float = 10) -> None:
        self.sock = socket.create_connection((host, port), timeout=timeout)
        self._buffer = b""
        self.greeting = self.reply()

    def send(self, data: bytes) -> None:
        self.sock.sendall(data)

    def _line(self) -> bytes:
        while b"\r\n" not in self._buffer:
            chunk = self.sock.recv(65536)
            if not chunk:
                raise ConnectionError(f"connection closed; unread: {self._buffer!r}")
            self._buffer += chunk
        line, _, self._buffer = self._buffer.partition(b"\r\n")
        return line

    def reply(self) -> tuple[int, list[str]]:
        """(code, lines without the code) of the next reply."""
        lines: list[str] = []
        while True:
            line = self._line().decode("utf-8", "replace")
            lines.append(line[4:])
            if line[3:4] != "-":
                return int(line[:3]), lines

    def command(self, line: str) -> tuple[int, list[str]]:
        self.send(line.encode() + b"\r\n")
        return self.reply()

    def reply_line(self) -> str:
        """The next reply as one line of text, e.g. ``250 2.0.0 Ok``."""
        code, lines = self.reply()
        return f"{code} {lines[-1]}"

    def closed_by_server(self, timeout: float = 5) -> bool:
        """True when the server closes the connection (EOF) within ``timeout``; unread
        replies are skipped."""
        self.sock.settimeout(timeout)
        while True:
            chunk = self.sock.recv(65536)
            if not chunk:
                return True

    def close(self) -> None:
        self.sock.close()

    def __enter__(self) -> RawClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@pytest.fixture
def start_ingress(transactional_db, settings) -> Iterator[Callable[..., Ingress]]:
    """Start a server reading settings now; keyword arguments override InboundConfig fields.

    ``db_threads=1`` makes every message use the same database thread. The
    cache (the shared AUTH failure counters) gets a key prefix of this test's
    own: every client here is 127.0.0.1, and a lockout must not outlive its test.
    """
    caches = copy.deepcopy(settings.CACHES)
    caches["default"]["KEY_PREFIX"] = f"test-{uuid.uuid4().hex}"
    settings.CACHES = caches
    started: list[Ingress] = []

    def start(
        db_threads: int = 4,
        *,
        submission: bool = False,
        submissions: bool = False,
        **overrides: object,
    ) -> Ingress:
        config = dataclasses.replace(InboundConfig.from_settings(), **overrides)
        ingress = Ingress(
            config, db_threads=db_threads, submission=submission, submissions=submissions
        )
        started.append(ingress)
        return ingress.start()

    yield start
    # Before pytest-django flushes the database: no session may hold a lock.
    for ingress in reversed(started):
        ingress.stop()


@pytest.fixture
def ingress(start_ingress: Callable[..., Ingress]) -> Ingress:
    return start_ingress()


class TlsFiles:
    """A test CA and a server certificate for 127.0.0.1 in PEM files; ``renew()``
    writes a new one (another serial number) over the same files."""

    def __init__(self, directory: Path) -> None:
        self.ca = trustme.CA()
        self.cert_file = directory / "server.crt"
        self.key_file = directory / "server.key"
        self.renew()

    def renew(self) -> trustme.LeafCert:
        leaf = self.ca.issue_cert("127.0.0.1", "localhost")
        # The key first: a reader between the two writes sees a mismatch and keeps the old.
        leaf.private_key_pem.write_to_path(str(self.key_file))
        leaf.cert_chain_pems[0].write_to_path(str(self.cert_file))
        self.leaf = leaf
        return leaf

    def client_context(self) -> ssl.SSLContext:
        context = ssl.create_default_context()
        self.ca.configure_trust(context)
        return context

    def serial(self) -> int:
        """The serial number of the certificate now in the files."""
        from cryptography import x509

        return x509.load_pem_x509_certificate(self.cert_file.read_bytes()).serial_number


@pytest.fixture
def tls_files(tmp_path: Path, settings) -> TlsFiles:
    """A certificate for the ingress (MAILRELAY_TLS_CERT_FILE/_KEY_FILE set to it)."""
    files = TlsFiles(tmp_path)
    settings.MAILRELAY_TLS_CERT_FILE = str(files.cert_file)
    settings.MAILRELAY_TLS_KEY_FILE = str(files.key_file)
    return files
