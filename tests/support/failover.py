"""A primary and a streaming standby of our own, and a failover measured from outside.

``ReplicatedPostgres`` stands in for ``PrivatePostgres`` in a ``Cluster``: a
primary made with ``initdb`` and a standby made from it with
``pg_basebackup -R`` (streaming replication), each on a free port and run as
the ``postgres`` user. ``synchronous=True`` names the standby in the
primary's ``synchronous_standby_names`` (``synchronous_commit = on``, the
default): a commit returns only once the standby has flushed it. The relay
gets the multi-host ``DATABASE_URL`` listing both, primary first, with
``target_session_attrs=read-write``.

``FailoverCluster`` is a ``Cluster`` on it, with the faults ``kill_primary()``
(SIGKILL of the primary's postmaster and every backend at once: a machine
lost) and ``promote()`` (``pg_ctl promote`` of the standby, as Patroni or
pg_auto_failover would do).

``Load`` sends numbered messages over SMTP at a steady rate from a few
clients, as an MTA would: a message refused with 4xx (or whose session
broke) is sent again a moment later as a new attempt with its own
``Message-ID``, so every attempt that got 250 is counted once and an attempt
that was refused yet stored is told apart from a duplicate. ``Arrivals``
timestamps what reaches the sink.

``run_failover()`` does the whole scenario and returns a ``FailoverResult``
(used by ``tests/test_failover.py`` and ``bench/failover/run.py``).
"""

from __future__ import annotations

import contextlib
import os
import signal
import smtplib
import subprocess
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import psutil
import psycopg

from tests.support.cluster import (
    DB_NAME,
    SENDER,
    Cluster,
    PrivatePostgres,
    _as_postgres,
    build_message,
    message_id_of,
)

STANDBY_NAME = "standby1"


