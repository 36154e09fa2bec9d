"""Peak memory of the ingress and of the delivery worker for big messages.

A relay at its DEFAULT settings on private PostgreSQL and Redis
(``tests/support/cluster.py``; processes as ``make run`` starts them; a
recording sink as the smart host). The resident set size (RSS) of a process
tree is sampled with psutil every ``--interval`` seconds in a thread of this
process; a figure is the peak of the sum over the tree, next to the tree's
RSS just before the load.

- **ingress**: ``runsmtp`` receives 1, 4 and 16 concurrent messages of
  ``--ingress-size`` (30 MB) from as many SMTP clients; a fresh ``runsmtp``
  for each load, and the workers stopped, so only the ingress works.
- **delivery round**: ``--round-messages`` (20) messages of ``--round-size``
  (20 MB) are queued while the workers are stopped, then the workers start:
  the categorizer routes them in one batch and the delivery worker sends them
  to the sink; its tree is sampled until the sink has them all.

    .venv/bin/python bench/memory/run.py                       # this checkout
    .venv/bin/python bench/memory/run.py --root /work/before   # another tree

``--root`` runs the relay from another source tree with this checkout's
virtualenv (see bench/faults/run.py). Nothing shared is touched.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import threading
import time
from pathlib import Path

import psutil

CHECKOUT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(CHECKOUT))

from tests.support.cluster import Cluster  # noqa: E402

MB = 1024 * 1024


class TreeSampler:
    """Samples the RSS of a process and its descendants until stopped; keeps the peak."""

    def __init__(self, pid: int, interval: float) -> None:
        self.root = psutil.Process(pid)
        self.interval = interval
        self.peak = 0
        self.peak_single = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def sample(self) -> tuple[int, int]:
        total = single = 0
        with contextlib.suppress(psutil.Error):
            for proc in [self.root, *self.root.children(recursive=True)]:
                with contextlib.suppress(psutil.Error):
                    rss = proc.memory_info().rss
                    total += rss
                    single = max(single, rss)
        return total, single

    def _run(self) -> None:
        while not self._stop.is_set():
            total, single = self.sample()
            self.peak = max(self.peak, total)
            self.peak_single = max(self.peak_single, single)
            self._stop.wait(self.interval)

    def __enter__(self) -> TreeSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def _stop_workers(cluster: Cluster) -> None:
    for name in [*cluster.workers(), "beat"]:
        cluster.procs[name].stop()


def measure_ingress(args: argparse.Namespace) -> list[dict[str, object]]:
    rows = []
    with Cluster(root=args.root) as cluster:
        _stop_workers(cluster)  # only the ingress works
        for n in args.ingress_concurrency:
            cluster.procs["smtp"].stop()
            smtp = cluster.start_process("smtp")
            time.sleep(2)  # let the fresh process finish its start-up allocations
            sampler = TreeSampler(smtp.pid, args.interval)
            before, _ = sampler.sample()
            with sampler:
                sent = cluster.send(
                    n, clients=n, tag=f"in{n}", size=args.ingress_size, per_connection=1
                )
            row = {
                "load": f"{n} x {args.ingress_size // MB} MB",
                "accepted": len(sent.accepted),
                "rss_before_mb": before / MB,
                "peak_mb": sampler.peak / MB,
                "peak_single_mb": sampler.peak_single / MB,
            }
            if sent.refused:
                row["refused"] = sent.refused[:2]
            rows.append(row)
            print(_fmt("ingress (runsmtp)", row), flush=True)
    return rows


def measure_round(args: argparse.Namespace) -> dict[str, object]:
    with Cluster(root=args.root) as cluster:
        _stop_workers(cluster)
        n = args.round_messages
        sent = cluster.send(n, clients=4, tag="round", size=args.round_size, per_connection=1)
        delivery = cluster.delivery_worker
        for name in cluster.workers():
            if name != delivery:
                cluster.start_process(name)
        worker = cluster.start_process(delivery)
        sampler = TreeSampler(worker.pid, args.interval)
        before, _ = sampler.sample()
        started = time.monotonic()
        with sampler:
            cluster.start_process("beat")
            done = cluster.wait_delivered(sent.accepted, args.timeout)
        row = {
            "load": f"{n} x {args.round_size // MB} MB",
            "accepted": len(sent.accepted),
            "delivered": done,
            "seconds": round(time.monotonic() - started, 1),
            "rss_before_mb": before / MB,
            "peak_mb": sampler.peak / MB,
            "peak_single_mb": sampler.peak_single / MB,
            "worker": delivery,
        }
        print(_fmt(f"delivery ({delivery})", row), flush=True)
        return row


def _fmt(what: str, row: dict[str, object]) -> str:
    return (
        f"{what:28} {row['load']:>12}  accepted {row['accepted']:>3}  "
        f"RSS before {row['rss_before_mb']:7.0f} MB  peak {row['peak_mb']:7.0f} MB  "
        f"(largest process {row['peak_single_mb']:.0f} MB)"
        + (f"  delivered in {row['seconds']} s" if "seconds" in row else "")
    )


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--root", type=Path, default=CHECKOUT, help="source tree the relay runs from")
    p.add_argument(
        "--ingress-concurrency", type=lambda s: [int(x) for x in s.split(",")], default=[1, 4, 16]
    )
    p.add_argument("--ingress-size", type=int, default=30 * MB)
    p.add_argument("--round-messages", type=int, default=20)
    p.add_argument("--round-size", type=int, default=20 * MB)
    p.add_argument("--interval", type=float, default=0.02, help="seconds between samples")
    p.add_argument("--timeout", type=float, default=600, help="seconds for the round")
    p.add_argument("--skip", choices=["ingress", "round"], action="append", default=[])
    p.add_argument("--json", type=Path)
    args = p.parse_args(argv)
    print(f"relay from {args.root.resolve()}; RSS sampled every {args.interval * 1000:g} ms")
    out: dict[str, object] = {}
    if "ingress" not in args.skip:
        out["ingress"] = measure_ingress(args)
    if "round" not in args.skip:
        out["round"] = measure_round(args)
    if args.json:
        args.json.write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
