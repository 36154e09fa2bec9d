"""Peak memory and CPU time of the processes under test, sampled with psutil.

A ``ProcessMonitor`` runs in a thread for one phase. Every ``interval``
(0.1 s) it reads RSS and CPU times of every tracked process; every
``rescan`` (0.5 s) it asks the ``resolver`` which processes to track
(``{pid: label}``), so processes that a relay forks during the run (Postfix's
smtpd/cleanup/smtp, Celery's pool children, new PostgreSQL backends) are
picked up. Figures per label:

- peak RSS: the largest sum over the label's processes at one sample (and the
  largest single process, and how many processes carried the label at most);
- CPU seconds used inside the window (a process alive at the start counts
  from its CPU time then; a process born in the window counts from zero; the
  CPU a process burns after its last sample before exiting, at most one
  interval, is missed).

It also measures the machine's busy CPU over the window, so CPU used by
processes we do not track (other work on a shared machine) is visible.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import psutil

Resolver = Callable[[], dict[int, str]]


@dataclass
class LabelStats:
    label: str
    peak_rss: int = 0  # bytes, peak of the sum over the label's processes
    peak_single_rss: int = 0
    peak_pss: int = 0  # bytes, peak of the summed PSS (sampled every ``pss_every``)
    max_procs: int = 0
    cpu: float = 0.0  # seconds in the window
    pids: set[int] = field(default_factory=set)


@dataclass
class _PidState:
    label: str
    proc: psutil.Process
    cpu_base: float
    cpu_last: float


class ProcessMonitor:
    def __init__(
        self,
        resolver: Resolver,
        interval: float = 0.1,
        rescan: float = 0.5,
        pss_every: int = 10,
        reaped: dict[int, str] | None = None,
    ) -> None:
        self.resolver = resolver
        # {pid: label}: count the CPU of this process's children that exited in the
        # window (from its cumulative children times), e.g. PostgreSQL backends
        # that live for one Celery task, too short for the sampling to see.
        self.reaped = reaped or {}
        self._reaped_start: dict[int, float] = {}
        self.pss_every = pss_every
        self.interval = interval
        self.rescan = rescan
        self.stats: dict[str, LabelStats] = {}
        self.peak_total_rss: dict[str, int] = {}  # group prefix -> peak of its summed RSS
        self.peak_total_pss: dict[str, int] = {}  # group prefix -> peak of its summed PSS
        self._pids: dict[int, _PidState] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="procmon", daemon=True)
        self._machine_start: psutil._common.scputimes | None = None  # type: ignore[name-defined]
        self.machine_busy = 0.0  # CPU-seconds the whole machine was busy in the window
        self.machine_irq = 0.0  # of which interrupt/softirq time (loopback TCP, disk)
        self.others: dict[str, float] = {}  # untracked processes by name: CPU seconds
        self._all_start: dict[int, tuple[str, float]] = {}
        self.elapsed = 0.0
        self.samples = 0

    # -- lifecycle
    def start(self) -> None:
        self._t0 = time.monotonic()
        self._machine_start = psutil.cpu_times()
        self._all_start = _all_processes()
        self._reaped_start = {pid: _children_cpu(pid) for pid in self.reaped}
        self._scan(initial=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()
        self._sample()
        self.elapsed = time.monotonic() - self._t0
        end = psutil.cpu_times()
        start = self._machine_start
        assert start is not None

        def busy(t: psutil._common.scputimes) -> float:  # type: ignore[name-defined]
            idle = t.idle + sum(getattr(t, k, 0.0) for k in ("iowait", "steal"))
            counted_twice = sum(getattr(t, k, 0.0) for k in ("guest", "guest_nice"))
            return sum(t) - idle - counted_twice

        self.machine_busy = busy(end) - busy(start)
        self.machine_irq = sum(
            getattr(end, k, 0.0) - getattr(start, k, 0.0) for k in ("irq", "softirq")
        )
        for st in self._pids.values():
            self.stats[st.label].cpu += st.cpu_last - st.cpu_base
        self._pids.clear()
        for pid, label in self.reaped.items():
            used = _children_cpu(pid) - self._reaped_start.get(pid, 0.0)
            if used > 0:
                self.stats.setdefault(label, LabelStats(label)).cpu += used
        # Who else used the machine (alive at the end; short-lived processes are missed).
        tracked = set().union(*(ls.pids for ls in self.stats.values())) if self.stats else set()
        for pid, (name, cpu) in _all_processes().items():
            if pid in tracked:
                continue
            before = self._all_start.get(pid)  # (kernel threads change names: match by pid)
            used = cpu - before[1] if before else cpu
            if used > 0.005:
                self.others[name] = self.others.get(name, 0.0) + used

    # -- internals
    def _run(self) -> None:
        next_scan = time.monotonic() + self.rescan
        while not self._stop.wait(self.interval):
            if time.monotonic() >= next_scan:
                self._scan(initial=False)
                next_scan = time.monotonic() + self.rescan
            self._sample()

    def _scan(self, initial: bool) -> None:
        try:
            wanted = self.resolver()
        except Exception:  # noqa: BLE001 - a vanished process mid-scan: try next time
            return
        for pid, label in wanted.items():
            if pid in self._pids:
                continue
            try:
                proc = psutil.Process(pid)
                t = proc.cpu_times()
            except psutil.Error:
                continue
            cpu = t.user + t.system
            # Born inside the window: all its CPU belongs to the window.
            base = cpu if initial else 0.0
            self._pids[pid] = _PidState(label, proc, base, cpu)
            self.stats.setdefault(label, LabelStats(label)).pids.add(pid)

    def _sample(self) -> None:
        sums: dict[str, int] = {}
        pss_sums: dict[str, int] = {}
        counts: dict[str, int] = {}
        gone: list[int] = []
        # PSS (shared pages divided among their users) is dearer to read: every
        # pss_every-th sample. Summed RSS counts shared libraries once per process.
        with_pss = self.samples % self.pss_every == 0
        for pid, st in self._pids.items():
            try:
                with st.proc.oneshot():
                    rss = st.proc.memory_info().rss
                    t = st.proc.cpu_times()
                if with_pss:
                    pss_sums[st.label] = pss_sums.get(st.label, 0) + st.proc.memory_full_info().pss
            except psutil.Error:
                gone.append(pid)
                continue
            st.cpu_last = t.user + t.system
            ls = self.stats[st.label]
            ls.peak_single_rss = max(ls.peak_single_rss, rss)
            sums[st.label] = sums.get(st.label, 0) + rss
            counts[st.label] = counts.get(st.label, 0) + 1
        for pid in gone:
            st = self._pids.pop(pid)
            self.stats[st.label].cpu += st.cpu_last - st.cpu_base
        groups: dict[str, int] = {}
        for label, total in sums.items():
            ls = self.stats[label]
            ls.peak_rss = max(ls.peak_rss, total)
            ls.max_procs = max(ls.max_procs, counts[label])
            group = label.split(":", 1)[0]
            groups[group] = groups.get(group, 0) + total
        for group, total in groups.items():
            self.peak_total_rss[group] = max(self.peak_total_rss.get(group, 0), total)
        pss_groups: dict[str, int] = {}
        for label, total in pss_sums.items():
            ls = self.stats[label]
            ls.peak_pss = max(ls.peak_pss, total)
            group = label.split(":", 1)[0]
            pss_groups[group] = pss_groups.get(group, 0) + total
        for group, total in pss_groups.items():
            self.peak_total_pss[group] = max(self.peak_total_pss.get(group, 0), total)
        self.samples += 1


def _children_cpu(pid: int) -> float:
    """CPU seconds of the process's exited (reaped) children, cumulated."""
    try:
        t = psutil.Process(pid).cpu_times()
    except psutil.Error:
        return 0.0
    return t.children_user + t.children_system


