"""A recording SMTP sink that can offer STARTTLS: a stand-in for ``smtp-sink``.

Postfix's ``smtp-sink`` does not speak STARTTLS, so to measure what TLS to
the next hop costs the relay, the bench can put this sink at the end instead::

    python bench/relaybench/tls_sink.py --listen 127.0.0.1:PORT --dump DIR/cur \
        [--starttls] [--hostname sink.bench.local]

It keeps ``smtp-sink``'s interface, so ``relaybench.sink.Sink`` counts and
checks both the same way:

- after every message it prints ``sess=S tls=T mesg=N`` (running counts of
  sessions, of STARTTLS handshakes and of messages) to stdout, unbuffered,
  like ``smtp-sink -c``;
- every mail transaction goes to its own file in the ``--dump`` directory
  (re-created when the harness has renamed it), like ``smtp-sink -d``: the
  ``X-Client-…``/``X-Helo-Args``/``X-Mail-Args``/``X-Rcpt-Args`` lines, then
  the message (CRLF turned into LF). One more line, ``X-Client-TLS:``, holds
  the protocol and cipher (``none`` in cleartext), so the harness can prove
  every message travelled over TLS.

With ``--starttls`` it advertises STARTTLS with a certificate for
``--hostname`` made at start-up by ``trustme`` (ECDSA P-256, trustme's
default; the relay's opportunistic ``may`` level does not verify it anyway).
It advertises PIPELINING and answers pipelined commands in order.

It is as small as a sink can be in Python (asyncio streams, no SMTP library)
so that its CPU, measured apart by the harness, stays low; it is still more
than ``smtp-sink``'s (~0.13 ms/msg).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal
import ssl
import sys
import time
from pathlib import Path

READ_LIMIT = 64 * 1024 * 1024  # the largest message line/body readuntil() may buffer
END_OF_DATA = b"\r\n.\r\n"


class SinkServer:
    def __init__(self, dump: Path, hostname: str, tls: ssl.SSLContext | None) -> None:
        self.dump = dump
        self.hostname = hostname
        self.tls = tls
        self.count = 0
        self.sessions = 0
        self.handshakes = 0  # sessions that completed STARTTLS
        self.out = sys.stdout.buffer

    # -- recording --------------------------------------------------------------------
    def record(self, meta: bytes, body: bytes) -> None:
        """One file per transaction; ``cur/`` may have been renamed by the harness."""
        self.count += 1
        name = f"{time.strftime('%H%M%S')}.{os.getpid()}.{self.count}"
        data = meta + body.replace(b"\r\n", b"\n")
        try:
            fd = os.open(self.dump / name, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileNotFoundError:
            self.dump.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.dump / name, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            os.write(fd, data)
        finally:
            os.close(fd)
        self.out.write(b"sess=%d tls=%d mesg=%d\n" % (self.sessions, self.handshakes, self.count))
        self.out.flush()

    # -- one session ------------------------------------------------------------------
    async def session(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.sessions += 1
        with contextlib.suppress(ConnectionError, asyncio.IncompleteReadError, ssl.SSLError):
            await self._converse(reader, writer)
        writer.close()
        with contextlib.suppress(Exception):
            await writer.wait_closed()

    def _ehlo(self, tls_active: bool) -> bytes:
        lines = [self.hostname, "PIPELINING", "8BITMIME", "ENHANCEDSTATUSCODES", "SMTPUTF8"]
        if self.tls is not None and not tls_active:
            lines.append("STARTTLS")
        lines.append("SIZE 0")
        return b"".join(
            f"250{'-' if i < len(lines) - 1 else ' '}{text}\r\n".encode()
            for i, text in enumerate(lines)
        )

    async def _converse(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(f"220 {self.hostname} ESMTP bench sink\r\n".encode())
        tls_info = b"none"
        helo = b""
        mail = b""
        rcpts: list[bytes] = []
        while True:
            line = await reader.readline()
            if not line:
                return
            verb = line[:4].upper()
            arg = line[4:].strip()
            if verb in (b"EHLO", b"HELO"):
                helo, mail, rcpts = arg, b"", []
                ehlo = verb == b"EHLO"
                writer.write(self._ehlo(tls_info != b"none") if ehlo else b"250 ok\r\n")
            elif verb == b"STAR" and line[:8].upper() == b"STARTTLS":
                if self.tls is None or tls_info != b"none":
                    writer.write(b"502 5.5.1 not offered\r\n")
                    continue
                writer.write(b"220 2.0.0 go ahead\r\n")
                await writer.start_tls(self.tls)  # StreamWriter.start_tls: Python 3.11+
                ssl_object = writer.get_extra_info("ssl_object")
                tls_info = f"{ssl_object.version()} {ssl_object.cipher()[0]}".encode()
                self.handshakes += 1
                helo, mail, rcpts = b"", b"", []  # RFC 3207: forget the session state
            elif verb == b"MAIL":
                mail, rcpts = arg, []
                writer.write(b"250 2.1.0 Ok\r\n")
            elif verb == b"RCPT":
                if not mail:
                    writer.write(b"503 5.5.1 MAIL first\r\n")
                    continue
                rcpts.append(arg)
                writer.write(b"250 2.1.5 Ok\r\n")
            elif verb == b"DATA":
                if not rcpts:
                    writer.write(b"503 5.5.1 RCPT first\r\n")
                    continue
                writer.write(b"354 End data with <CR><LF>.<CR><LF>\r\n")
                first = await reader.readline()
                body = b"" if first == b".\r\n" else first + await reader.readuntil(END_OF_DATA)
                self.record(self._meta(tls_info, helo, mail, rcpts), body[:-3])
                mail, rcpts = b"", []
                writer.write(b"250 2.0.0 Ok: queued as %d\r\n" % self.count)
            elif verb == b"RSET":
                mail, rcpts = b"", []
                writer.write(b"250 2.0.0 Ok\r\n")
            elif verb == b"NOOP":
                writer.write(b"250 2.0.0 Ok\r\n")
            elif verb == b"QUIT":
                writer.write(b"221 2.0.0 Bye\r\n")
                await writer.drain()
                return
            else:
                writer.write(b"502 5.5.2 Error: command not recognized\r\n")
            await writer.drain()

    @staticmethod
    def _meta(tls_info: bytes, helo: bytes, mail: bytes, rcpts: list[bytes]) -> bytes:
        """smtp-sink's ``-d`` lines (and ours, X-Client-TLS) in front of the message."""
        head = [
            b"X-Client-Addr: 127.0.0.1",
            b"X-Client-Proto: ESMTP",
            b"X-Client-TLS: " + tls_info,
            b"X-Helo-Args: " + helo,
            b"X-Mail-Args: " + mail,
        ]
        head += [b"X-Rcpt-Args: " + r for r in rcpts]
        return b"\n".join(head) + b"\n"


def server_context(hostname: str) -> ssl.SSLContext:
    """A server context with a fresh certificate for ``hostname`` (trustme, in memory)."""
    import trustme  # only with --starttls

    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    trustme.CA().issue_cert(hostname).configure_cert(ctx)
    return ctx


async def serve(args: argparse.Namespace) -> None:
    host, _, port = args.listen.rpartition(":")
    tls = server_context(args.hostname) if args.starttls else None
    sink = SinkServer(Path(args.dump), args.hostname, tls)
    server = await asyncio.start_server(
        sink.session, host or "127.0.0.1", int(port), limit=READ_LIMIT, backlog=1024
    )
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    async with server:
        await stop.wait()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--listen", required=True, help="HOST:PORT")
    p.add_argument("--dump", required=True, help="directory for one file per message")
    p.add_argument("--hostname", default="sink.bench.local")
    p.add_argument("--starttls", action="store_true", help="offer STARTTLS")
    asyncio.run(serve(p.parse_args()))


if __name__ == "__main__":
    main()
