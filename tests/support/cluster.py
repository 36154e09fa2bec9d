"""A whole relay on private services, for fault tests and benchmarks.

``Cluster`` starts mailrelay the way an operator runs it, at the DEFAULT
settings except addresses, ports and the route:

- a PRIVATE PostgreSQL cluster (``initdb`` into a temporary folder, run as the
  ``postgres`` user when we are root; default durability, only a small
  ``shared_buffers``) and a PRIVATE ``redis-server`` (default persistence),
  each on a free port, so they can be killed and restarted without touching
  the shared services on 5432 / 6379;
- ``manage.py migrate``, then the relay's processes exactly as ``runall``
  (``make run``) starts them: the commands and the environment are taken from
  ``runall`` itself (its ``_commands()`` and ``_child_env()``; for an older
  ``runall``, its ``_run_all`` with ``subprocess.Popen`` replaced by a
  recorder), minus the web app, all started at once as ``runall`` starts
  them (``stop`` sends each its SIGTERM at once too). Each runs in its own
  process group, with its output in ``<workdir>/logs/<name>.log``;
  ``delivery_worker`` names the one that consumes the ``delivery`` queue (or
  the only worker);
- a recording SMTP sink (``tests.support.sinks.Sink``, aiosmtpd) as the smart
  host; it keeps every message, so copies are counted by ``Message-ID``.

``root`` is the source tree the relay runs from (this checkout by default;
the benchmarks pass an extracted older commit): every child runs with that
``cwd`` and ``PYTHONPATH``, so it imports that tree's code, with this
checkout's virtualenv.

Faults: ``kill(name)`` (SIGKILL to a process group) and ``start_process(name)``
(a fresh one, as a supervisor would), ``restart_postgres()`` (an immediate
stop, i.e. crash recovery, then start), ``restart_redis()`` (SIGKILL, then a
new server on the same port), ``flush_broker()``.

Mail: ``send(n, clients)`` / ``send_async(...)`` send numbered messages over
SMTP from a few concurrent clients and record which got ``250``;
``wait_delivered(ids, timeout)`` waits on the sink (a condition variable, no
sleeping) until every given ``Message-ID`` arrived; ``copies()`` counts what
arrived per ``Message-ID``; ``in_flight()`` lists the ``Message-ID`` of every
recipient a delivery round holds (``active``) right now.

Used by ``tests/test_faults.py`` and ``bench/faults``/``bench/memory``;
importable without Django settings (it only needs this virtualenv).
``FAULTS_KEEP_CLUSTER=1`` keeps the cluster's folder (logs, data) afterwards.
"""

from __future__ import annotations

import contextlib
import os
import pwd
import re
import secrets
import shutil
import signal
import smtplib
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import psycopg

from tests.support.sinks import Sink, SinkBehaviour, find_free_port

ROOT = Path(__file__).resolve().parents[2]
PYTHON = sys.executable
DB_NAME = "mailrelay"
SENDER = "sender@faults.test"
_MESSAGE_ID = re.compile(rb"^Message-ID:[ \t]*(<[^>\r\n]*>)", re.I | re.M)


