"""`python manage.py runsmtp`: the inbound SMTP server, in the foreground."""

from __future__ import annotations

import asyncio
import signal

from django.conf import settings
from django.core.exceptions import ImproperlyConfigured
from django.core.management.base import BaseCommand, CommandError

from delivery.backpressure.config import BackPressureConfig
from delivery.backpressure.monitor import Monitor
from delivery.inbound.server import (
    DEFAULT_DB_THREADS,
    InboundConfig,
    InboundServer,
    format_address,
    parse_listen,
    raise_file_limit,
)
from delivery.pickup.watcher import always_allowed, start_pickup


class Command(BaseCommand):
    help = (
        "Accept mail over SMTP on MAILRELAY_SMTP_LISTEN (and submission on "
        "MAILRELAY_SUBMISSION_LISTEN / MAILRELAY_SUBMISSIONS_LISTEN) until SIGINT or SIGTERM."
    )

    def add_arguments(self, parser) -> None:
        parser.add_argument(
            "--listen",
            help="comma list of host:port to listen on instead of MAILRELAY_SMTP_LISTEN",
        )
        parser.add_argument(
            "--db-threads",
            type=int,
            default=DEFAULT_DB_THREADS,
            help=f"database threads committing messages (default {DEFAULT_DB_THREADS})",
        )

    def handle(self, *args, listen: str | None = None, db_threads: int, **options) -> None:
        items = listen.split(",") if listen else settings.MAILRELAY_SMTP_LISTEN
        try:
            addresses = [parse_listen(item) for item in items if item.strip()]
        except ValueError as exc:
            raise CommandError(f"MAILRELAY_SMTP_LISTEN: {exc}") from None
        if not addresses:
            raise CommandError("MAILRELAY_SMTP_LISTEN names no address")
        if db_threads < 1:
            raise CommandError("--db-threads must be at least 1")
        submission = self._listeners("MAILRELAY_SUBMISSION_LISTEN")
        submissions = self._listeners("MAILRELAY_SUBMISSIONS_LISTEN")
        try:
            bp_config = BackPressureConfig.from_settings()
        except ImproperlyConfigured as exc:
            raise CommandError(str(exc)) from None
        try:
            config = InboundConfig.from_settings()
        except (ImproperlyConfigured, OSError, ValueError) as exc:
            raise CommandError(f"TLS certificate: {exc}") from None
        if (submission or submissions) and config.tls is None:
            raise CommandError(
                "MAILRELAY_SUBMISSION(S)_LISTEN needs MAILRELAY_TLS_CERT_FILE and _KEY_FILE"
            )
        listeners = {"submission": submission, "submissions": submissions}
        asyncio.run(self._serve(config, addresses, listeners, db_threads, bp_config))

    @staticmethod
    def _listeners(name: str) -> list[tuple[str, int]]:
        try:
            return [parse_listen(item) for item in getattr(settings, name) if item.strip()]
        except ValueError as exc:
            raise CommandError(f"{name}: {exc}") from None

    async def _serve(
        self,
        config: InboundConfig,
        addresses: list[tuple[str, int]],
        listeners: dict[str, list[tuple[str, int]]],
        db_threads: int,
        bp_config: BackPressureConfig,
    ) -> None:
        # The server starts the monitor before it listens and stops it last.
        monitor = Monitor(bp_config) if bp_config.enabled else None
        self._file_limit(config.max_connections)
        server = InboundServer(config, db_threads=db_threads, monitor=monitor)
        try:
            await server.start(addresses, **listeners)
        except OSError as exc:
            raise CommandError(f"cannot listen: {exc}") from None
        # Pickup and replay folders stop under back pressure and resume by themselves.
        pickup = start_pickup(allowed=monitor.allows_submission if monitor else always_allowed)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(signum, stop.set)
        for kind, bound in server.bound.items():
            label = "" if kind == "smtp" else f" ({kind})"
            for host, port in bound:
                self.stdout.write(f"smtp: listening on {format_address(host, port)}{label}")
        if monitor is not None:
            self.stdout.write(
                f"smtp: back pressure monitored every {bp_config.interval:g}s "
                f"as node {monitor.node}"
            )
        else:
            self.stdout.write("smtp: back pressure off (MAILRELAY_BP_ENABLED=false)")
        self.stdout.flush()
        await stop.wait()
        self.stdout.write("smtp: stopping")
        self.stdout.flush()
        await pickup.stop()
        await server.stop()
        self.stdout.write("smtp: stopped")
        self.stdout.flush()

    def _file_limit(self, max_connections: int) -> None:
        """Make room for MAILRELAY_SMTP_MAX_CONNECTIONS sockets (RLIMIT_NOFILE)."""
        try:
            soft, needed = raise_file_limit(max_connections)
        except (OSError, ValueError) as exc:
            self.stderr.write(f"smtp: cannot raise the open file limit: {exc}")
            return
        if soft < needed:
            # Past the limit accept() fails with EMFILE: asyncio pauses accepting
            # for a second and resumes; open sessions are not affected.
            self.stderr.write(
                f"smtp: open file limit {soft} is below the {needed} that "
                f"MAILRELAY_SMTP_MAX_CONNECTIONS={max_connections} needs (raise the hard limit)"
            )
        else:
            self.stdout.write(f"smtp: open file limit {soft}")
