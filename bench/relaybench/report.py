"""relay_throughput's figures: one load's measurements (``Phase``) and how
they are printed (each run, the processes, the checks, the medians of
``--runs``) and written as JSON."""

from __future__ import annotations

import argparse
import os
import platform
import statistics
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import psutil

from relaybench.mailrelay import DbCheck
from relaybench.procmon import LabelStats
from relaybench.util import percentile

# mailrelay end to end against Postfix, side by side (issue #14: at least 1.0x).
TARGET_RATIO = 1.0
LOADER_TITLES = {"smtp-source": "smtp-source", "client": "asyncio client"}
MiB = 1024 * 1024


@dataclass
class Phase:
    system: str
    loader: str
    messages: int
    accepted: int = 0
    rejected: int = 0
    errors: list[str] = field(default_factory=list)
    t_start: float = 0.0  # first connect (wall clock)
    t_accept_end: float = 0.0  # last 250 (client) / smtp-source exit
    t_last_delivery: float | None = None
    at_sink_counter: int = 0
    at_sink_files: int = 0
    distinct_relay_ids: int = 0
    duplicates: int = 0
    without_id: int = 0
    over_tls: int = 0  # dumps the asyncio sink received over TLS
    tls_versions: dict[str, int] = field(default_factory=dict)
    signed: int = 0  # dumps with a DKIM-Signature
    sink_sessions: int = 0  # connections to the sink that carried this phase's messages
    sink_tls_sessions: int = 0  # of which STARTTLS handshakes (asyncio sink)
    seq_missing: int | None = None
    complete: bool = False
    latencies_ms: list[float] | None = None
    db: DbCheck | None = None
    relay_checks: list[str] = field(default_factory=list)  # failed relay-side checks
    processes: dict[str, LabelStats] = field(default_factory=dict)
    peak_group_rss: dict[str, int] = field(default_factory=dict)
    peak_group_pss: dict[str, int] = field(default_factory=dict)
    machine_busy: float = 0.0
    machine_irq: float = 0.0
    others: dict[str, float] = field(default_factory=dict)
    window: float = 0.0

    @property
    def accept_seconds(self) -> float:
        return self.t_accept_end - self.t_start

    @property
    def accept_rate(self) -> float | None:
        s = self.accept_seconds
        return self.accepted / s if s > 0 and self.accepted else None

    @property
    def e2e_seconds(self) -> float | None:
        return self.t_last_delivery - self.t_start if self.t_last_delivery else None

    @property
    def e2e_rate(self) -> float | None:
        s = self.e2e_seconds
        return self.at_sink_files / s if s and s > 0 and self.complete else None

    def exactly_once(self) -> bool:
        ok = (
            self.complete
            and self.accepted == self.messages
            and self.at_sink_files == self.accepted
            and self.distinct_relay_ids == self.accepted
            and self.duplicates == 0
            and self.without_id == 0
            and not self.relay_checks
        )
        if self.seq_missing is not None:
            ok = ok and self.seq_missing == 0
        if self.db is not None:
            ok = ok and self.db.ok(self.accepted)
        return ok


def fmt(v: float | None, spec: str = ".0f", unit: str = "") -> str:
    return "-" if v is None else f"{v:{spec}}{unit}"


def machine() -> str:
    model = "?"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem = psutil.virtual_memory().total / 2**30
    return f"{os.cpu_count()} CPUs ({model}), {mem:.0f} GiB RAM, {platform.platform()}"


