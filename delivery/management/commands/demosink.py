"""``python manage.py demosink``: a local SMTP server that accepts every message
and prints it, so a first trial delivers without the Internet (README "Try it").

    python manage.py demosink                  # listens on 127.0.0.1:2526
                                               # (the relay itself is on 2525)
    MAILRELAY_SMART_HOST=[127.0.0.1]:2526 make run

Every message is answered ``250 2.0.0 Ok: queued as DEMO<n>`` (the relay's
tracking log records that id) and printed: envelope, size, the first headers.
Nothing is stored. Not for production: it accepts anything from anyone that
can reach its address, so it listens on loopback unless told otherwise.
"""

from __future__ import annotations

import asyncio
import itertools
import signal
from typing import Any

from aiosmtpd.smtp import SMTP, Envelope, Session
from django.core.management.base import BaseCommand, CommandError, CommandParser

from delivery.smtpd.config import parse_listen

DEFAULT_LISTEN = "127.0.0.1:2526"
HEADERS_SHOWN = ("from", "to", "subject", "message-id", "date")
MAX_SIZE = 50 * 1024 * 1024  # larger messages are refused (552): it keeps nothing anyway


class PrintingHandler:
    """aiosmtpd handler: accept, count, print."""

    def __init__(self, write: Any) -> None:
        self.write = write
        self.numbers = itertools.count(1)

    async def handle_DATA(self, server: SMTP, session: Session, envelope: Envelope) -> str:
        number = next(self.numbers)
        data = envelope.original_content or b""
        head = data.split(b"\r\n\r\n", 1)[0].decode("utf-8", "replace")
        lines = [
            f"demosink: message {number} from {session.peer[0]}: "
            f"MAIL FROM:<{envelope.mail_from}> RCPT TO:"
            + ",".join(f"<{r}>" for r in envelope.rcpt_tos)
            + f" ({len(data)} bytes)"
        ]
        for line in head.replace("\r\n ", " ").replace("\r\n\t", " ").split("\r\n"):
            name = line.split(":", 1)[0].strip().lower()
            if name in HEADERS_SHOWN:
                lines.append(f"  {line[:200]}")
        self.write("\n".join(lines))
        return f"250 2.0.0 Ok: queued as DEMO{number}"


class Command(BaseCommand):
    help = "A local SMTP sink that accepts and prints every message (for a first trial)."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument(
            "--listen", default=DEFAULT_LISTEN, help=f"address:port (default {DEFAULT_LISTEN})"
        )

    def handle(self, *args: Any, listen: str, **options: Any) -> None:
        try:
            host, port = parse_listen(listen)
        except ValueError as exc:
            raise CommandError(f"--listen: {exc}") from None
        try:
            asyncio.run(self._serve(host or None, port))
        except OSError as exc:
            raise CommandError(f"cannot listen on {listen}: {exc}") from None

    def _say(self, text: str) -> None:
        self.stdout.write(text)
        self.stdout.flush()  # under a pipe too, each message when it comes

    async def _serve(self, host: str | None, port: int) -> None:
        handler = PrintingHandler(self._say)
        loop = asyncio.get_running_loop()
        server = await loop.create_server(
            lambda: SMTP(handler, hostname="demosink.invalid", data_size_limit=MAX_SIZE),
            host=host,
            port=port,
        )
        stop = asyncio.Event()
        for signum in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(signum, stop.set)
        shown = ", ".join(
            f"[{s.getsockname()[0]}]:{s.getsockname()[1]}" for s in server.sockets or ()
        )
        self._say(
            f"demosink: listening on {shown}; every message is accepted and printed here "
            "(Ctrl-C stops). Point the relay at it: MAILRELAY_SMART_HOST="
            f"[127.0.0.1]:{port}"
        )
        async with server:
            await stop.wait()
        self._say("demosink: stopped")
