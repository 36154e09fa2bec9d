"""Two relay hosts on one machine, one PostgreSQL, one Redis: hit host B mid-round.

Issue #22 ("A lost claim stops the wire"). Two sets of the processes
``make run`` starts (``runsmtp`` and the Celery workers exactly as
``manage.py runall`` starts them, read from ``runall`` itself by
``tests/support/cluster.py``; beat on host A only, as docker-compose runs one
beat, or on both with ``--beat both``) run as two Unix users, ``mrhosta`` and
``mrhostb`` (created with ``useradd -r`` when missing; the processes are
started through ``setpriv``), so that iptables ``-m owner --uid-owner`` can cut
one host off. Both share ONE private PostgreSQL and ONE private Redis on free
ports, and deliver to one recording sink on 127.0.0.2 (the smart host) that
takes ``--sink-delay`` (70 ms) per final dot. Every relay setting is at its
default (lease 30 s, margin 5 s, reclaim every 10 s, ...); each host has its
own ``MAILRELAY_NODE_NAME``, SMTP port, data folder and Celery node names
(``%h`` of ``-n delivery@%h`` becomes the host's name, as on two machines).

``--messages`` tagged messages stream in from ``--clients`` SMTP clients, half
on each host's ingress. When ``--fault-after`` of them reached the sink AND a
delivery round of host B holds recipients (``queues_recipient.state =
'active'`` with a lease owner whose pid is one of B's processes), B is hit:

- ``kill9``: SIGKILL to every process group of B, not restarted;
- ``freeze``: SIGSTOP to B's process groups for ``--hold`` (90) s, then SIGCONT;
- ``partition``: ``iptables -A OUTPUT -o lo -m owner --uid-owner <B> -j DROP``
  for ``--hold`` s (B's packets to PostgreSQL, Redis and the sink are dropped),
  then the rule is deleted. The rule is always deleted on exit (finally,
  atexit, SIGTERM/SIGHUP/SIGINT) and ``iptables -S`` is checked afterwards.

The sink tells the hosts apart per connection by the owner (uid) of the
client's socket in /proc/net/tcp, so no setting moves from its default. A
poller (its own PostgreSQL connection, every 0.2 s) records who holds which
claim (links, round recipients, categorizer batches) and each claim's
``lease_until``. Printed per fault: accepted, lost (accepted, never at the
sink), duplicates (copies beyond the first; the worst copies of one message),
B's transactions (MAIL FROM at the sink) that started after B's claim was
lost — after ``lease_until - margin`` of its claims at the fault (by B's own
rule), after ``lease_until`` (the claim expired) and after host A took the
link — counted only when no NEW claim of B (one first seen after the fault)
held the link then; the recovery time (fault -> last accepted message at the
sink), whether the round B held was delivered by A within 60 s; what was left
claimed at the end; and at kill -9 the outbound connections B had open.

    .venv/bin/python bench/faults/multihost.py --faults kill9,freeze,partition
    .venv/bin/python bench/faults/multihost.py --faults freeze --messages 600

Run as root (users, setpriv, iptables, ACLs). Needs ``iptables`` (Debian:
``apt-get install -y iptables``) and ``setfacl`` (``acl``) when the venv's
interpreter lives under a folder the host users cannot enter (e.g. /root):
they get ``--x`` on it for the run, removed at exit. Never touches 5432/6379.
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

CHECKOUT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(CHECKOUT))

import psycopg  # noqa: E402

from tests.support.cluster import (  # noqa: E402
    Cluster,
    Command,
    Proc,
    SendJob,
    free_port,
    message_id_of,
    wait_port,
)
from tests.support.sinks import Sink, SinkBehaviour  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from hosts import (  # noqa: E402
    Host,
    ensure_user,
    grant_interpreter_access,
    install_cleanup,
    leftover_rules,
    outbound_open,
    partition_on,
    pid_uid,
    remove_rules,
    revoke_access,
    tcp_sockets,
)

LEASE = 30.0  # MAILRELAY_DELIVERY_LEASE default (s)
MARGIN = 5.0  # MAILRELAY_DELIVERY_LEASE_MARGIN default (s)
STRANDED_WITHIN = 60.0  # the target for the other host to take over
FINAL = {"delivered", "failed", "expired"}


# --- the sink: which host sent what, and when ----------------------------------------------


@dataclass
class Arrival:
    at: float  # wall clock
    conn: int
    host: str
    mid: str | None


class HostSink(Sink):
    """The recording sink, plus per connection: the host (by the client socket's
    uid), when it opened, and the time of every MAIL FROM and every arrival."""

    def __init__(self, host: str, port: int, behaviour: SinkBehaviour, uids: dict[int, str]):
        super().__init__(host, port, behaviour)
        self.uid_host = uids
        self.conn_host: dict[int, str] = {}
        self.conn_opened: dict[int, float] = {}
        self.mails: list[tuple[float, int, str]] = []  # (at, conn, host)
        self.arrivals: list[Arrival] = []

    def _connection_opened(self) -> int:
        n = super()._connection_opened()
        self.conn_opened[n] = time.time()
        return n

    def _host_of(self, server: object) -> str:
        transport = getattr(server, "transport", None)
        peer = transport.get_extra_info("peername") if transport is not None else None
        if peer:
            for local, remote, _, uid in tcp_sockets():
                if local == (peer[0], peer[1]) and remote == (self.host, self.port):
                    return self.uid_host.get(uid, f"uid{uid}")
        return "?"

    def _command(self, server, verb: str) -> None:  # type: ignore[override]
        super()._command(server, verb)
        if not server.counted or not server.conn_id:
            return
        now = time.time()
        if server.conn_id not in self.conn_host:
            self.conn_host[server.conn_id] = self._host_of(server)
        if verb == "MAIL":
            self.mails.append((now, server.conn_id, self.conn_host[server.conn_id]))

    def _record(self, message, where: str) -> None:  # type: ignore[override]
        super()._record(message, where)
        if where == "messages":
            host = self.conn_host.get(message.connection, "?")
            self.arrivals.append(
                Arrival(time.time(), message.connection, host, message_id_of(message.data))
            )


# --- the claim poller ------------------------------------------------------------------------

_CLAIMS_SQL = """
SELECT 'link', lease_owner, extract(epoch FROM lease_until) FROM queues_link
 WHERE lease_owner <> ''