# --- small helpers --------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_port(port: int, timeout: float, alive: Callable[[], bool] = lambda: True) -> None:
    """Wait until something accepts connections on 127.0.0.1:``port``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not alive():
            raise RuntimeError(f"the process for port {port} exited before listening")
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 0.5):
            return
        time.sleep(0.05)
    raise RuntimeError(f"nothing listens on 127.0.0.1:{port} after {timeout:.0f} s")


def pg_bindir() -> Path:
    """The folder of ``initdb``/``pg_ctl``: /usr/local/bin, else the newest Debian one."""
    found = shutil.which("pg_ctl")
    if found:
        return Path(found).parent
    candidates = sorted(Path("/usr/lib/postgresql").glob("*/bin/pg_ctl"))
    if not candidates:
        raise RuntimeError("no PostgreSQL server binaries (pg_ctl) found")
    return candidates[-1].parent


def _as_postgres(cmd: list[str]) -> list[str]:
    # PostgreSQL refuses to run as root; the cluster belongs to the postgres user.
    return ["runuser", "-u", "postgres", "--", *cmd] if os.geteuid() == 0 else cmd


def message_id_of(data: bytes) -> str | None:
    head = data.split(b"\r\n\r\n", 1)[0].split(b"\n\n", 1)[0]
    m = _MESSAGE_ID.search(head)
    return m.group(1).decode("ascii", "replace") if m else None


# --- private services -----------------------------------------------------------------


class PrivatePostgres:
    """A PostgreSQL cluster of our own in ``directory``, on a free port."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.data = directory / "data"
        self.log = directory / "postgres.log"
        self.port = free_port()
        self.bindir = pg_bindir()

    @property
    def admin_url(self) -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/postgres"

    def url(self, db: str = DB_NAME) -> str:
        return f"postgres://postgres@127.0.0.1:{self.port}/{db}"

    def _chown(self, path: Path) -> None:
        if os.geteuid() == 0:
            pw = pwd.getpwnam("postgres")
            os.chown(path, pw.pw_uid, pw.pw_gid)

    def init(self) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        self._chown(self.directory)
        subprocess.run(
            _as_postgres(
                [
                    str(self.bindir / "initdb"),
                    "-D",
                    str(self.data),
                    "-U",
                    "postgres",
                    "--auth=trust",
                    "--no-instructions",
                ]
            ),
            check=True,
            capture_output=True,
            text=True,
            timeout=120,
        )
        # Default durability (fsync on: the restart test must be honest); only
        # a smaller memory footprint and our own port and socket folder.
        with open(self.data / "postgresql.conf", "a") as conf:
            conf.write(
                f"\nport = {self.port}\nlisten_addresses = '127.0.0.1'\n"
                f"unix_socket_directories = '{self.directory}'\n"
                "shared_buffers = 32MB\nmax_connections = 200\n"
            )

    def start(self) -> None:
        subprocess.run(
            _as_postgres(
                [str(self.bindir / "pg_ctl"), "-D", str(self.data), "-l", str(self.log)]
                + ["-w", "-t", "60", "start"]
            ),
            check=True,
            capture_output=True,
            timeout=90,
        )

    def stop(self, mode: str = "fast") -> None:
        subprocess.run(
            _as_postgres([str(self.bindir / "pg_ctl"), "-D", str(self.data), "-m", mode, "stop"]),
            capture_output=True,
            timeout=90,
        )

    def restart(self) -> None:
        """An immediate stop (every backend killed, crash recovery at start), then start."""
        self.stop("immediate")
        self.start()

    def create_database(self, name: str = DB_NAME) -> None:
        with psycopg.connect(self.admin_url, autocommit=True, connect_timeout=10) as conn:
            conn.execute(f"CREATE DATABASE {name}")


class PrivateRedis:
    """A redis-server of our own on a free port, default persistence, in ``directory``."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.port = free_port()
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        with open(self.directory / "redis.log", "ab") as log:
            self.proc = subprocess.Popen(
                [
                    shutil.which("redis-server") or "redis-server",
                    "--port",
                    str(self.port),
                    "--bind",
                    "127.0.0.1",
                    "--dir",
                    str(self.directory),
                ],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        proc = self.proc
        wait_port(self.port, 20, lambda: proc.poll() is None)

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    def restart(self) -> None:
        """SIGKILL (what was not yet saved is lost) and a new server on the same port."""
        self.kill()
        self.start()

    def flush(self) -> None:
        import redis

        client = redis.Redis.from_url(self.url)
        try:
            client.flushall()
        finally:
            client.close()


# --- the relay's processes --------------------------------------------------------------


@dataclass
class Command:
    name: str
    argv: list[str]
    env: dict[str, str]


# Run inside the relay's tree: call runall's _run_all with Popen recorded and stop it
# at its first wait; print the commands as JSON. Nothing is started.
_EXTRACT = r"""
import json, subprocess, sys
import django
django.setup()
import mailrelay.management.commands.runall as runall
seen = []
class Stop(Exception):
    pass
def stop(*a, **k):
    raise Stop()
class Recorded:
    # A child that is alive until runall first waits for anything: then we stop.
    returncode = None
    pid = 0
    def __init__(self, cmd, **kw):
        seen.append({"argv": [str(a) for a in cmd], "env": dict(kw.get("env") or {})})
    def poll(self): return None
    wait = communicate = stop
    def send_signal(self, sig): pass
    def terminate(self): pass
    def kill(self): pass
import io
cmd = runall.Command(stdout=io.StringIO(), stderr=io.StringIO())
if hasattr(cmd, "_commands"):
    # runall names its children and builds their environment in two methods.
    env = cmd._child_env()
    seen = [{"name": k, "argv": v, "env": env} for k, v in cmd._commands().items()]
else:
    subprocess.Popen = Recorded
    runall.subprocess.Popen = Recorded
    runall.time.sleep = stop
    try:
        cmd._run_all()
    except Stop:
        pass