def print_summary(phases: list[Phase], args: argparse.Namespace) -> None:
    systems = list(dict.fromkeys(p.system for p in phases))
    loaders = list(dict.fromkeys(p.loader for p in phases))
    by = {(p.system, p.loader): p for p in phases}
    width = 22
    print()
    print(
        f"== relay_throughput: {args.messages} messages of {args.size} bytes, "
        f"{args.sessions} sessions, loopback =="
    )
    sink = "asyncio sink offering STARTTLS" if args.sink_tls else args.sink
    print(f"sink: {sink}; mailrelay DKIM signing: {args.dkim}")
    print(f"machine: {machine()}")
    for loader in loaders:
        print()
        print(f"load: {LOADER_TITLES[loader]}".ljust(36) + "".join(s.rjust(width) for s in systems))
        rows: list[tuple[str, Any]] = [
            ("accept rate (msg/s)", lambda p: fmt(p.accept_rate)),
            ("end-to-end rate (msg/s)", lambda p: fmt(p.e2e_rate)),
            (
                "accept time / end-to-end (s)",
                lambda p: f"{p.accept_seconds:.2f} / {fmt(p.e2e_seconds, '.2f')}",
            ),
        ]
        if loader == "client":
            offered = f" at {args.rate:g} msg/s offered" if args.rate else ""
            rows.append(
                (
                    f"accept latency p50/p99 (ms){offered}",
                    lambda p: (
                        f"{fmt(percentile(p.latencies_ms or [], 50), '.1f')} / "
                        f"{fmt(percentile(p.latencies_ms or [], 99), '.1f')}"
                    ),
                )
            )
        rows += [
            ("delivered at sink / accepted", lambda p: f"{p.at_sink_files} / {p.accepted}"),
            ("exactly once", lambda p: "yes" if p.exactly_once() else "NO"),
            (
                "CPU busy, whole machine (%)",
                lambda p: fmt(
                    100 * p.machine_busy / p.window / (os.cpu_count() or 1) if p.window else None
                ),
            ),
            (
                "CPU ms/msg: relay (+ PG, Redis)",
                lambda p: fmt(1000 * cpu_of(p, p_group(p)) / max(p.accepted, 1), ".2f"),
            ),
            (
                "peak RSS / PSS, relay total (MiB)",
                lambda p: (
                    f"{p.peak_group_rss.get(p_group(p), 0) / MiB:.0f} / "
                    f"{p.peak_group_pss.get(p_group(p), 0) / MiB:.0f}"
                ),
            ),
        ]
        for title, get in rows:
            line = f"  {title}".ljust(36)
            for s in systems:
                p = by.get((s, loader))
                line += (get(p) if p else "-").rjust(width)
            print(line)
    if len(systems) == 2:
        for loader in loaders:
            a, b = by.get((systems[0], loader)), by.get((systems[1], loader))
            if a and b and a.e2e_rate and b.e2e_rate:
                ratio = b.e2e_rate / a.e2e_rate
                verdict = "meets" if ratio >= TARGET_RATIO else "is BELOW"
                print(
                    f"\n{LOADER_TITLES[loader]}: {systems[1]} end-to-end = {100 * ratio:.0f}% "
                    f"of {systems[0]}'s; {verdict} the target of {100 * TARGET_RATIO:.0f}% "
                    "(issue #14)"
                )
    for p in phases:
        print_processes(p)
        print_checks(p)


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a and b else None


def run_figures(phases: list[Phase], loader: str) -> dict[str, float | None]:
    """One run's figures for one load: each system's, and mailrelay's over Postfix's."""
    by = {p_group(p): p for p in phases if p.loader == loader}
    pf, mr = by.get("postfix"), by.get("mailrelay")
    out: dict[str, float | None] = {}
    for name, p in (("postfix", pf), ("mailrelay", mr)):
        out[f"{name} e2e"] = p.e2e_rate if p else None
        out[f"{name} accept"] = p.accept_rate if p else None
        out[f"{name} cpu"] = 1000 * cpu_of(p, name) / max(p.accepted, 1) if p else None
    out["e2e ratio"] = _ratio(out["mailrelay e2e"], out["postfix e2e"])
    out["accept ratio"] = _ratio(out["mailrelay accept"], out["postfix accept"])
    out["cpu ratio"] = _ratio(out["mailrelay cpu"], out["postfix cpu"])
    db = mr.db if mr else None
    per = max(mr.accepted, 1) if mr else 1
    pg = db.pg if db else {}
    out["rows inserted/msg"] = pg["tup_inserted"] / per if "tup_inserted" in pg else None
    out["rows updated/msg"] = pg["tup_updated"] / per if "tup_updated" in pg else None
    out["WAL records/msg"] = pg["wal_records"] / per if "wal_records" in pg else None
    out["WAL kB/msg"] = pg["wal_bytes"] / per / 1024 if "wal_bytes" in pg else None
    out["in-relay p99 (s)"] = db.delay_p99 if db else None
    return out