class ReplicatedPostgres:
    """A primary and its streaming standby; the interface of ``PrivatePostgres``."""

    def __init__(self, directory: Path, synchronous: bool = True) -> None:
        self.directory = directory
        self.synchronous = synchronous
        self.primary = PrivatePostgres(directory / "primary")
        self.standby = PrivatePostgres(directory / "standby")
        # /usr/local/bin may hold only a link to pg_ctl: the folder it points into has them all.
        self.bindir = (self.primary.bindir / "pg_ctl").resolve().parent
        self.promoted = False

    @property
    def port(self) -> int:
        return self.primary.port

    def url(self, db: str = DB_NAME, attrs: str = "read-write") -> str:
        """Both hosts, primary first: libpq connects to the one ``attrs`` asks for."""
        hosts = f"127.0.0.1:{self.primary.port},127.0.0.1:{self.standby.port}"
        return f"postgres://postgres@{hosts}/{db}?target_session_attrs={attrs}"

    def init(self) -> None:
        self.primary.init()
        with open(self.primary.data / "postgresql.conf", "a") as conf:
            # initdb's pg_hba.conf already lets local replication connections in (trust).
            conf.write("wal_level = replica\nmax_wal_senders = 5\nwal_keep_size = 256MB\n")
            if self.synchronous:
                conf.write(
                    f"synchronous_standby_names = '{STANDBY_NAME}'\nsynchronous_commit = on\n"
                )

    def start(self) -> None:
        self.primary.start()
        self.standby.directory.mkdir(parents=True, exist_ok=True)
        self.standby._chown(self.standby.directory)
        subprocess.run(
            _as_postgres(
                [str(self.bindir / "pg_basebackup"), "-h", "127.0.0.1"]
                + ["-p", str(self.primary.port), "-U", "postgres", "-D", str(self.standby.data)]
                + ["-X", "stream", "-R", "-c", "fast"]
            ),
            check=True,
            capture_output=True,
            timeout=120,
        )
        # The copy carries the primary's settings (later lines win): the
        # standby's own port and socket folder, and no synchronous standby of
        # its own: once promoted it is alone until the old primary is rebuilt
        # as its standby, and would otherwise wait for ever on every commit
        # (what Patroni's synchronous_mode does too, unless _strict).
        with open(self.standby.data / "postgresql.conf", "a") as conf:
            conf.write(
                f"\nport = {self.standby.port}\n"
                f"unix_socket_directories = '{self.standby.directory}'\n"
                "hot_standby = on\nsynchronous_standby_names = ''\n"
            )
        with open(self.standby.data / "postgresql.auto.conf", "a") as conf:
            conf.write(
                f"primary_conninfo = 'host=127.0.0.1 port={self.primary.port} user=postgres "
                f"application_name={STANDBY_NAME}'\n"
            )
        self.standby.start()
        self.wait_streaming(60)

    def wait_streaming(self, timeout: float) -> None:
        want = "sync" if self.synchronous else "async"
        deadline = time.monotonic() + timeout
        with psycopg.connect(self.primary.admin_url, autocommit=True) as conn:
            while time.monotonic() < deadline:
                rows = conn.execute(
                    "SELECT sync_state FROM pg_stat_replication WHERE application_name = %s "
                    "AND state = 'streaming'",
                    (STANDBY_NAME,),
                ).fetchall()
                if rows and rows[0][0] == want:
                    return
                time.sleep(0.1)
        raise RuntimeError(f"the standby is not streaming ({want}) after {timeout:.0f} s")

    def create_database(self, name: str = DB_NAME) -> None:
        self.primary.create_database(name)

    def kill_primary(self) -> int:
        """SIGKILL the primary's postmaster and all its processes at once; how many."""
        pid = int((self.primary.data / "postmaster.pid").read_text().split()[0])
        postmaster = psutil.Process(pid)
        victims = [postmaster, *postmaster.children(recursive=True)]
        for proc in victims:
            # A backend may have exited already (it watches its postmaster).
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc.pid, signal.SIGKILL)
        psutil.wait_procs(victims, timeout=10)
        return len(victims)

    def promote(self) -> None:
        subprocess.run(
            _as_postgres([str(self.bindir / "pg_ctl"), "-D", str(self.standby.data)])
            + ["-w", "-t", "60", "promote"],
            check=True,
            capture_output=True,
            timeout=90,
        )
        self.promoted = True

    def stop(self, mode: str = "fast") -> None:
        self.standby.stop(mode)
        self.primary.stop(mode)

    def restart(self) -> None:
        raise NotImplementedError("a replicated pair fails over; it is not restarted")


class FailoverCluster(Cluster):
    """A ``Cluster`` whose database is a primary and a streaming standby."""

    def __init__(self, synchronous: bool = True, **kwargs: object) -> None:
        super().__init__(**kwargs)  # type: ignore[arg-type]
        self.pg = ReplicatedPostgres(self.workdir / "pg", synchronous)  # type: ignore[assignment]

    @property
    def replicated(self) -> ReplicatedPostgres:
        assert isinstance(self.pg, ReplicatedPostgres)
        return self.pg

    def query(self, sql: str, params: tuple = ()) -> list[tuple]:  # type: ignore[override]
        """A query on whichever server answers (the standby's view while there is no primary)."""
        url = self.replicated.url(attrs="any").replace("postgres://", "postgresql://")
        with psycopg.connect(url, autocommit=True, connect_timeout=5) as conn:
            return conn.execute(sql, params).fetchall()


# --- the load -------------------------------------------------------------------------------


@dataclass
class Attempt:
    mid: str
    seq: int
    sent: float
    answered: float = 0.0
    ok: bool = False
    reply: str = ""


