"""`make run`: set up and start every part of mailrelay in the foreground."""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from django.conf import settings
from django.contrib.auth import get_user_model
from django.core.management import call_command
from django.core.management.base import BaseCommand


class Command(BaseCommand):
    help = "Migrate, create an admin user, then run SMTP ingress, web, worker and beat."

    def add_arguments(self, parser) -> None:
        parser.add_argument("--no-setup", action="store_true", help="skip migrate/admin setup")

    def handle(self, *args, no_setup: bool = False, **options) -> None:
        Path(settings.DATA_DIR).mkdir(parents=True, exist_ok=True)
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
        for addr in settings.MAILRELAY_SMTP_LISTEN:
            self.stdout.write(f"smtp:  listening on {addr}")
        self.stdout.write(f"web:   http://{settings.MAILRELAY_WEB_LISTEN}/admin/")
        self.stdout.write("Ctrl-C stops everything.")

    def _run_all(self) -> None:
        py = sys.executable
        bindir = Path(py).parent
        celery = str(bindir / "celery")
        beat_schedule = str(Path(settings.DATA_DIR) / "celerybeat-schedule")
        commands = {
            "smtp": [py, "manage.py", "runsmtp"],
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
            "worker": [
                celery,
                "-A",
                "mailrelay",
                "worker",
                "--loglevel",
                "INFO",
                "--concurrency",
                str(settings.MAILRELAY_WORKER_CONCURRENCY),
            ],
            "beat": [
                celery,
                "-A",
                "mailrelay",
                "beat",
                "--loglevel",
                "INFO",
                "--schedule",
                beat_schedule,
            ],
        }
        env = os.environ.copy()
        if "PROMETHEUS_MULTIPROC_DIR" not in env:
            # One folder for every process of this node, emptied at start, so /metrics
            # sums the ingress, worker and web counters (docs/metrics.md).
            metrics_dir = Path(settings.DATA_DIR) / "metrics"
            shutil.rmtree(metrics_dir, ignore_errors=True)
            metrics_dir.mkdir(parents=True)
            env["PROMETHEUS_MULTIPROC_DIR"] = str(metrics_dir)
        procs: dict[str, subprocess.Popen] = {}
        stopping = False

        def stop(*_: object) -> None:
            nonlocal stopping
            stopping = True

        signal.signal(signal.SIGINT, stop)
        signal.signal(signal.SIGTERM, stop)
        base = Path(settings.BASE_DIR)
        for name, cmd in commands.items():
            procs[name] = subprocess.Popen(cmd, cwd=base, env=env, start_new_session=True)
        try:
            while not stopping:
                for name, proc in procs.items():
                    if proc.poll() is not None:
                        self.stderr.write(f"{name} exited with {proc.returncode}; stopping all")
                        stopping = True
                        break
                time.sleep(0.5)
        finally:
            for proc in procs.values():
                if proc.poll() is None:
                    proc.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + 15
            for proc in procs.values():
                try:
                    proc.wait(max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    proc.kill()
        self.stdout.write("stopped")