sys.__stdout__.write("\nRUNALL-COMMANDS " + json.dumps(seen) + "\n")
"""


def _name_of(argv: Sequence[str], taken: Iterable[str]) -> str | None:
    """A short name for one of runall's children; None for the web app."""
    joined = " ".join(argv)
    if "runsmtp" in argv:
        base = "smtp"
    elif "beat" in argv:
        base = "beat"
    elif "worker" in argv:
        queues = ""
        for flag in ("-Q", "--queues"):
            if flag in argv:
                queues = argv[argv.index(flag) + 1]
        for arg in argv:
            if arg.startswith(("-Q", "--queues=")) and arg not in ("-Q", "--queues"):
                queues = arg.split("=", 1)[-1].removeprefix("-Q")
        base = "worker" if not queues else f"worker-{queues.replace(',', '+')}"
    elif "gunicorn" in joined or "wsgi" in joined:
        return None
    else:
        base = Path(argv[0]).name
    name, n = base, 1
    while name in taken:
        n += 1
        name = f"{base}{n}"
    return name


class Proc:
    """One of the relay's processes, in its own process group, logging to a file."""

    def __init__(self, command: Command, cwd: Path, log: Path) -> None:
        self.command = command
        self.log = log
        with open(log, "ab") as out:
            out.write(f"\n=== start {time.strftime('%H:%M:%S')}: {command.argv}\n".encode())
            out.flush()
            self.popen = subprocess.Popen(
                command.argv,
                cwd=cwd,
                env=command.env,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        self.offset = log.stat().st_size

    @property
    def pid(self) -> int:
        return self.popen.pid

    def alive(self) -> bool:
        return self.popen.poll() is None

    def output(self) -> str:
        with open(self.log, "rb") as f:
            f.seek(self.offset)
            return f.read().decode("utf-8", "replace")

    def wait_for(self, text: str, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while text not in self.output():
            if not self.alive() or time.monotonic() > deadline:
                raise RuntimeError(
                    f"{self.command.name} did not print {text!r}:\n{self.output()[-3000:]}"
                )
            time.sleep(0.1)

    def kill(self) -> None:
        """SIGKILL the whole process group: a crash, nothing cleaned up."""
        if self.alive():
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.popen.pid, signal.SIGKILL)
        self.popen.wait(10)

    def stop(self, grace: float = 10) -> None:
        stop_all([self], grace)

    def terminate(self) -> None:
        """SIGTERM to the process (a graceful stop; it stops its own children)."""
        if self.alive():
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.popen.pid, signal.SIGTERM)

    def finish(self, deadline: float) -> None:
        """Wait for a terminated process until ``deadline``, then SIGKILL what is
        left of its group (prefork children)."""
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.popen.wait(max(0.0, deadline - time.monotonic()))
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.popen.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.popen.wait(5)


def stop_all(procs: Sequence[Proc], grace: float = 10) -> None:
    """Stop processes together: each is sent SIGTERM at once, then each gets
    what is left of ``grace`` to exit before its group is killed."""
    for proc in reversed(procs):
        with contextlib.suppress(Exception):
            proc.terminate()
    deadline = time.monotonic() + grace
    for proc in reversed(procs):
        with contextlib.suppress(Exception):
            proc.finish(deadline)


# --- sending ------------------------------------------------------------------------------


@dataclass
class SendResult:
    accepted: list[str] = field(default_factory=list)  # Message-IDs answered 250
    refused: list[tuple[str, str]] = field(default_factory=list)  # (Message-ID, why)
    started: float = 0.0
    finished: float = 0.0


