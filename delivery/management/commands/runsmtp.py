"""`python manage.py runsmtp`: the inbound SMTP server, in the foreground.

With ``--processes N`` (default MAILRELAY_SMTP_PROCESSES, 0 = one per two
cores) and N > 1, this process only supervises: it starts N children that
each run the whole server on the same ports (SO_REUSEPORT: the kernel spreads
new connections over them), restarts a child that dies (1 s, doubling to
30 s), and on SIGTERM/SIGINT stops them gracefully and waits for them. The
limit on connections in total and the AUTH failures allowed are divided
between the children (each gets its share, rounded down); the per-client
limit is whole in each child (a client's connections land on the children at
random); each child is a back-pressure node of its own. Only the
first child watches the pickup and replay folders. A child dies with its
supervisor (PR_SET_PDEATHSIG): a kill -9 of runsmtp stops them all at once.
A child killed alone takes with it the connections still waiting in its own
accept queue (they are reset; the clients try again); the others go on.
"""

from __future__ import annotations

import asyncio
import ctypes
import dataclasses
import gc
import os
import signal
import socket
import subprocess
import sys
import threading
import time

from django.conf import settings
from django.core.exceptions import ImproperlyConfigured
from django.core.management.base import BaseCommand, CommandError

from delivery.backpressure.config import BackPressureConfig
from delivery.backpressure.monitor import Monitor
from delivery.hostname import hostname_warning
from delivery.pickup.watcher import always_allowed, start_pickup
from delivery.smtpd.config import InboundConfig, format_address, parse_listen, raise_file_limit
from delivery.smtpd.server import DEFAULT_DB_THREADS, InboundServer

RESTART_DELAY = 1.0  # seconds before a dead child is started again; doubles while it keeps dying
RESTART_DELAY_MAX = 30.0
HEALTHY_AFTER = 60.0  # a child that ran this long restarts after RESTART_DELAY again
PR_SET_PDEATHSIG = 1