def _all_processes() -> dict[int, tuple[str, float]]:
    out = {}
    for proc in psutil.process_iter(["name", "cpu_times"]):
        t = proc.info["cpu_times"]
        if t is not None:
            out[proc.pid] = (proc.info["name"] or "?", t.user + t.system)
    return out


# -- resolvers --------------------------------------------------------------------------


def descendants(pid: int) -> list[psutil.Process]:
    try:
        root = psutil.Process(pid)
        return [root, *root.children(recursive=True)]
    except psutil.Error:
        return []


def find_postmaster(port: int = 5432) -> psutil.Process | None:
    """The PostgreSQL postmaster (the parent of the backends)."""
    for proc in psutil.process_iter(["name", "ppid"]):
        with contextlib.suppress(psutil.Error):
            if proc.info["name"] in ("postgres", "postmaster"):
                parent = proc.parent()
                if parent is None or parent.name() not in ("postgres", "postmaster"):
                    return proc
    return None


def find_redis() -> psutil.Process | None:
    for proc in psutil.process_iter(["name"]):
        if proc.info["name"] == "redis-server":
            return proc
    return None


def postgres_labels(
    postmaster: psutil.Process | None, database: str, prefix: str
) -> dict[int, str]:
    """Backends of ``database``, and the shared WAL writer/checkpointer/background writer."""
    out: dict[int, str] = {}
    if postmaster is None:
        return out
    try:
        children = postmaster.children()
    except psutil.Error:
        return out
    for child in children:
        try:
            title = " ".join(child.cmdline())
        except psutil.Error:
            continue
        if f" {database} " in f" {title} ":
            out[child.pid] = f"{prefix}:postgres backends ({database})"
        elif any(k in title for k in ("walwriter", "checkpointer", "background writer")):
            out[child.pid] = "shared:postgres wal/checkpointer/bgwriter"
    return out


def process_group_labels(pid: int | None, label: str) -> dict[int, str]:
    if pid is None:
        return {}
    return {p.pid: label for p in descendants(pid)}