MEDIAN_ROWS = (
    ("postfix e2e", "Postfix end-to-end (msg/s)", ".0f"),
    ("mailrelay e2e", "mailrelay end-to-end (msg/s)", ".0f"),
    ("e2e ratio", "end-to-end, mailrelay / Postfix", ".2f"),
    ("postfix accept", "Postfix accept (msg/s)", ".0f"),
    ("mailrelay accept", "mailrelay accept (msg/s)", ".0f"),
    ("accept ratio", "accept, mailrelay / Postfix", ".2f"),
    ("postfix cpu", "Postfix CPU ms/msg (relay)", ".2f"),
    ("mailrelay cpu", "mailrelay CPU ms/msg (+ PG, Redis)", ".2f"),
    ("cpu ratio", "CPU per message, mailrelay / Postfix", ".2f"),
    ("rows inserted/msg", "PostgreSQL rows inserted / msg", ".2f"),
    ("rows updated/msg", "PostgreSQL rows updated / msg", ".2f"),
    ("WAL records/msg", "PostgreSQL WAL records / msg", ".1f"),
    ("WAL kB/msg", "PostgreSQL WAL kB / msg", ".1f"),
    ("in-relay p99 (s)", "in-relay delay p99 (s)", ".2f"),
)


def print_medians(runs: list[list[Phase]], args: argparse.Namespace) -> None:
    """Each run's figures side by side and their median (issue #24's figure)."""
    for loader in args.loaders:
        figures = [run_figures(phases, loader) for phases in runs]
        print(
            f"\n== {len(runs)} runs, {LOADER_TITLES[loader]}: each run, then the median "
            f"({'docker-compose processes' if args.compose else 'make run workers'}) =="
        )
        head = "".join(f"run {n + 1}".rjust(9) for n in range(len(runs)))
        print("  figure".ljust(40) + head + "median".rjust(9))
        for key, title, spec in MEDIAN_ROWS:
            values = [f[key] for f in figures]
            known = [v for v in values if v is not None]
            median = statistics.median(known) if known else None
            cells = "".join(fmt(v, spec).rjust(9) for v in values)
            print(f"  {title}".ljust(40) + cells + fmt(median, spec).rjust(9))
        exact = all(p.exactly_once() for phases in runs for p in phases if p.loader == loader)
        print(f"  exactly once in every run: {'yes' if exact else 'NO'}")


def p_group(p: Phase) -> str:
    return "postfix" if p.system.startswith("Postfix") else "mailrelay"


def cpu_of(p: Phase, group: str) -> float:
    return sum(s.cpu for label, s in p.processes.items() if label.split(":", 1)[0] == group)


def print_processes(p: Phase) -> None:
    print()
    print(
        f"-- {p.system}, {LOADER_TITLES[p.loader]}: processes (window {p.window:.1f} s; "
        "peak of the RSS summed per name, sampled every 0.1 s; PSS every 1 s)"
    )
    print(
        f"  {'process':44} {'n':>3} {'peak RSS':>10} {'max 1 proc':>11} {'peak PSS':>10} "
        f"{'CPU s':>7} {'CPU ms/msg':>11}"
    )
    n = max(p.accepted, 1)
    order = {"postfix": 0, "mailrelay": 0, "shared": 1, "sink": 2, "load": 3, "bench": 4}
    tracked = 0.0
    for label, s in sorted(
        p.processes.items(), key=lambda kv: (order.get(kv[0].split(":")[0], 9), -kv[1].cpu)
    ):
        tracked += s.cpu
        print(
            f"  {label:44} {s.max_procs:>3} {s.peak_rss / MiB:>8.1f}Mi "
            f"{s.peak_single_rss / MiB:>9.1f}Mi "
            f"{(f'{s.peak_pss / MiB:.1f}Mi' if s.peak_pss else '-'):>10} "
            f"{s.cpu:>7.2f} {1000 * s.cpu / n:>11.3f}"
        )
    grp = p_group(p)
    print(
        f"  {'= ' + grp + ' total (peak of the sum)':44} {'':>3} "
        f"{p.peak_group_rss.get(grp, 0) / MiB:>8.1f}Mi {'':>11} "
        f"{p.peak_group_pss.get(grp, 0) / MiB:>8.1f}Mi {cpu_of(p, grp):>7.2f} "
        f"{1000 * cpu_of(p, grp) / n:>11.3f}"
    )
    other = p.machine_busy - tracked
    print(
        f"  {'(machine busy, all processes)':44} {'':>3} {'':>10} {'':>11} {'':>10} "
        f"{p.machine_busy:>7.2f}   not in the rows above: {other:.2f} s"
    )
    top = sorted(p.others.items(), key=lambda kv: -kv[1])[:4]
    print(
        f"    of which interrupts/softirq (loopback TCP, disk): {p.machine_irq:.2f} s; "
        "other processes: " + (", ".join(f"{name} {cpu:.2f} s" for name, cpu in top) or "none seen")
    )