UNION ALL
SELECT 'round', lease_owner, extract(epoch FROM max(lease_until)) FROM queues_recipient
 WHERE state = 'active' GROUP BY lease_owner
UNION ALL
SELECT 'batch', lease_owner, extract(epoch FROM max(lease_until)) FROM queues_message
 WHERE state = 'categorizing' AND lease_owner <> '' GROUP BY lease_owner
"""


# Sessions waiting on a lock, and sessions holding a transaction open (a frozen
# or cut-off owner keeps its row locks for as long as PostgreSQL keeps its session).
_LOCKS_SQL = """
SELECT client_port, state, coalesce(wait_event_type, ''),
       extract(epoch FROM now() - coalesce(state_change, now())), left(query, 90)
  FROM pg_stat_activity
 WHERE datname = 'mailrelay' AND pid <> pg_backend_pid()
   AND (wait_event_type = 'Lock' OR state LIKE 'idle in transaction%')
"""


@dataclass
class Sample:
    at: float
    kind: str  # link / round / batch
    token: str  # hostname:pid:uuid (a round's "/n" cut off)
    host: str
    until: float


class ClaimWatch(threading.Thread):
    """Polls who holds which claim, on a connection of its own."""

    def __init__(self, url: str, uid_host: dict[int, str], interval: float = 0.2) -> None:
        super().__init__(daemon=True)
        self.url, self.uid_host, self.interval = url, uid_host, interval
        self.samples: list[Sample] = []
        self.pid_host: dict[int, str] = {}
        self.last_poll = 0.0
        # (at, host, "waits on a lock" / "idle in transaction", seconds, query)
        self.sessions: list[tuple[float, str, str, float, str]] = []
        self._halt = threading.Event()

    def host_of(self, token: str) -> str:
        try:
            pid = int(token.split(":")[1])
        except (IndexError, ValueError):
            return "?"
        if pid not in self.pid_host:
            uid = pid_uid(pid)
            if uid is None:
                return "?"  # gone before we saw it (not cached: may be a reused pid)
            self.pid_host[pid] = self.uid_host.get(uid, f"uid{uid}")
        return self.pid_host[pid]

    def run(self) -> None:
        conn: psycopg.Connection | None = None
        while not self._halt.is_set():
            try:
                if conn is None or conn.closed:
                    conn = psycopg.connect(self.url, autocommit=True, connect_timeout=5)
                rows = conn.execute(_CLAIMS_SQL).fetchall()
                sessions = conn.execute(_LOCKS_SQL).fetchall()
            except psycopg.Error:
                conn = None
                rows, sessions = [], []
            now = time.time()
            self._note_sessions(now, sessions)
            for kind, owner, until in rows:
                token = owner.split("/")[0]
                self.samples.append(Sample(now, kind, token, self.host_of(token), float(until)))
            self.last_poll = now
            self._halt.wait(self.interval)
        if conn is not None:
            conn.close()

    def _note_sessions(self, now: float, sessions: list[tuple]) -> None:
        if not sessions:
            return
        owners = {local[1]: uid for local, _, _, uid in tcp_sockets() if local[0] == "127.0.0.1"}
        for port, state, wait, seconds, query in sessions:
            uid = owners.get(port)
            host = "?" if uid is None else self.uid_host.get(uid, f"uid{uid}")
            what = "waits on a lock" if wait == "Lock" else state
            self.sessions.append((now, host, what, float(seconds or 0), " ".join(query.split())))

    def long_sessions(self, since: float, at_least: float = 2.0) -> list[str]:
        """The longest wait or open transaction per (host, what, query) after ``since``."""
        worst: dict[tuple[str, str, str], tuple[float, float]] = {}
        for at, host, what, seconds, query in self.sessions:
            key = (host, what, query)
            if at > since and seconds >= at_least and seconds > worst.get(key, (0, 0))[1]:
                worst[key] = (at, seconds)
        return [
            f"{host}: {what} for {sec:.1f}s (seen at +{at - since:.1f}s): {query}"
            for (host, what, query), (at, sec) in sorted(worst.items(), key=lambda i: -i[1][1])
        ][:6]

    def stop(self) -> None:
        self._halt.set()
        self.join(5)

    def held_by(self, host: str, kind: str | None = None) -> list[Sample]:
        last = self.last_poll
        return [
            s
            for s in self.samples[-200:]
            if s.at == last and s.host == host and (kind is None or s.kind == kind)
        ]


# --- two hosts on one PostgreSQL, one Redis, one sink ------------------------------------------


class TwoHosts(Cluster):
    """``Cluster``'s private services and sink, and runall's processes twice:
    host B started first (so that it is likely to take the link), then A."""

    def __init__(self, sink_delay: float, beat: str, root: Path = CHECKOUT) -> None:
        super().__init__(sink_delay=sink_delay, root=root)
        self.hosts = {k: Host(k, f"mrhost{k}") for k in ("a", "b")}
        for host in self.hosts.values():
            host.uid, host.gid = ensure_user(host.user)
            host.smtp_port = free_port()
        self.uid_host = {h.uid: h.key for h in self.hosts.values()}
        self.sink = HostSink(self.sink.host, self.sink.port, self.sink.behaviour, self.uid_host)
        self.beat_hosts = {"a"} if beat == "a" else {"a", "b"}

    def start(self) -> TwoHosts:
        grant_interpreter_access(h.user for h in self.hosts.values())
        self.prepare()
        for key in ("b", "a"):
            self._prepare(self.hosts[key])
            for name in self.commands:
                if name == "beat" and key not in self.beat_hosts:
                    continue
                if key == "a" and name == self.delivery_worker:
                    continue  # start_a_delivery(), once B holds the link
                self.start_on(self.hosts[key], name)
        return self

    def start_a_delivery(self) -> None:
        """A's delivery worker. One link has one delivery task: whichever worker
        takes the first doorbell keeps the link for the whole stream, so A's
        joins once B holds it (A then takes over only what B loses)."""
        self.start_on(self.hosts["a"], self.delivery_worker)

    def _prepare(self, host: Host) -> None:
        host.folder = self.workdir / f"host-{host.key}"
        for sub in ("", "var", "metrics", "home"):
            (host.folder / sub).mkdir(parents=True, exist_ok=True)
            os.chown(host.folder / sub, host.uid, host.gid)

    def host_command(self, host: Host, name: str) -> Command:
        """runall's command ``name`` as ``host`` runs it: as its user, with its
        node name, port and folders; ``%h`` (Celery's node names) = the host."""
        base = self.commands[name]
        shared_var = str(self.workdir / "var")
        argv = [
            a.replace("%h", host.node).replace(shared_var, str(host.folder / "var"))
            for a in base.argv
        ]
        env = dict(base.env)
        env.update(
            {
                "MAILRELAY_NODE_NAME": host.node,
                "MAILRELAY_SMTP_LISTEN": f"127.0.0.1:{host.smtp_port}",
                "MAILRELAY_DATA_DIR": str(host.folder / "var"),
                "PROMETHEUS_MULTIPROC_DIR": str(host.folder / "metrics"),
                "HOME": str(host.folder / "home"),
            }
        )
        prefix = ["setpriv", f"--reuid={host.uid}", f"--regid={host.gid}", "--clear-groups", "--"]
        return Command(f"{host.key}/{name}", prefix + argv, env)

    def start_on(self, host: Host, name: str) -> Proc:
        command = self.host_command(host, name)
        proc = Proc(command, self.root, self.logs / f"{host.key}-{name}.log")
        host.procs[name] = proc
        self.procs[command.name] = proc  # Cluster.stop stops it
        if name == "smtp":
            wait_port(host.smtp_port, 60, proc.alive)
        elif name.startswith("worker"):
            proc.wait_for(" ready.", 90)
        elif name == "beat":
            proc.wait_for("beat: Starting", 60)
        return proc

    def signal_host(self, key: str, sig: signal.Signals) -> None:
        for proc in self.hosts[key].procs.values():
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, sig)

    def stop(self) -> None:
        remove_rules()
        for key in self.hosts:
            self.signal_host(key, signal.SIGCONT)
        try:
            super().stop()
        finally:
            revoke_access()

    def send_both(self, n: int, clients: int, tag: str) -> list[SendJob]:
        """Half the messages (and clients) on each host's ingress."""
        half = n // 2
        return [
            SendJob(self.hosts["a"].smtp_port, n - half, max(1, clients // 2), f"{tag}-a"),
            SendJob(self.hosts["b"].smtp_port, half, max(1, clients - clients // 2), f"{tag}-b"),
        ]

    def b_round(self) -> set[str]:
        """Message-IDs of the recipients a round of host B holds right now."""
        rows = self.query(
            "SELECT DISTINCT r.lease_owner, m.message_id FROM queues_recipient r "
            "JOIN queues_message m ON m.id = r.message_id WHERE r.state = 'active'"
        )
        b_pids = {p for p in _pids_of(self.hosts["b"])}
        return {mid for owner, mid in rows if _pid_of(owner) in b_pids}

    def left_claimed(self) -> dict[str, int]:
        rows = self.query(
            "SELECT (SELECT count(*) FROM queues_link WHERE lease_owner <> ''),"
            " (SELECT count(*) FROM queues_recipient WHERE state = 'active'),"
            " (SELECT count(*) FROM queues_message WHERE state = 'categorizing')"
        )
        links, active, categorizing = rows[0]
        return {"links": links, "active": active, "categorizing": categorizing}


def _pid_of(owner: str) -> int | None:
    try:
        return int(owner.split(":")[1])
    except (IndexError, ValueError):
        return None


def _pids_of(host: Host) -> list[int]:
    """Every live process of ``host``'s user."""
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and pid_uid(int(entry)) == host.uid:
            pids.append(int(entry))
    return pids


# --- the faults (each returns what it measured at the moment it hit) -----------------------


def fault_kill9(th: TwoHosts, hold: float) -> dict[str, int]:
    b = th.hosts["b"]
    sink = (th.sink.host, th.sink.port)
    opened = outbound_open(b.uid, sink)
    th.signal_host("b", signal.SIGKILL)
    for proc in b.procs.values():
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.popen.wait(10)
    return {"outbound_open_at_kill": opened}


def fault_freeze(th: TwoHosts, hold: float) -> dict[str, int]:
    th.signal_host("b", signal.SIGSTOP)
    try:
        time.sleep(hold)
    finally:
        th.signal_host("b", signal.SIGCONT)
    return {}


def fault_partition(th: TwoHosts, hold: float) -> dict[str, int]:
    partition_on(th.hosts["b"].uid)
    try:
        time.sleep(hold)
    finally:
        remove_rules()
    return {}


FAULTS: dict[str, Callable[[TwoHosts, float], dict[str, int]]] = {
    "kill9": fault_kill9,
    "freeze": fault_freeze,
    "partition": fault_partition,
}


# --- what happened ---------------------------------------------------------------------------


@dataclass
class ClaimTimes:
    expiry: float | None  # max lease_until of B's claims at the fault (wall clock)
    takeover: float | None  # first poll after the fault where A held the link
    new_b: list[tuple[float, float]]  # (first, last seen) of B link claims taken after the fault


def claim_times(watch: ClaimWatch, fault_at: float) -> ClaimTimes:
    before = [s for s in watch.samples if s.at <= fault_at and s.kind in ("link", "round")]
    last_poll = max((s.at for s in before), default=0.0)
    tokens = {s.token for s in before if s.host == "b" and s.at == last_poll}
    held = [s.until for s in watch.samples if s.token in tokens and s.kind in ("link", "round")]
    takeover = min(
        (s.at for s in watch.samples if s.kind == "link" and s.host == "a" and s.at > fault_at),
        default=None,
    )
    spans: dict[str, tuple[float, float]] = {}
    for s in watch.samples:
        if s.kind == "link" and s.host == "b" and s.at > fault_at and s.token not in tokens:
            first, _ = spans.get(s.token, (s.at, s.at))
            spans[s.token] = (first, s.at)
    return ClaimTimes(max(held, default=None), takeover, list(spans.values()))


@dataclass
class Sends:
    after_valid: int = 0  # MAIL FROM by B after lease_until - margin of its old claims
    after_expiry: int = 0  # ... after their lease_until
    after_takeover: int = 0  # ... after A was seen holding the link
    under_new_claim: int = 0  # B's MAIL FROMs after that under a claim B took afresh
    details: list[str] = field(default_factory=list)


def sends_after_loss(sink: HostSink, times: ClaimTimes, fault_at: float) -> Sends:
    out = Sends()
    if times.expiry is None:
        return out
    valid_end = times.expiry - MARGIN
    for at, conn, host in list(sink.mails):
        if host != "b" or at <= valid_end:
            continue
        # A new claim of B (taken after the fault) that held the link then: legitimate.
        if any(first - 0.3 <= at <= last + 0.3 for first, last in times.new_b):
            out.under_new_claim += 1
            continue
        out.after_valid += 1
        out.after_expiry += at > times.expiry
        out.after_takeover += times.takeover is not None and at > times.takeover
        if len(out.details) < 8:
            opened = sink.conn_opened.get(conn, 0.0) - fault_at
            out.details.append(
                f"MAIL at +{at - fault_at:.2f}s on conn {conn} (opened {opened:+.2f}s)"
            )
    return out


@dataclass
class Outcome:
    fault: str
    accepted: int
    refused: int
    lost: int
    duplicates: int
    worst_copies: int
    sends: Sends
    expiry_s: float | None  # B's old claims' lease_until, from the fault
    takeover_s: float | None
    recovered_s: float | None  # fault -> last accepted message at the sink
    b_round: int  # messages B's round held at the fault and not yet at the sink
    b_round_by_a: int  # of those, delivered by A within STRANDED_WITHIN
    # of those, delivered once by B itself after ``fault_at`` and recorded (A never
    # sent them): the fault took hold a moment after ``fault_at`` (iptables runs)
    b_round_by_b: int
    b_round_last_s: float | None
    left: dict[str, int]
    measured: dict[str, int]
    log_lines: list[str] = field(default_factory=list)
    copies: list[str] = field(default_factory=list)  # arrivals of duplicated messages
    sessions: list[str] = field(default_factory=list)  # long lock waits / open transactions


def delivery_figures(sink: HostSink, accepted: list[str], held: set[str], fault_at: float) -> dict:
    arrivals = list(sink.arrivals)
    first: dict[str, Arrival] = {}
    for a in arrivals:
        if a.mid is not None and a.mid not in first:
            first[a.mid] = a
    copies = Counter(a.mid for a in arrivals if a.mid is not None)
    missing = [m for m in accepted if m not in first]
    last = max((first[m].at for m in accepted if m in first), default=fault_at)
    stranded = {m for m in held if m not in first or first[m].at > fault_at}
    by_a: dict[str, float] = {}
    for a in arrivals:
        if a.mid in stranded and a.host == "a" and a.at > fault_at:
            by_a.setdefault(a.mid, a.at)
    in_time = [at for at in by_a.values() if at <= fault_at + STRANDED_WITHIN]
    by_b = [m for m in stranded if m in first and first[m].host == "b" and m not in by_a]
    times: dict[str, list[str]] = {}
    for a in arrivals:
        if a.mid is not None and copies[a.mid] > 1:
            times.setdefault(a.mid, []).append(f"{a.host} {a.at - fault_at:+.1f}s")
    return {
        "copies": [f"{mid}: {', '.join(t)}" for mid, t in list(times.items())[:12]],
        "lost": len(missing),
        "duplicates": sum(n - 1 for n in copies.values()),
        "worst_copies": max(copies.values(), default=0),
        "recovered_s": None if missing else last - fault_at,
        "b_round": len(stranded),
        "b_round_by_a": len(in_time),
        "b_round_by_b": len(by_b),
        "b_round_last_s": max(by_a.values()) - fault_at if by_a else None,
    }


def claim_log_lines(th: TwoHosts, limit: int = 6) -> list[str]:
    """B's own words about its claims (each worker logs 'lost the claim ...')."""
    lines: list[str] = []
    for name, proc in th.hosts["b"].procs.items():
        for line in proc.output().splitlines():
            if "lost the claim" in line or "could not renew" in line:
                lines.append(f"b/{name}: {line.strip()[:200]}")
    return lines[:limit]


# --- one run per fault -----------------------------------------------------------------------


def wait_b_round(th: TwoHosts, fault_after: int, timeout: float, min_pending: int = 1) -> set[str]:
    """Wait until ``fault_after`` messages reached the sink and a round of B holds
    at least ``min_pending`` messages not yet at the sink, with connections open
    to it (not a round that is only recording); return the Message-IDs it holds."""
    deadline = time.monotonic() + timeout
    b, sink = th.hosts["b"], (th.sink.host, th.sink.port)
    while time.monotonic() < deadline:
        # Mid-round: B holds recipients and has connections open to the sink.
        if len(th.sink.arrivals) >= fault_after and outbound_open(b.uid, sink):
            held = th.b_round()
            arrived = {a.mid for a in list(th.sink.arrivals)}
            if len(held - arrived) >= min_pending:
                return held
        time.sleep(0.05)
    raise RuntimeError(f"no round of host B after {timeout:.0f} s (logs in {th.logs})")


def settle(th: TwoHosts, timeout: float) -> None:
    """Wait until every recipient is final, so late copies are counted."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(Exception):
            states = th.states()
            if states and not set(states) - FINAL:
                return
        time.sleep(0.25)


def run_fault(name: str, args: argparse.Namespace) -> Outcome:
    with TwoHosts(args.sink_delay, args.beat, args.root) as th:
        watch = ClaimWatch(th.pg.url().replace("postgres://", "postgresql://"), th.uid_host)
        watch.start()
        jobs = th.send_both(args.messages, args.clients, name)
        wait_b_round(th, 1, 180)
        th.start_a_delivery()
        held = wait_b_round(th, args.fault_after, 180, min_pending=20)
        fault_at = time.time()
        measured = FAULTS[name](th, args.hold)
        by_host = Counter(a.host for a in list(th.sink.arrivals) if a.at <= fault_at)
        measured.update({f"at_sink_from_{k}_before": n for k, n in sorted(by_host.items())})
        results = [job.wait(args.cap) for job in jobs]
        accepted = [m for r in results for m in r.accepted]
        left = args.cap - (time.time() - fault_at)
        th.wait_delivered(accepted, max(0.0, left))
        settle(th, 30)
        time.sleep(1.0)  # a last poll of the claims
        watch.stop()
        times = claim_times(watch, fault_at)
        figures = delivery_figures(th.sink, accepted, held, fault_at)
        outcome = Outcome(
            fault=name,
            accepted=len(accepted),
            refused=sum(len(r.refused) for r in results),
            sends=sends_after_loss(th.sink, times, fault_at),
            expiry_s=None if times.expiry is None else times.expiry - fault_at,
            takeover_s=None if times.takeover is None else times.takeover - fault_at,
            left=th.left_claimed(),
            measured=measured,
            log_lines=claim_log_lines(th),
            sessions=watch.long_sessions(fault_at),
            **figures,
        )
        if os.environ.get("FAULTS_KEEP_CLUSTER"):
            print(f"  (logs in {th.logs})")
        return outcome


def _s(value: float | None, missing: str = "-") -> str:
    return missing if value is None else f"{value:.1f}"


HEADER = (
    "| fault | accepted / refused | lost | dups (worst copies) | B sends after claim lost "
    "(after lease-margin / lease / A took over; under a new B claim) | B's claims expire / "
    "A takes the link | fault → last accepted at sink | B's round delivered by A ≤ 60 s "
    "(last at) | left claimed at end | B's outbound conns at kill |"
)


def table_row(o: Outcome) -> str:
    s = o.sends
    left = ", ".join(f"{k} {v}" for k, v in o.left.items())
    conns = o.measured.get("outbound_open_at_kill")
    return (
        f"| {o.fault} | {o.accepted} / {o.refused} | {o.lost} | {o.duplicates} ({o.worst_copies})"
        f" | **{s.after_valid}** / {s.after_expiry} / {s.after_takeover}; {s.under_new_claim}"
        f" | +{_s(o.expiry_s)} s / +{_s(o.takeover_s)} s"
        f" | {_s(o.recovered_s, 'not recovered')} s"
        f" | {o.b_round_by_a} of {o.b_round} (+{_s(o.b_round_last_s)} s)"
        f"{f', {o.b_round_by_b} by B itself' if o.b_round_by_b else ''} | {left}"
        f" | {'-' if conns is None else conns} |"
    )


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--faults", default=",".join(FAULTS), help="comma list of " + ", ".join(FAULTS))
    p.add_argument("--messages", type=int, default=1200)
    p.add_argument("--clients", type=int, default=6, help="SMTP clients, half on each host")
    p.add_argument("--fault-after", type=int, default=150, help="messages at the sink first")
    p.add_argument("--sink-delay", type=float, default=0.07, help="seconds per final dot")
    p.add_argument("--hold", type=float, default=90, help="freeze / partition seconds")
    p.add_argument("--cap", type=float, default=300, help="seconds before 'not recovered'")
    p.add_argument("--beat", choices=("a", "both"), default="a", help="hosts that run beat")
    p.add_argument("--json", type=Path, help="also write the outcomes here")
    p.add_argument(
        "--commit",
        default="HEAD",
        help="run the relay from this commit of the checkout, extracted with git archive "
        "(a fixed tree while others commit); '' = the working tree as it is",
    )
    args = p.parse_args(argv)
    install_cleanup()
    args.root, commit = relay_tree(args.commit)
    print(
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, commit {commit}; "
        f"{args.messages} messages from {args.clients} clients, fault after {args.fault_after} "
        f"at the sink and a round of B, sink {args.sink_delay * 1000:g} ms/message, "
        f"hold {args.hold:g} s, beat on {args.beat}",
        flush=True,
    )
    outcomes = []
    for name in args.faults.split(","):
        try:
            outcomes.append(run_fault(name, args))
        except Exception as exc:  # noqa: BLE001 - report it and go on with the next fault
            print(f"{name}: failed to run: {exc}", flush=True)
        finally:
            remove_rules()
        if outcomes and outcomes[-1].fault == name:
            report(outcomes[-1])
    print("\n" + HEADER + "\n" + "|---" * (HEADER.count("|") - 1) + "|")
    for o in outcomes:
        print(table_row(o))
    left_rules = leftover_rules()
    print(
        f"iptables -S: {len(left_rules)} rule(s) of ours left"
        + "".join(f"\n  {r}" for r in left_rules)
    )
    if args.json:
        args.json.write_text(json.dumps([asdict(o) for o in outcomes], indent=2))
    return 0 if outcomes and all(_met(o) for o in outcomes) and not left_rules else 1


def relay_tree(commit: str) -> tuple[Path, str]:
    """(the folder the relay runs from, its commit): ``commit`` extracted into a
    temporary folder (removed at exit), or the checkout itself for ''."""
    git = ["git", "-C", str(CHECKOUT)]
    rev = subprocess.run(
        [*git, "rev-parse", "--short", commit or "HEAD"], capture_output=True, text=True, check=True
    ).stdout.strip()
    if not commit:
        return CHECKOUT, f"{rev} + working tree"
    dest = Path(tempfile.mkdtemp(prefix=f"mr-tree-{rev}-"))
    dest.chmod(0o755)  # the host users read it
    atexit.register(shutil.rmtree, dest, True)
    archive = subprocess.run([*git, "archive", rev], capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(dest)], input=archive, check=True)
    return dest, rev


def report(o: Outcome) -> None:
    print(f"\n{o.fault}: " + table_row(o), flush=True)
    print("  " + ", ".join(f"{k} {v}" for k, v in o.measured.items()))
    for line in o.sends.details:
        print(f"  B after its claim was lost: {line}")
    for line in o.copies:
        print(f"  copies of {line}")
    for line in o.sessions:
        print(f"  PostgreSQL session of {line}")
    for line in o.log_lines:
        print(f"  {line}")


def _met(o: Outcome) -> bool:
    """The issue's targets."""
    if o.lost or o.recovered_s is None:
        return False
    if o.fault == "kill9":
        return o.duplicates <= o.measured.get("outbound_open_at_kill", 0)
    return o.sends.after_valid == 0 and o.b_round_by_a + o.b_round_by_b == o.b_round


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
