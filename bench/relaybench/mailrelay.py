"""mailrelay under test: a fresh database, ``runsmtp`` and a Celery worker.

Set-up: ``DROP DATABASE mailrelay_bench`` / ``CREATE DATABASE``, ``manage.py
migrate``, Redis database 13 flushed. Processes (as ``make run`` starts them,
see mailrelay/management/commands/runall.py; each in its own process group,
logs in the run's temporary directory):

- ``python manage.py runsmtp`` with MAILRELAY_SMTP_LISTEN=127.0.0.1:<port>;
- ``celery -A mailrelay worker --concurrency N`` (and ``celery beat`` only
  with ``--beat``),
- with ``--compose`` (``web``), every process docker-compose.yml runs: also
  the web app (``gunicorn mailrelay.wsgi --workers 3``, as docker-compose.yml,
  on a loopback port) and ``celery beat``,

all with MAILRELAY_SMART_HOST=[127.0.0.1]:<sink port>,
MAILRELAY_HOSTNAME=bench.local, DATABASE_URL and CELERY_BROKER_URL.

With ``dkim`` ("rsa" or "ed25519", ``--dkim``) a key for the sender's domain
is made with ``manage.py dkim generate <domain> --selector bench [--ed25519]
--dir <run dir>/dkim`` and the relay starts with MAILRELAY_DKIM_KEYS_DIR
pointing there, so ``runsmtp`` signs every message at accept.

Between phases the message tables are emptied (TRUNCATE; queues and links
stay) so every phase starts from the same state; ``verify`` reads the
database directly with psycopg.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil
import psycopg
import redis
import yaml

from .procmon import postgres_labels, process_group_labels
from .util import Procs, free_port, wait_port

# Two benches side by side (e.g. two people tuning) need their own database and
# Redis database: MAILRELAY_BENCH_DB_NAME, MAILRELAY_BENCH_REDIS_DB.
DB_NAME = os.environ.get("MAILRELAY_BENCH_DB_NAME", "mailrelay_bench")
PG_ADMIN_URL = "postgresql://postgres@127.0.0.1:5432/postgres"
DB_URL = f"postgres://postgres@127.0.0.1:5432/{DB_NAME}"
REDIS_URL = f"redis://127.0.0.1:6379/{os.environ.get('MAILRELAY_BENCH_REDIS_DB', '13')}"
DKIM_ALGORITHMS = ("none", "rsa", "ed25519")
DKIM_SELECTOR = "bench"
MESSAGE_TABLES = (
    "queues_attempt",
    "queues_event",
    "queues_recipient",
    "queues_message",
    "queues_messagetext",
)
PG_STATS = (
    "sessions",
    "xact_commit",
    "xact_rollback",
    "tup_inserted",
    "tup_updated",
    "tup_deleted",
)
_TASK_DONE = re.compile(
    rb"Task delivery\.tasks\.(\w+)\[[^\]]*\] succeeded in ([0-9.]+)s: "
    rb"(\S+)"
)


def pg_stats() -> dict[str, int]:
    """pg_stat_database counters of the bench database (read from the admin database).

    PostgreSQL 15 backends flush their counters at most once a second and
    when they exit: read these a little after the work is done.
    """
    cols = ", ".join(PG_STATS)
    with psycopg.connect(PG_ADMIN_URL, autocommit=True) as conn:
        row = conn.execute(
            f"SELECT {cols} FROM pg_stat_database WHERE datname = %s", (DB_NAME,)
        ).fetchone()
        # The whole cluster's WAL (only the bench's database is busy during its
        # phase): every row and index entry written is a WAL record, the
        # machine-independent measure of what the store's writes cost.
        wal = conn.execute("SELECT wal_records, wal_bytes FROM pg_stat_wal").fetchone()
    stats = dict(zip(PG_STATS, (int(v or 0) for v in row), strict=True)) if row else {}
    if stats and wal:
        stats.update(wal_records=int(wal[0] or 0), wal_bytes=int(wal[1] or 0))
    return stats


@dataclass
class DbCheck:
    messages: int
    not_done: int
    recipients: int
    delivered: int
    not_delivered_states: dict[str, int]
    attempts_delivered: int
    attempts_other: int
    # seconds from received_at to the recipient's final_at (in-relay delay)
    delay_p50: float | None
    delay_p99: float | None
    received_first: float | None  # epoch seconds
    received_last: float | None
    final_last: float | None

    # activity during the phase (pg_stat_database deltas, Celery task log)
    pg: dict[str, int] = field(default_factory=dict)
    tasks: dict[str, tuple[int, int, float]] = field(default_factory=dict)  # n, items, secs

    def ok(self, expected: int) -> bool:
        return (
            self.messages == expected
            and self.not_done == 0
            and self.recipients == expected
            and self.delivered == expected
            and self.attempts_delivered == expected
        )


def compose_web_command(repo: Path, bindir: Path, port: int) -> list[str]:
    """docker-compose.yml's ``web`` command as it is written there (gunicorn,
    its workers), run from this virtualenv and bound to a loopback ``port``."""
    services = yaml.safe_load((repo / "docker-compose.yml").read_text())["services"]
    cmd = list(services["web"]["command"])
    cmd[0] = str(bindir / cmd[0])
    cmd[cmd.index("--bind") + 1] = f"127.0.0.1:{port}"
    return cmd


class Mailrelay:
    def __init__(
        self,
        repo: Path,
        procs: Procs,
        run_dir: Path,
        port: int,
        sink_port: int,
        worker_concurrency: int,
        beat: bool,
        workers: str = "make-run",
        web: bool = False,
    ) -> None:
        self.repo = repo
        self.procs = procs
        self.run_dir = run_dir
        self.port = port
        self.sink_port = sink_port
        self.worker_concurrency = worker_concurrency
        self.beat = beat
        self.smtp: subprocess.Popen[bytes] | None = None
        self.worker: subprocess.Popen[bytes] | None = None
        # "make-run": the workers `make run` starts (runall's commands, its
        # defaults); "single": one prefork worker on every queue (--worker-concurrency).
        self.workers_mode = workers
        self.workers: dict[str, subprocess.Popen[bytes]] = {}
        self.beat_proc: subprocess.Popen[bytes] | None = None
        self.web = web
        self.web_port = free_port() if web else 0
        self.web_proc: subprocess.Popen[bytes] | None = None
        self._conn: psycopg.Connection[Any] | None = None
        self.python = Path(sys.executable)
        self.bindir = self.python.parent
        self.env = {
            **os.environ,
            "DATABASE_URL": DB_URL,
            "CELERY_BROKER_URL": REDIS_URL,
            "MAILRELAY_SMTP_LISTEN": f"127.0.0.1:{port}",
            "MAILRELAY_SMART_HOST": f"[127.0.0.1]:{sink_port}",
            "MAILRELAY_HOSTNAME": "bench.local",
            "MAILRELAY_DATA_DIR": str(run_dir / "var"),
            "DJANGO_SETTINGS_MODULE": "mailrelay.settings",
            "PYTHONUNBUFFERED": "1",
        }
        if web:  # docker-compose's .env gives every process the web app's key
            self.env.setdefault("DJANGO_SECRET_KEY", secrets.token_urlsafe(50))

    # -- set-up -----------------------------------------------------------------------
    def use_dkim(self, algorithm: str, domain: str) -> Path | None:
        """Generate a ``algorithm`` key for ``domain`` and have the relay sign with it.

        Call before ``start``; returns the key file (None for "none").
        """
        if algorithm not in DKIM_ALGORITHMS:
            raise ValueError(f"unknown DKIM algorithm {algorithm!r}")
        if algorithm == "none":
            return None
        keys = self.run_dir / "dkim"
        cmd = [str(self.python), "manage.py", "dkim", "generate", domain]
        cmd += ["--selector", DKIM_SELECTOR, "--dir", str(keys)]
        if algorithm == "ed25519":
            cmd.append("--ed25519")
        out = subprocess.run(
            cmd, cwd=self.repo, env=self.env, capture_output=True, text=True, timeout=120
        )
        if out.returncode != 0:
            raise RuntimeError(f"manage.py dkim generate failed:\n{out.stdout}\n{out.stderr}")
        files = sorted(keys.glob(f"*.{DKIM_SELECTOR}.key"))
        if not files:
            raise RuntimeError(f"manage.py dkim generate wrote no key into {keys}")
        self.env["MAILRELAY_DKIM_KEYS_DIR"] = str(keys)
        return files[0]

    def prepare_database(self) -> None:
        with psycopg.connect(PG_ADMIN_URL, autocommit=True, connect_timeout=5) as conn:
            conn.execute(f"DROP DATABASE IF EXISTS {DB_NAME} WITH (FORCE)")
            conn.execute(f"CREATE DATABASE {DB_NAME}")
        out = subprocess.run(
            [str(self.python), "manage.py", "migrate", "--noinput", "-v", "0"],
            cwd=self.repo,
            env=self.env,
            capture_output=True,
            text=True,
            timeout=300,
        )
        if out.returncode != 0:
            raise RuntimeError(f"manage.py migrate failed:\n{out.stdout}\n{out.stderr}")
        r = redis.Redis.from_url(REDIS_URL)
        try:
            r.flushdb()
        finally:
            r.close()

    def start(self) -> None:
        logs = self.run_dir
        self.smtp = self.procs.spawn(
            "runsmtp",
            [str(self.python), "manage.py", "runsmtp"],
            cwd=self.repo,
            env=self.env,
            stdout=logs / "runsmtp.log",
            stderr=subprocess.STDOUT,
            grace=35,
        )
        celery = str(self.bindir / "celery")
        worker_log = logs / "worker.log"
        if self.workers_mode == "make-run":
            commands = self.make_run_workers()
        else:
            commands = {
                "worker": [
                    *(celery, "-A", "mailrelay", "worker", "--loglevel", "INFO"),
                    *("--concurrency", str(self.worker_concurrency), "-n", "bench@%h"),
                ]
            }
        for name, cmd in commands.items():
            self.workers[name] = self.procs.spawn(
                f"celery {name}",
                cmd,
                cwd=self.repo,
                env=self.env,
                grace=20,
                stdout=worker_log,
                stderr=subprocess.STDOUT,
            )
        self.worker = next(iter(self.workers.values()))
        if self.beat:
            self.beat_proc = self.procs.spawn(
                "celery beat",
                [
                    celery,
                    "-A",
                    "mailrelay",
                    "beat",
                    "--loglevel",
                    "INFO",
                    "--schedule",
                    str(self.run_dir / "celerybeat-schedule"),
                ],
                cwd=self.repo,
                env=self.env,
                grace=10,
                stdout=logs / "beat.log",
                stderr=subprocess.STDOUT,
            )
        if self.web:
            self.web_proc = self.procs.spawn(
                "gunicorn",
                compose_web_command(self.repo, self.bindir, self.web_port),
                cwd=self.repo,
                env=self.env,
                grace=10,
                stdout=logs / "web.log",
                stderr=subprocess.STDOUT,
            )
            wait_port(self.web_port, 60, self.web_proc)
        wait_port(self.port, 60, self.smtp)
        deadline = time.monotonic() + 60
        while worker_log.read_bytes().count(b" ready.") < len(self.workers):
            for name, proc in self.workers.items():
                if proc.poll() is not None:
                    raise RuntimeError(
                        f"celery {name} exited with {proc.returncode}; see {worker_log}"
                    )
            if time.monotonic() > deadline:
                raise RuntimeError(f"the celery worker is not ready after 60 s; see {worker_log}")
            time.sleep(0.1)

    def db(self) -> psycopg.Connection[Any]:
        """The harness's one connection to the bench database (autocommit)."""
        if self._conn is None or self._conn.closed:
            self._conn = psycopg.connect(
                DB_URL.replace("postgres://", "postgresql://"), autocommit=True
            )
        return self._conn

    def stop(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None
        for proc in (self.web_proc, self.beat_proc, *self.workers.values(), self.smtp):
            if proc is not None:
                self.procs.stop(proc)

    def alive(self) -> list[str]:
        dead = []
        named = [("runsmtp", self.smtp), *((f"celery {n}", p) for n, p in self.workers.items())]
        if self.web:
            named.append(("web (gunicorn)", self.web_proc))
        if self.beat:
            named.append(("celery beat", self.beat_proc))
        for name, proc in named:
            if proc is None or proc.poll() is not None:
                dead.append(name)
        return dead

    # -- between phases ---------------------------------------------------------------
    def reset_messages(self) -> None:
        self.db().execute(f"TRUNCATE {', '.join(MESSAGE_TABLES)} RESTART IDENTITY CASCADE")

    def wait_all_done(self, expected: int, timeout: float) -> DbCheck:
        deadline = time.monotonic() + timeout
        while True:
            check = self.verify()
            if check.ok(expected) or time.monotonic() > deadline:
                return check
            time.sleep(0.2)

    def verify(self) -> DbCheck:
        conn = self.db()
        with conn.transaction():
            one = conn.execute(
                "SELECT count(*), count(*) FILTER (WHERE state <> 'done'),"
                " extract(epoch FROM min(received_at)), extract(epoch FROM max(received_at))"
                " FROM queues_message"
            ).fetchone()
            assert one is not None
            states = dict(
                conn.execute(
                    "SELECT state, count(*) FROM queues_recipient GROUP BY state"
                ).fetchall()
            )
            att = dict(
                conn.execute(
                    "SELECT outcome, count(*) FROM queues_attempt GROUP BY outcome"
                ).fetchall()
            )
            delays = conn.execute(
                "SELECT percentile_cont(0.5) WITHIN GROUP (ORDER BY d),"
                " percentile_cont(0.99) WITHIN GROUP (ORDER BY d),"
                " extract(epoch FROM max(f))"
                " FROM (SELECT extract(epoch FROM r.final_at - m.received_at) AS d,"
                "        r.final_at AS f"
                "       FROM queues_recipient r JOIN queues_message m ON m.id = r.message_id"
                "       WHERE r.final_at IS NOT NULL) x"
            ).fetchone()
            assert delays is not None
        delivered = states.get("delivered", 0)
        return DbCheck(
            messages=one[0],
            not_done=one[1],
            recipients=sum(states.values()),
            delivered=delivered,
            not_delivered_states={k: v for k, v in states.items() if k != "delivered"},
            attempts_delivered=att.get("delivered", 0),
            attempts_other=sum(v for k, v in att.items() if k != "delivered"),
            delay_p50=float(delays[0]) if delays[0] is not None else None,
            delay_p99=float(delays[1]) if delays[1] is not None else None,
            received_first=float(one[2]) if one[2] is not None else None,
            received_last=float(one[3]) if one[3] is not None else None,
            final_last=float(delays[2]) if delays[2] is not None else None,
        )

    # -- activity counters ------------------------------------------------------------
    def pg_stats(self) -> dict[str, int]:
        return pg_stats()

    def worker_log_offset(self) -> int:
        try:
            return (self.run_dir / "worker.log").stat().st_size
        except OSError:
            return 0

    def tasks_since(self, offset: int) -> dict[str, tuple[int, int, float]]:
        """Celery tasks that finished since ``offset`` of worker.log: name -> (n, items, s)."""
        with open(self.run_dir / "worker.log", "rb") as fh:
            fh.seek(offset)
            text = fh.read()
        out: dict[str, tuple[int, int, float]] = {}
        for name, secs, result in _TASK_DONE.findall(text):
            n, items, total = out.get(name.decode(), (0, 0, 0.0))
            m = re.match(rb"\d+", result)
            out[name.decode()] = (n + 1, items + (int(m.group()) if m else 0), total + float(secs))
        return out

    # -- monitoring -------------------------------------------------------------------
    def labels(self, postmaster: psutil.Process | None) -> dict[int, str]:
        out: dict[int, str] = {}
        out.update(process_group_labels(self.smtp.pid if self.smtp else None, "mailrelay:runsmtp"))
        for name, proc in self.workers.items():
            out[proc.pid] = f"mailrelay:celery {name} (main)"
            try:
                for child in psutil.Process(proc.pid).children(recursive=True):
                    out[child.pid] = f"mailrelay:celery {name} (pool children)"
            except psutil.Error:
                pass
        out.update(
            process_group_labels(
                self.beat_proc.pid if self.beat_proc else None, "mailrelay:celery beat"
            )
        )
        out.update(
            process_group_labels(
                self.web_proc.pid if self.web_proc else None, "mailrelay:web (gunicorn)"
            )
        )
        out.update(postgres_labels(postmaster, DB_NAME, "mailrelay"))
        return out

    def make_run_workers(self) -> dict[str, list[str]]:
        """The celery workers exactly as `make run` starts them (runall's own
        commands, with this environment's settings)."""
        code = (
            "import json; from mailrelay.management.commands.runall import Command; "
            "print(json.dumps({k: v for k, v in Command()._commands().items() "
            "if k.startswith('worker-')}))"
        )
        out = subprocess.run(
            [str(self.python), "manage.py", "shell", "-c", code],
            cwd=self.repo,
            env=self.env,
            capture_output=True,
            check=True,
        )
        return json.loads(out.stdout.decode().strip().splitlines()[-1])

    def pids(self) -> dict[str, int]:
        out = {}
        if self.smtp is not None:
            out["runsmtp"] = self.smtp.pid
        # every celery worker: "worker" (--workers single) or worker-control,
        # worker-delivery, worker-webhooks (make run's)
        for name, proc in self.workers.items():
            out[name] = proc.pid
        return out
