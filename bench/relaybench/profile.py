"""Optional profiling of mailrelay's processes with py-spy (``--profile DIR``).

``py-spy record --format raw --nonblocking --gil --rate 100`` is attached to
``runsmtp`` and to every Celery worker (``--subprocesses``: the pool children)
for the whole measured smtp-source phase. ``--gil`` keeps only samples of
the thread holding the GIL, i.e. Python code running (a thread waiting in
libpq or in a queue has released the GIL), so the counts are where the
Python CPU time goes. py-spy itself costs CPU: the rates measured while
profiling are lower than without. The raw files
(collapsed stacks, loadable into speedscope or flamegraph.pl) stay in DIR;
``summarize`` prints, per process, the functions with the most samples on
top of the stack ("self") and the project's own functions with the most
samples anywhere in the stack ("inclusive").
"""

from __future__ import annotations

import re
import shutil
import signal
import subprocess
import sys
from collections import Counter
from pathlib import Path

from .util import Procs

_FRAME = re.compile(r"^(?P<func>.*?) \((?P<file>[^():]+)(?::(?P<line>\d+))?\)$")
PROJECT_DIRS = ("delivery/", "queues/", "mailrelay/")


def _is_project(path: str, repo: str) -> bool:
    if path.startswith(repo):
        path = path[len(repo) :].lstrip("/")
    return path.startswith(PROJECT_DIRS)


def py_spy() -> str | None:
    cand = Path(sys.executable).parent / "py-spy"
    return str(cand) if cand.exists() else shutil.which("py-spy")


def start(procs: Procs, pids: dict[str, int], out_dir: Path, rate: int = 100) -> list[Path]:
    exe = py_spy()
    if exe is None:
        raise RuntimeError("py-spy is not installed (pip install py-spy into .venv)")
    out_dir.mkdir(parents=True, exist_ok=True)
    files = []
    for name, pid in pids.items():
        out = out_dir / f"{name}.txt"
        cmd = [
            exe,
            "record",
            "--pid",
            str(pid),
            "--rate",
            str(rate),
            "--format",
            "raw",
            "--nonblocking",
            "--gil",
            "-o",
            str(out),
        ]
        if name == "runsmtp" or name.startswith("worker"):  # pool children, runsmtp --processes
            cmd.append("--subprocesses")
        procs.spawn(
            f"py-spy {name}",
            cmd,
            stop_signal=signal.SIGINT,
            grace=30,
            stdout=out_dir / f"{name}.py-spy.log",
            stderr=subprocess.STDOUT,
        )
        files.append(out)
    return files


def _short(frame: str, repo: str) -> str:
    m = _FRAME.match(frame)
    if not m:
        return frame
    path = m.group("file")
    if path.startswith(repo):
        path = path[len(repo) :].lstrip("/")
    else:
        # keep the package-relative part of site-packages / stdlib paths
        for marker in ("site-packages/", "lib/python3."):
            if marker in path:
                path = path.split(marker, 1)[1]
                if marker.startswith("lib/"):
                    path = "stdlib:" + path.split("/", 1)[-1]
                break
    return f"{m.group('func')} ({path})"


def summarize(path: Path, repo: str, top: int = 20) -> str:
    """Self and inclusive sample counts of one py-spy raw file, as text."""
    if not path.exists():
        return f"{path.name}: no profile written"
    self_counts: Counter[str] = Counter()
    incl_project: Counter[str] = Counter()
    by_process: Counter[str] = Counter()
    total = 0
    for line in path.read_text(errors="replace").splitlines():
        stack, _, count_s = line.rpartition(" ")
        if not stack or not count_s.isdigit():
            continue
        count = int(count_s)
        frames = stack.split(";")
        proc = frames[0] if frames[0].startswith("process ") else ""
        frames = [f for f in frames if not f.startswith(("process ", "thread "))]
        if not frames:
            continue
        total += count
        by_process[proc] += count
        self_counts[_short(frames[-1], repo)] += count
        seen = set()
        for f in frames:
            m = _FRAME.match(f)
            if m and _is_project(m.group("file"), repo):
                key = _short(f, repo)
                if key not in seen:
                    seen.add(key)
                    incl_project[key] += count
    if not total:
        return f"{path.name}: no samples"
    lines = [f"{path.stem}: {total} on-CPU samples"]
    if len(by_process) > 1:
        for proc, n in by_process.most_common():
            lines.append(f"    {100 * n / total:5.1f}%  {proc[:100]}")
    lines.append("  self (top of stack):")
    for key, n in self_counts.most_common(top):
        lines.append(f"    {100 * n / total:5.1f}%  {key}")
    lines.append("  inclusive, project code:")
    for key, n in incl_project.most_common(top):
        lines.append(f"    {100 * n / total:5.1f}%  {key}")
    return "\n".join(lines)