class Load:
    """``n`` messages at ``rate`` per second overall from ``clients`` sessions; a
    refused message is sent again (a new attempt) ``retry_after`` seconds later."""

    def __init__(
        self,
        port: int,
        n: int,
        rate: float,
        clients: int = 4,
        tag: str = "fo",
        retry_after: float = 0.5,
        deadline: float = 120.0,
    ) -> None:
        self.port, self.n, self.tag = port, n, tag
        self.interval = clients / rate if rate > 0 else 0.0
        self.retry_after = retry_after
        self.stop_at = time.monotonic() + deadline
        self.attempts: list[Attempt] = []
        self.done: set[int] = set()
        self._next = 0
        self._retry: list[tuple[float, int]] = []
        self._lock = threading.Lock()
        self._tries: Counter[int] = Counter()
        self._threads = [
            threading.Thread(target=self._client, daemon=True, name=f"load-{i}")
            for i in range(clients)
        ]
        for thread in self._threads:
            thread.start()

    def _take(self) -> int | None:
        """The next message: one due for another attempt first, else a new one."""
        while time.monotonic() < self.stop_at:
            with self._lock:
                now = time.monotonic()
                due = [item for item in self._retry if item[0] <= now]
                if due:
                    self._retry.remove(due[0])
                    return due[0][1]
                if self._next < self.n:
                    self._next += 1
                    return self._next - 1
                if not self._retry:
                    return None
            time.sleep(0.05)
        return None

    def _attempt(self, seq: int) -> Attempt:
        with self._lock:
            self._tries[seq] += 1
            mid = f"<{self.tag}.{seq}.{self._tries[seq]}@faults.test>"
            attempt = Attempt(mid, seq, time.time())
            self.attempts.append(attempt)
            return attempt

    def _answered(self, attempt: Attempt, ok: bool, reply: str) -> None:
        with self._lock:
            attempt.answered, attempt.ok, attempt.reply = time.time(), ok, reply
            if ok:
                self.done.add(attempt.seq)
            else:
                self._retry.append((time.monotonic() + self.retry_after, attempt.seq))

    def _client(self) -> None:
        seq = self._take()
        while seq is not None:
            attempt: Attempt | None = None
            try:
                with smtplib.SMTP("127.0.0.1", self.port, timeout=30) as smtp:
                    smtp.ehlo("client.faults.test")
                    while seq is not None:
                        started = time.monotonic()
                        attempt = self._attempt(seq)
                        _mid, rcpt, data = build_message(self.tag, seq, 1024)
                        data = data.replace(_mid.encode(), attempt.mid.encode(), 1)
                        try:
                            smtp.sendmail(SENDER, [rcpt], data)
                            self._answered(attempt, True, "250")
                        except smtplib.SMTPResponseException as exc:
                            self._answered(attempt, False, f"{exc.smtp_code} {exc.smtp_error!r}")
                            if exc.smtp_code == 421:
                                raise
                            smtp.rset()
                        seq, attempt = self._take(), None
                        time.sleep(max(0.0, self.interval - (time.monotonic() - started)))
            except (OSError, smtplib.SMTPException) as exc:
                if attempt is not None:  # else nothing was sent yet: the same one again
                    if not attempt.answered:
                        self._answered(attempt, False, repr(exc))
                    seq = self._take()
                time.sleep(0.2)

    def accepted(self) -> list[Attempt]:
        with self._lock:
            return [a for a in self.attempts if a.ok]

    def wait(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        for thread in self._threads:
            thread.join(max(0.0, deadline - time.monotonic()))


class Arrivals:
    """The time each message reached the sink (a thread that follows its list)."""

    def __init__(self, cluster: Cluster) -> None:
        self.sink = cluster.sink
        self.times: list[tuple[float, str | None]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._follow, daemon=True, name="arrivals")
        self._thread.start()

    def _follow(self) -> None:
        seen = 0
        while not self._stop.is_set():
            self.sink.wait_until(lambda n=seen: len(self.sink.messages) > n, 0.2)
            with self.sink._cond:
                new = self.sink.messages[seen:]
                seen += len(new)
            now = time.time()
            self.times.extend((now, message_id_of(m.data)) for m in new)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)


# --- the scenario -------------------------------------------------------------------------


