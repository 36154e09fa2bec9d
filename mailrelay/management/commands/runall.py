"""`make run`: set up and start every part of mailrelay in the foreground.

Each part runs as a child process in a session of its own. A child that dies
is started again after a back-off (1 s, doubling to 60 s; back to 1 s once it
has run for a minute), and the console says so. Ctrl-C or SIGTERM stops them
all.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from django.conf import settings
from django.contrib.auth import get_user_model
from django.core.management import call_command
from django.core.management.base import BaseCommand

from delivery.hostname import hostname_warning
from mailrelay.secret_key import ensure_key_file


class Command(BaseCommand):
    help = (
        "Migrate, create an admin user, then run and supervise SMTP ingress, web, "
        "the control and delivery workers and beat."
    )

    def add_arguments(self, parser) -> None:
        parser.add_argument("--no-setup", action="store_true", help="skip migrate/admin setup")

    def handle(self, *args, no_setup: bool = False, **options) -> None:
        Path(settings.DATA_DIR).mkdir(parents=True, exist_ok=True)
        if settings.MAILRELAY_SECRET_KEY_MISSING:
            # No DJANGO_SECRET_KEY: a local one, generated once and kept under
            # the data folder (every child reads it from there), as for the
            # admin password. Production sets DJANGO_SECRET_KEY (README).
            path, created = ensure_key_file(Path(settings.DATA_DIR))
            if created:
                self.stdout.write(f"secret key: generated and kept in {path}")
        if not settings.DATABASE_URL:
            for folder in ("processed", "control"):
                (Path(settings.DATA_DIR) / "broker" / folder).mkdir(parents=True, exist_ok=True)
        if not no_setup:
            call_command("migrate", interactive=False, verbosity=0)
            call_command("collectstatic", interactive=False, verbosity=0)
            self._ensure_admin()
        self._describe()
        self._run_all()

    def _ensure_admin(self) -> None:
        User = get_user_model()
        if User.objects.filter(is_superuser=True).exists():
            self.stdout.write(
                "admin: an administrator exists (reset a password with "
                "`python manage.py changepassword admin`)"
            )
            return
        password = secrets.token_urlsafe(12)
        User.objects.create_superuser("admin", "", password)
        secret = Path(settings.DATA_DIR) / "admin-password.txt"
        secret.write_text(password + "\n")
        secret.chmod(0o600)
        self.stdout.write(
            self.style.SUCCESS(f"admin: created user 'admin' with password {password!r}")
            + f" (also in {secret})"
        )

    def _describe(self) -> None:
        db = (
            "PostgreSQL"
            if settings.DATABASE_URL
            else f"SQLite ({settings.DATABASES['default']['NAME']})"
        )
        broker = (
            "Redis"
            if settings.CELERY_BROKER_URL.startswith("redis")
            else settings.CELERY_BROKER_URL.split(":")[0]
        )
        self.stdout.write(f"database: {db}; broker: {broker}")
        warning = hostname_warning(settings.MAILRELAY_HOSTNAME)
        if warning:  # once here: the smtp child is told not to repeat it
            self.stderr.write(self.style.WARNING(warning))
        for addr in settings.MAILRELAY_SMTP_LISTEN:
            self.stdout.write(f"smtp:  listening on {addr}")
        web = f"http://{settings.MAILRELAY_WEB_LISTEN}"
        self.stdout.write(f"Queue Viewer: {web}/  (log in as admin)")
        self.stdout.write(f"API docs:     {web}/api/docs/")
        self.stdout.write(f"admin:        {web}/admin/")
        self.stdout.write("Ctrl-C stops everything.")

    def _commands(self) -> dict[str, list[str]]:
        py = sys.executable
        bindir = Path(py).parent
        celery = str(bindir / "celery")
        beat_schedule = str(Path(settings.DATA_DIR) / "celerybeat-schedule")
        return {
            "smtp": [py, "manage.py", "runsmtp", "--no-hostname-warning"],
            "web": [
                str(bindir / "gunicorn"),
                "mailrelay.wsgi",
                "--bind",
                settings.MAILRELAY_WEB_LISTEN,
                "--workers",
                "2",
                "--access-logfile",
                "-",
            ],
            # Routing and the sweep: short database work, a few processes.
            "worker-control": [
                *(celery, "-A", "mailrelay", "worker", "-n", "control@%h", "-Q", "control"),
                *("--loglevel", "INFO"),
                *("--concurrency", str(settings.MAILRELAY_WORKER_CONCURRENCY)),
            ],
            # Deliveries wait on peers for up to their timeouts: a thread each.
            "worker-delivery": [
                *(celery, "-A", "mailrelay", "worker", "-n", "delivery@%h", "-Q", "delivery"),
                *("--pool", "threads", "--loglevel", "INFO"),
                *("--concurrency", str(settings.MAILRELAY_DELIVERY_CONCURRENCY)),
            ],
            # Webhooks (tracking.sender): a few threads, apart from mail.
            "worker-webhooks": [
                *(celery, "-A", "mailrelay", "worker", "-n", "webhooks@%h", "-Q", "webhooks"),
                *("--pool", "threads", "--loglevel", "INFO"),
                *("--concurrency", str(settings.MAILRELAY_WEBHOOK_CONCURRENCY)),
            ],
            "beat": [
                *(celery, "-A", "mailrelay", "beat", "--loglevel", "INFO"),
                *("--schedule", beat_schedule),
            ],
        }

    def _child_env(self) -> dict[str, str]:
        env = os.environ.copy()
        if "PROMETHEUS_MULTIPROC_DIR" not in env:
            # One folder for every process of this node, emptied at start, so /metrics
            # sums the ingress, worker and web counters (docs/metrics.md).
            metrics_dir = Path(settings.DATA_DIR) / "metrics"
            shutil.rmtree(metrics_dir, ignore_errors=True)
            metrics_dir.mkdir(parents=True)
            env["PROMETHEUS_MULTIPROC_DIR"] = str(metrics_dir)
        return env

    def _say(self, text: str, error: bool = False) -> None:
        # Flushed at once: under a pipe (docker, systemd, tests) the console
        # must show a restart when it happens.
        out = self.stderr if error else self.stdout
        out.write(text)
        out.flush()

    def _run_all(self) -> None:
        stopping = threading.Event()

        def stop(*_: object) -> None:
            stopping.set()

        signal.signal(signal.SIGINT, stop)
        signal.signal(signal.SIGTERM, stop)
        supervisor = Supervisor(
            self._commands(), Path(settings.BASE_DIR), self._child_env(), self._say
        )
        try:
            supervisor.start_all()
            while not stopping.is_set():
                supervisor.check()
                stopping.wait(POLL_SECONDS)
        finally:
            supervisor.stop_all()
        self._say("stopped")


POLL_SECONDS = 0.5
BACKOFF_FIRST = 1.0
BACKOFF_MAX = 60.0
# A child that ran this long before it died starts again after BACKOFF_FIRST.
STABLE_AFTER = 60.0
STOP_GRACE = 15.0


def next_backoff(current: float, ran_for: float) -> float:
    """Seconds to wait before starting again a child that died after ``ran_for``
    seconds, when the last wait was ``current`` (0: it never died before)."""
    if current <= 0 or ran_for >= STABLE_AFTER:
        return BACKOFF_FIRST
    return min(current * 2, BACKOFF_MAX)


@dataclass
class Child:
    name: str
    cmd: list[str]
    proc: subprocess.Popen | None = None
    started_at: float = 0.0
    backoff: float = 0.0
    restart_at: float | None = None
    restarts: int = 0


class Supervisor:
    """Start the children, start again one that died (with back-off), stop them all."""

    def __init__(
        self,
        commands: dict[str, list[str]],
        cwd: Path,
        env: dict[str, str],
        say: Callable[..., None],
    ) -> None:
        self.children = [Child(name, cmd) for name, cmd in commands.items()]
        self.cwd = cwd
        self.env = env
        self.say = say

    def start_all(self) -> None:
        for child in self.children:
            self._start(child)

    def _start(self, child: Child) -> None:
        child.proc = subprocess.Popen(child.cmd, cwd=self.cwd, env=self.env, start_new_session=True)
        child.started_at = time.monotonic()
        child.restart_at = None
        self.say(f"{child.name}: started (pid {child.proc.pid})")

    def _restart(self, child: Child, now: float) -> None:
        child.restarts += 1
        try:
            self._start(child)
        except OSError as exc:  # e.g. out of processes: try again later, never give up
            child.backoff = next_backoff(child.backoff, 0)
            child.restart_at = now + child.backoff
            self.say(
                f"{child.name}: could not start ({exc}); retrying in {child.backoff:g}s",
                error=True,
            )

    def check(self) -> None:
        now = time.monotonic()
        for child in self.children:
            if child.restart_at is not None:
                if now >= child.restart_at:
                    self._restart(child, now)
                continue
            assert child.proc is not None
            code = child.proc.poll()
            if code is None:
                continue
            # What a killed parent leaves behind (a prefork worker's pool
            # processes) would hold tasks and connections: end its session.
            _kill_group(child.proc.pid)
            child.backoff = next_backoff(child.backoff, now - child.started_at)
            child.restart_at = now + child.backoff
            self.say(
                f"{child.name} (pid {child.proc.pid}) exited with {_describe_exit(code)}; "
                f"restarting in {child.backoff:g}s",
                error=True,
            )

    def stop_all(self) -> None:
        running = [c.proc for c in self.children if c.proc is not None and c.proc.poll() is None]
        for proc in running:
            proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + STOP_GRACE
        for proc in running:
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                self.say(f"pid {proc.pid} did not stop in {STOP_GRACE:g}s; killing it", error=True)
        for child in self.children:
            if child.proc is not None:
                _kill_group(child.proc.pid)
                child.proc.wait()


def _kill_group(pgid: int) -> None:
    """SIGKILL whatever is left of a child's session (it leads its own group)."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)


def _describe_exit(code: int) -> str:
    if code < 0:
        try:
            return f"signal {signal.Signals(-code).name}"
        except ValueError:
            return f"signal {-code}"
    return f"code {code}"