def build_message(tag: str, seq: int, size: int = 1024) -> tuple[str, str, bytes]:
    """(Message-ID, recipient, bytes) of test message ``seq``."""
    mid = f"<{tag}.{seq}@faults.test>"
    rcpt = f"r{seq}@example.net"
    head = (
        f"From: <{SENDER}>\r\nTo: <{rcpt}>\r\nSubject: {tag} {seq}\r\nMessage-ID: {mid}\r\n\r\n"
    ).encode()
    line = b"x" * 76 + b"\r\n"
    body = line * max(1, size // len(line))
    return mid, rcpt, head + body


class SendJob:
    """``n`` messages over SMTP from ``clients`` concurrent sessions (one thread each)."""

    def __init__(
        self,
        port: int,
        n: int,
        clients: int = 4,
        tag: str = "m",
        size: int = 1024,
        per_connection: int = 10,
        timeout: float = 60,
    ) -> None:
        self.port, self.n, self.tag, self.size = port, n, tag, size
        self.per_connection, self.timeout = per_connection, timeout
        self.result = SendResult(started=time.time())
        self._next = 0
        self._lock = threading.Lock()
        self._threads = [threading.Thread(target=self._client, daemon=True) for _ in range(clients)]
        for t in self._threads:
            t.start()

    def _take(self) -> int | None:
        with self._lock:
            if self._next >= self.n:
                return None
            self._next += 1
            return self._next - 1

    def _note(self, mid: str, ok: bool, why: str = "") -> None:
        with self._lock:
            if ok:
                self.result.accepted.append(mid)
            else:
                self.result.refused.append((mid, why))

    def _client(self) -> None:
        seq = self._take()
        while seq is not None:
            try:
                with smtplib.SMTP("127.0.0.1", self.port, timeout=self.timeout) as smtp:
                    smtp.ehlo("client.faults.test")
                    for _ in range(self.per_connection):
                        mid, rcpt, data = build_message(self.tag, seq, self.size)
                        try:
                            smtp.sendmail(SENDER, [rcpt], data)
                            self._note(mid, True)
                        except smtplib.SMTPResponseException as exc:
                            self._note(mid, False, f"{exc.smtp_code} {exc.smtp_error!r}")
                            if exc.smtp_code == 421:
                                raise
                            smtp.rset()
                        except smtplib.SMTPRecipientsRefused as exc:
                            self._note(mid, False, repr(exc.recipients))
                            smtp.rset()
                        seq = self._take()
                        if seq is None:
                            break
            except (OSError, smtplib.SMTPException) as exc:
                # The message in progress got no 250: it is not ours to deliver.
                if seq is not None:
                    self._note(build_message(self.tag, seq)[0], False, repr(exc))
                    seq = self._take()
                # A client backs off before it connects again (an ingress restarting).
                time.sleep(0.2)

    def wait_accepted(self, n: int, timeout: float) -> bool:
        """Wait (polling the clients' tally) until ``n`` messages got 250."""
        deadline = time.monotonic() + timeout
        while len(self.result.accepted) < n:
            if time.monotonic() > deadline or not any(t.is_alive() for t in self._threads):
                return False
            time.sleep(0.01)
        return True

    def wait(self, timeout: float = 300) -> SendResult:
        deadline = time.monotonic() + timeout
        for t in self._threads:
            t.join(max(0.0, deadline - time.monotonic()))
        self.result.finished = time.time()
        return self.result


# --- the cluster ----------------------------------------------------------------------------


class Cluster:
    """Private PostgreSQL and Redis, the relay's processes, a recording sink."""

    def __init__(
        self,
        workdir: Path | None = None,
        root: Path = ROOT,
        sink_delay: float = 0.0,
        sink_size_limit: int = 0,
        sink_host: str = "127.0.0.2",
        env: dict[str, str] | None = None,
    ) -> None:
        self.root = Path(root).resolve()
        self._own_workdir = workdir is None
        self.workdir = Path(workdir or tempfile.mkdtemp(prefix="mr-cluster-"))
        # The postgres user must reach its cluster folder inside (mkdtemp makes 0700).
        self.workdir.chmod(0o755)
        self.logs = self.workdir / "logs"
        self.logs.mkdir(parents=True, exist_ok=True)
        self.pg = PrivatePostgres(self.workdir / "pg")
        self.redis = PrivateRedis(self.workdir / "redis")
        self.smtp_port = free_port()
        self.sink = Sink(
            sink_host,
            find_free_port((sink_host,)),
            SinkBehaviour(
                delays={"DATA": sink_delay} if sink_delay else {}, size_limit=sink_size_limit
            ),
        )
        self.extra_env = env or {}
        # What an operator sets on PostgreSQL (several nodes share one key).
        self.secret_key = secrets.token_urlsafe(48)
        self.commands: dict[str, Command] = {}
        self.procs: dict[str, Proc] = {}
        self._db: psycopg.Connection | None = None

    # life cycle -------------------------------------------------------------------------

    def base_env(self) -> dict[str, str]:
        """The environment of every child: defaults, except where things are."""
        drop = ("DATABASE_URL", "CELERY_", "MAILRELAY_", "DJANGO_", "PYTEST", "PROMETHEUS_")
        env = {k: v for k, v in os.environ.items() if not k.startswith(drop)}
        env.update(
            {
                "DATABASE_URL": self.pg.url(),
                "CELERY_BROKER_URL": self.redis.url,
                "MAILRELAY_SMTP_LISTEN": f"127.0.0.1:{self.smtp_port}",
                "MAILRELAY_SMART_HOST": f"[{self.sink.host}]:{self.sink.port}",
                "MAILRELAY_HOSTNAME": "relay.faults.test",
                "MAILRELAY_DATA_DIR": str(self.workdir / "var"),
                "DJANGO_SETTINGS_MODULE": "mailrelay.settings",
                "DJANGO_SECRET_KEY": self.secret_key,
                # The relay's code comes from self.root, whatever the venv's editable install says.
                "PYTHONPATH": str(self.root),
                "PYTHONUNBUFFERED": "1",
            }
        )
        env.update(self.extra_env)
        return env

    def start(self) -> Cluster:
        self.prepare()
        # Every child at once, as runall starts them; then each is awaited.
        for name in self.commands:
            self.launch(name)
        for name in self.commands:
            self.await_ready(name)
        return self

    def prepare(self) -> None:
        """The sink, PostgreSQL (migrated) and Redis; ``commands`` read from runall.

        What needs no database (where the children import from, runall's
        commands) is read while PostgreSQL is made and migrated.
        """
        with ThreadPoolExecutor(2) as pool:
            origin = pool.submit(self.code_origin)
            commands = pool.submit(self.runall_commands)
            self.sink.start()
            self.pg.init()
            self.pg.start()
            self.pg.create_database()
            self.redis.start()
            if origin.result() != self.root:
                raise RuntimeError(f"children would import {origin.result()}, not {self.root}")
            self._manage("migrate", "--noinput", "-v", "0")
            self.commands = commands.result()

    def _manage(self, *args: str) -> str:
        out = subprocess.run(
            [PYTHON, "manage.py", *args],
            cwd=self.root,
            env=self.base_env(),
            capture_output=True,
            text=True,
            timeout=300,
        )
        if out.returncode != 0:
            raise RuntimeError(f"manage.py {args[0]} failed:\n{out.stdout}\n{out.stderr}")
        return out.stdout

    def code_origin(self) -> Path:
        """The folder the children import the relay's code from (it must be ``root``)."""
        out = subprocess.run(
            [
                PYTHON,
                "-c",
                "import django; django.setup(); import delivery.smtp.deliver as d; "
                "print(d.__file__)",
            ],
            cwd="/",  # PYTHONPATH alone, not the working folder, must lead to root
            env=self.base_env(),
            capture_output=True,
            text=True,
            timeout=60,
        )
        if out.returncode != 0:
            raise RuntimeError(f"the relay's code does not import:\n{out.stderr[-3000:]}")
        return Path(out.stdout.strip()).parents[2]  # delivery/smtp/deliver.py

    def runall_commands(self) -> dict[str, Command]:
        """The children ``runall`` starts (not the web app), with its environment."""
        import json

        out = subprocess.run(
            [PYTHON, "-c", _EXTRACT],
            cwd=self.root,
            env=self.base_env(),
            capture_output=True,
            text=True,
            timeout=120,
        )
        line = next(
            (ln for ln in out.stdout.splitlines() if ln.startswith("RUNALL-COMMANDS ")), None
        )
        if line is None:
            raise RuntimeError(f"could not read runall's commands:\n{out.stdout}\n{out.stderr}")
        commands: dict[str, Command] = {}
        for child in json.loads(line.split(" ", 1)[1]):
            name = child.get("name") or _name_of(child["argv"], commands)
            if name is not None and name != "web":
                env = child["env"] or self.base_env()
                env.update(self.extra_env)
                commands[name] = Command(name, child["argv"], env)
        if not any(n.startswith("worker") for n in commands) or "smtp" not in commands:
            raise RuntimeError(f"unexpected runall children: {list(commands)}")
        return commands

    def workers(self) -> list[str]:
        return [n for n in self.commands if n.startswith("worker")]

    @property
    def delivery_worker(self) -> str:
        """The worker that runs deliver_link: the `delivery` queue's, else the only one."""
        for name in self.workers():
            if "delivery" in name:
                return name
        return next(n for n in self.workers() if n == "worker")

    def start_process(self, name: str) -> Proc:
        """A fresh ``name`` (as a supervisor would start it), awaited until it serves."""
        self.launch(name)
        return self.await_ready(name)

    def launch(self, name: str) -> Proc:
        proc = Proc(self.commands[name], self.root, self.logs / f"{name}.log")
        self.procs[name] = proc
        return proc

    def await_ready(self, name: str) -> Proc:
        proc = self.procs[name]
        if name == "smtp":
            wait_port(self.smtp_port, 60, proc.alive)
        elif name.startswith("worker"):
            proc.wait_for(" ready.", 60)
        elif name == "beat":
            proc.wait_for("beat: Starting", 60)
        return proc

    def stop(self) -> None:
        stop_all(list(self.procs.values()))
        if self._db is not None:
            with contextlib.suppress(Exception):
                self._db.close()
        with contextlib.suppress(Exception):
            self.redis.kill()
        with contextlib.suppress(Exception):
            self.pg.stop("immediate")
        self.sink.stop()
        if self._own_workdir and not os.environ.get("FAULTS_KEEP_CLUSTER"):
            shutil.rmtree(self.workdir, ignore_errors=True)

    def log_tails(self, lines: int = 30) -> str:
        """The last lines of every process's log, for a failure's message (the
        folder goes with ``stop`` unless FAULTS_KEEP_CLUSTER)."""
        parts = []
        for path in sorted(self.logs.glob("*.log")):
            tail = path.read_text(errors="replace").splitlines()[-lines:]
            parts.append("\n".join([f"--- {path.name}", *tail]))
        return "\n".join(parts)

    def __enter__(self) -> Cluster:
        try:
            return self.start()
        except BaseException:
            self.stop()
            raise

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # faults ---------------------------------------------------------------------------------

    def kill(self, name: str) -> None:
        self.procs[name].kill()

    def restart_postgres(self) -> None:
        if self._db is not None:
            with contextlib.suppress(Exception):
                self._db.close()
            self._db = None
        self.pg.restart()

    def restart_redis(self) -> None:
        self.redis.restart()

    def flush_broker(self) -> None:
        self.redis.flush()

    # mail -----------------------------------------------------------------------------------

    def send_async(self, n: int, clients: int = 4, tag: str = "m", **kwargs: object) -> SendJob:
        return SendJob(self.smtp_port, n, clients, tag, **kwargs)  # type: ignore[arg-type]

    def send(self, n: int, clients: int = 4, tag: str = "m", **kwargs: object) -> SendResult:
        return self.send_async(n, clients, tag, **kwargs).wait()

    def received_ids(self) -> list[str | None]:
        with self.sink._cond:
            messages = list(self.sink.messages)
        return [message_id_of(m.data) for m in messages]

    def copies(self) -> Counter[str | None]:
        return Counter(self.received_ids())

    def wait_delivered(self, ids: Iterable[str], timeout: float) -> bool:
        """Wait until every Message-ID in ``ids`` has arrived at the sink."""
        wanted = set(ids)
        seen: set[str | None] = set()
        done = 0

        def arrived() -> bool:
            nonlocal done
            messages = self.sink.messages  # called under the sink's lock
            for m in messages[done:]:
                seen.add(message_id_of(m.data))
            done = len(messages)
            return wanted <= seen

        return self.sink.wait_until(arrived, timeout)

    def wait_sink_count(self, n: int, timeout: float) -> bool:
        return self.sink.wait_for(n, timeout)

    # the database ----------------------------------------------------------------------------

    def query(self, sql: str, params: Sequence[object] = ()) -> list[tuple]:
        """A query on the relay's database (reconnects after a restart)."""
        for attempt in (1, 2):
            try:
                if self._db is None or self._db.closed:
                    self._db = psycopg.connect(
                        self.pg.url().replace("postgres://", "postgresql://"),
                        autocommit=True,
                        connect_timeout=10,
                    )
                return self._db.execute(sql, params).fetchall()
            except psycopg.OperationalError:
                self._db = None
                if attempt == 2:
                    raise
        return []

    def in_flight(self) -> set[str]:
        """Message-IDs with a recipient held by a delivery round (state ``active``)."""
        rows = self.query(
            "SELECT DISTINCT m.message_id FROM queues_recipient r "
            "JOIN queues_message m ON m.id = r.message_id WHERE r.state = 'active'"
        )
        return {r[0] for r in rows}

    def states(self) -> dict[str, int]:
        rows = self.query("SELECT state, count(*) FROM queues_recipient GROUP BY state")
        return {state: n for state, n in rows}

    def leases(self) -> list[tuple]:
        """(link id, lease owner, lease_until) of the links that carry a lease."""
        return self.query(
            "SELECT id, lease_owner, lease_until FROM queues_link WHERE lease_owner <> ''"
        )