@dataclass
class FailoverResult:
    synchronous: bool
    acknowledged: int = 0
    lost: list[str] = field(default_factory=list)
    duplicates: int = 0  # extra copies of acknowledged attempts at the sink
    refused_but_delivered: int = 0  # a 4xx answer for an attempt that was stored after all
    refused: int = 0
    seconds_without_accepting: float = 0.0  # the longest gap between two 250s around the fault
    accepting_after_promotion: float = 0.0  # promotion → first 250 after it
    delivery_resumed_after_promotion: float = 0.0  # promotion → first post-kill 250 at the sink
    all_delivered_after_promotion: float = 0.0
    open_connections_at_kill: int = 0
    in_flight_at_kill: int = 0
    max_copies: int = 0
    states: dict[str, int] = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)

    def row(self) -> str:
        def s(x: float) -> str:
            return f"{x:.1f}" if x >= 0 else "never"

        return (
            f"| {'synchronous' if self.synchronous else 'asynchronous'} | {self.acknowledged} "
            f"| {len(self.lost)} | {self.duplicates} | {s(self.seconds_without_accepting)} "
            f"| {s(self.accepting_after_promotion)} | {s(self.delivery_resumed_after_promotion)} "
            f"| {s(self.all_delivered_after_promotion)} |"
        )


HEADER = (
    "| standby | acknowledged | lost | duplicates | s without accepting "
    "| s from promotion to accepting | s from promotion to delivery resumed "
    "| s from promotion to all delivered |\n|---|---|---|---|---|---|---|---|"
)


def run_failover(
    cluster: FailoverCluster,
    *,
    messages: int = 400,
    rate: float = 40.0,
    clients: int = 4,
    kill_after: int = 80,
    promote_after: float = 3.0,
    settle: float = 90.0,
) -> FailoverResult:
    """Load through the relay, kill -9 of the primary once ``kill_after`` messages
    reached the sink, promote the standby ``promote_after`` s later; the relay's
    processes are never restarted. Waits up to ``settle`` s after the promotion
    for every acknowledged attempt to arrive."""
    result = FailoverResult(cluster.replicated.synchronous)
    arrivals = Arrivals(cluster)
    load = Load(cluster.smtp_port, messages, rate, clients, deadline=settle + 120)
    try:
        if not cluster.wait_sink_count(kill_after, 120):
            raise RuntimeError(
                f"only {len(cluster.sink.messages)} delivered before the kill\n"
                + cluster.log_tails()
            )
        result.in_flight_at_kill = len(cluster.in_flight())
        with cluster.sink._cond:
            result.open_connections_at_kill = cluster.sink.active_connections
            killed_at = time.time()
            cluster.replicated.kill_primary()
        time.sleep(max(0.0, promote_after - (time.time() - killed_at)))
        cluster.replicated.promote()
        promoted_at = time.time()
        load.wait(settle + 60)
        accepted = load.accepted()
        wanted = {a.mid for a in accepted}
        cluster.wait_delivered(wanted, max(0.0, promoted_at + settle - time.time()))
        time.sleep(2)  # a late second copy still counts
    finally:
        arrivals.stop()
    copies = cluster.copies()
    attempts = load.attempts
    result.acknowledged = len(accepted)
    result.refused = sum(1 for a in attempts if not a.ok)
    result.lost = sorted(wanted - set(copies))
    result.duplicates = sum(copies[m] - 1 for m in wanted if copies[m] > 1)
    result.max_copies = max((copies[m] for m in wanted), default=0)
    result.refused_but_delivered = sum(1 for a in attempts if not a.ok and copies[a.mid])
    times = sorted(a.answered for a in accepted)
    around = [t for t in times if killed_at - 30 <= t <= promoted_at + 60]
    gaps = [b - a for a, b in zip(around, around[1:], strict=False)]
    result.seconds_without_accepting = max(gaps, default=-1.0)
    after = [t for t in times if t >= promoted_at]
    result.accepting_after_promotion = after[0] - promoted_at if after else -1.0
    post_kill = {a.mid for a in accepted if a.sent >= killed_at}
    first = [t for t, mid in arrivals.times if mid in post_kill]
    result.delivery_resumed_after_promotion = min(first) - promoted_at if first else -1.0
    last = [t for t, mid in arrivals.times if mid in wanted]
    result.all_delivered_after_promotion = (
        max(last) - promoted_at if last and not result.lost else -1.0
    )
    with contextlib.suppress(Exception):
        result.states = cluster.states()
    return result