def default_processes() -> int:
    """MAILRELAY_SMTP_PROCESSES, or one process per two cores this process may run on.

    One ingress process takes about 0.85 ms of CPU per message (bench/README.md
    "#14 ingress"), so it keeps up with 1000+ msg/s on one core; PostgreSQL and
    the workers need the other cores. A second process on a two-core machine
    cost 0.25 ms per message more (smaller group commits, two loops) for 8 %
    more accept rate and no more end to end.
    """
    configured = settings.MAILRELAY_SMTP_PROCESSES
    if configured > 0:
        return configured
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        cores = os.cpu_count() or 1
    return max(1, cores // 2)


def share(total: int, processes: int) -> int:
    """One process's share of a limit (0 = no limit stays 0): rounded down, so the
    processes together never pass the total — except a limit below the number of
    processes, which gives each process 1."""
    return max(1, total // processes) if total > 0 else 0


def freeze_startup_objects() -> None:
    """Take what the process holds once it listens out of the cyclic garbage collector.

    Django, Celery, the models and the server's own objects live as long as
    the process, yet every full collection walked them all (some 140,000
    objects): about a tenth of the ingress's CPU per message, and a pause of
    the event loop of 0.1-0.2 s each time. ``gc.freeze`` moves them to the
    permanent generation, so collections walk only what sessions allocate.
    Unreachable cycles are collected first, so no garbage is frozen with them.
    """
    gc.collect()
    gc.freeze()


def die_with_parent(supervisor: int | None) -> None:
    """Linux: SIGKILL this process when its parent (the supervisor) dies.

    ``supervisor`` is the pid the supervisor gave us: a parent other than it
    means it died before prctl (we were re-parented). Not "parent is 1": in a
    container the supervisor itself is often pid 1.
    """
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):  # not Linux
        return
    if supervisor is not None and os.getppid() != supervisor:
        raise SystemExit("smtp: the supervising runsmtp is gone")


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
            help=f"database threads (AUTH, account rates); up to two of them commit "
            f"messages (default {DEFAULT_DB_THREADS})",
        )
        parser.add_argument(
            "--processes",
            type=int,
            default=None,
            help="server processes sharing the ports (default MAILRELAY_SMTP_PROCESSES, "
            "0 = one per two cores)",
        )
        # Set by the supervisor for its children only.
        parser.add_argument("--child", type=int, default=None, help="(internal) child index")
        parser.add_argument("--child-of", type=int, default=1, help="(internal) processes")
        parser.add_argument("--supervisor", type=int, default=None, help="(internal) its pid")
        parser.add_argument("--submission-listen", default=None, help="(internal)")
        parser.add_argument("--submissions-listen", default=None, help="(internal)")
        parser.add_argument(
            "--no-hostname-warning", action="store_true", help="(internal) runall warned already"
        )

    def handle(
        self,
        *args,
        listen: str | None = None,
        db_threads: int,
        processes: int | None = None,
        child: int | None = None,
        child_of: int = 1,
        supervisor: int | None = None,
        submission_listen: str | None = None,
        submissions_listen: str | None = None,
        **options,
    ) -> None:
        warning = hostname_warning(settings.MAILRELAY_HOSTNAME)
        if warning and child is None and not options.get("no_hostname_warning"):
            self.stderr.write(warning)  # once: the children of this process do not repeat it
        items = listen.split(",") if listen else settings.MAILRELAY_SMTP_LISTEN
        try:
            addresses = [parse_listen(item) for item in items if item.strip()]
        except ValueError as exc:
            raise CommandError(f"MAILRELAY_SMTP_LISTEN: {exc}") from None
        if not addresses:
            raise CommandError("MAILRELAY_SMTP_LISTEN names no address")
        if db_threads < 1:
            raise CommandError("--db-threads must be at least 1")
        processes = default_processes() if processes is None or processes <= 0 else processes
        submission = self._listeners("MAILRELAY_SUBMISSION_LISTEN", submission_listen)
        submissions = self._listeners("MAILRELAY_SUBMISSIONS_LISTEN", submissions_listen)
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
        if child is None and processes > 1:
            self._supervise(processes, addresses, listeners, db_threads)
            return
        pickup = True
        if child is not None:
            die_with_parent(supervisor)
            pickup = child == 0
            config = dataclasses.replace(
                config,
                max_connections=share(config.max_connections, child_of),
                # One client's connections land on the processes at random (the
                # kernel's SO_REUSEPORT hash): a share per process would refuse a
                # client below its limit. Each process keeps the whole per-client
                # limit (the total above still holds). AUTH failures count in the
                # cache, shared by all; with the cache down each process counts
                # its share (authlimit): a guesser gets no more tries either way.
                processes=child_of,
            )
            if settings.MAILRELAY_NODE_NAME:  # the default (hostname:pid) is unique already
                bp_config = dataclasses.replace(bp_config, node=f"{bp_config.node}/{child}")
        asyncio.run(
            self._serve(
                config,
                addresses,
                listeners,
                db_threads,
                bp_config,
                reuse_port=child is not None,
                pickup=pickup,
            )
        )

    @staticmethod
    def _listeners(name: str, override: str | None = None) -> list[tuple[str, int]]:
        items = override.split(",") if override is not None else getattr(settings, name)
        try:
            return [parse_listen(item) for item in items if item.strip()]
        except ValueError as exc:
            raise CommandError(f"{name}: {exc}") from None

    async def _serve(
        self,
        config: InboundConfig,
        addresses: list[tuple[str, int]],
        listeners: dict[str, list[tuple[str, int]]],
        db_threads: int,
        bp_config: BackPressureConfig,
        *,
        reuse_port: bool = False,
        pickup: bool = True,
    ) -> None:
        # The server starts the monitor before it listens and stops it last.
        monitor = Monitor(bp_config) if bp_config.enabled else None
        self._file_limit(config.max_connections)
        server = InboundServer(
            config, db_threads=db_threads, monitor=monitor, reuse_port=reuse_port
        )
        try:
            await server.start(addresses, **listeners)
        except OSError as exc:
            raise CommandError(f"cannot listen: {exc}") from None
        # Pickup and replay folders stop under back pressure and resume by themselves.
        watcher = (
            start_pickup(allowed=monitor.allows_submission if monitor else always_allowed)
            if pickup
            else None
        )
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
        freeze_startup_objects()
        await stop.wait()
        self.stdout.write("smtp: stopping")
        self.stdout.flush()
        if watcher is not None:
            await watcher.stop()
        await server.stop()
        self.stdout.write("smtp: stopped")
        self.stdout.flush()

    # --- the supervisor of --processes N

    def _supervise(
        self,
        processes: int,
        addresses: list[tuple[str, int]],
        listeners: dict[str, list[tuple[str, int]]],
        db_threads: int,
    ) -> None:
        """Start ``processes`` children on the same ports; restart the dead; stop them all."""
        # Port 0 becomes one real port for every child: a socket bound here with
        # SO_REUSEPORT (never listening, so it takes no connection) reserves it.
        reserved: list[socket.socket] = []
        try:
            smtp = [self._reserve(host, port, reserved) for host, port in addresses]
            kinds = {k: [self._reserve(h, p, reserved) for h, p in v] for k, v in listeners.items()}
        except OSError as exc:
            for sock in reserved:
                sock.close()
            raise CommandError(f"cannot listen: {exc}") from None
        argv = self._child_argv(smtp, kinds, db_threads, processes)
        stopping = threading.Event()

        def on_signal(signum: int, _frame: object) -> None:
            stopping.set()

        for signum in (signal.SIGINT, signal.SIGTERM):
            signal.signal(signum, on_signal)
        self.stdout.write(f"smtp: {processes} processes sharing the ports")
        self.stdout.flush()
        children: dict[int, subprocess.Popen] = {}
        started: dict[int, float] = {}
        delay = {i: RESTART_DELAY for i in range(processes)}
        due: dict[int, float] = {i: 0.0 for i in range(processes)}  # when to (re)start child i
        try:
            while not stopping.is_set():
                now = time.monotonic()
                for i, when in list(due.items()):
                    if now >= when:
                        del due[i]
                        children[i] = subprocess.Popen(argv + ["--child", str(i)])
                        started[i] = now
                for i, proc in list(children.items()):
                    code = proc.poll()
                    if code is None:
                        continue
                    del children[i]
                    if stopping.is_set():
                        break  # stopped with the supervisor (a signal to the whole group)
                    if time.monotonic() - started[i] >= HEALTHY_AFTER:
                        delay[i] = RESTART_DELAY
                    how = f"signal {signal.Signals(-code).name}" if code < 0 else f"status {code}"
                    self.stderr.write(
                        f"smtp: process {i} (pid {proc.pid}) exited with {how}; "
                        f"restarting in {delay[i]:g}s"
                    )
                    due[i] = time.monotonic() + delay[i]
                    delay[i] = min(delay[i] * 2, RESTART_DELAY_MAX)
                stopping.wait(0.2)
        finally:
            self.stdout.write("smtp: stopping")
            self.stdout.flush()
            for proc in children.values():
                if proc.poll() is None:
                    proc.send_signal(signal.SIGTERM)
            for proc in children.values():
                try:
                    proc.wait()
                except KeyboardInterrupt:  # a second Ctrl-C: do not wait for the grace time
                    proc.kill()
            for sock in reserved:
                sock.close()
            self.stdout.write("smtp: stopped")
            self.stdout.flush()

    @staticmethod
    def _reserve(host: str, port: int, reserved: list[socket.socket]) -> tuple[str, int]:
        if port != 0:
            return host, port
        infos = socket.getaddrinfo(
            host or None, 0, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )
        family, kind, proto, _name, address = infos[0]
        sock = socket.socket(family, kind, proto)
        reserved.append(sock)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind(address)
        return host, sock.getsockname()[1]

    @staticmethod
    def _child_argv(
        smtp: list[tuple[str, int]],
        kinds: dict[str, list[tuple[str, int]]],
        db_threads: int,
        processes: int,
    ) -> list[str]:
        script = sys.argv[0]
        if os.path.basename(script) == "manage.py":
            base = [sys.executable, script]
        else:
            base = [sys.executable, "-m", "django"]
        joined = {k: ",".join(format_address(h, p) for h, p in v) for k, v in kinds.items()}
        return base + [
            "runsmtp",
            "--listen",
            ",".join(format_address(h, p) for h, p in smtp),
            "--submission-listen",
            joined.get("submission", ""),
            "--submissions-listen",
            joined.get("submissions", ""),
            "--db-threads",
            str(db_threads),
            "--child-of",
            str(processes),
            "--supervisor",
            str(os.getpid()),
        ]

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