def print_checks(p: Phase) -> None:
    notes = []
    notes.append(
        f"sink counter {p.at_sink_counter}, dump files {p.at_sink_files}, "
        f"distinct relay queue ids {p.distinct_relay_ids}, duplicates {p.duplicates}, "
        f"without queue id {p.without_id}"
    )
    if p.sink_sessions:
        notes.append(
            f"connections to the sink: {p.sink_sessions} "
            f"({p.at_sink_files / p.sink_sessions:.1f} messages each), "
            f"STARTTLS handshakes: {p.sink_tls_sessions}"
        )
    if p.over_tls or p.signed:
        versions = ", ".join(f"{k} {v}" for k, v in sorted(p.tls_versions.items()))
        notes.append(
            f"at the sink over TLS: {p.over_tls}"
            + (f" ({versions})" if versions else "")
            + f"; with a DKIM-Signature: {p.signed}"
        )
    if p.seq_missing is not None:
        notes.append(f"load-client messages missing at the sink: {p.seq_missing}")
    if p.db is not None:
        d = p.db
        notes.append(
            f"database: {d.messages} messages ({d.not_done} not done), {d.recipients} "
            f"recipients ({d.delivered} delivered, others {d.not_delivered_states or 'none'}), "
            f"attempts {d.attempts_delivered} delivered / {d.attempts_other} other; "
            f"in-relay delay (received -> delivered) p50 {fmt(d.delay_p50, '.2f')} s, "
            f"p99 {fmt(d.delay_p99, '.2f')} s"
        )
        per = max(p.accepted, 1)
        if d.pg:
            notes.append(
                "PostgreSQL ("
                + ", ".join(f"{k} {v} = {v / per:.2f}/msg" for k, v in d.pg.items())
                + ")"
            )
        if d.tasks:
            notes.append(
                "Celery tasks: "
                + "; ".join(
                    f"{name} {n} tasks, {items / max(n, 1):.1f} items/task, "
                    f"{1000 * secs / max(n, 1):.0f} ms/task"
                    for name, (n, items, secs) in sorted(d.tasks.items())
                )
            )
    notes += [f"relay check FAILED: {c}" for c in p.relay_checks]
    notes += [f"load: {e}" for e in p.errors]
    if not p.complete:
        notes.append("INCOMPLETE: not every accepted message reached the sink")
    for note in notes:
        print(f"  {note}")


def phase_json(p: Phase) -> dict[str, Any]:
    d = asdict(p)
    d.pop("latencies_ms", None)
    lat = p.latencies_ms or []
    d.update(
        accept_rate=p.accept_rate,
        e2e_rate=p.e2e_rate,
        exactly_once=p.exactly_once(),
        latency_p50_ms=percentile(lat, 50),
        latency_p99_ms=percentile(lat, 99),
    )
    d["processes"] = {
        k: {
            "peak_rss": v.peak_rss,
            "peak_single_rss": v.peak_single_rss,
            "peak_pss": v.peak_pss,
            "max_procs": v.max_procs,
            "cpu": v.cpu,
        }
        for k, v in p.processes.items()
    }
    return d
