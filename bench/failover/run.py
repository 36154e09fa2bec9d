"""Failover of the database machine, measured from outside (issue #25).

For each standby mode a fresh relay is started at its DEFAULT settings
(``tests/support/cluster.py``: ``runsmtp``, the workers and beat as
``make run`` starts them, a recording sink as the smart host) on a private
PostgreSQL primary and a streaming standby made with ``initdb`` and
``pg_basebackup`` (``tests/support/failover.py``), every process given the
multi-host ``DATABASE_URL`` that lists both. Messages stream in at
``--rate`` from 4 SMTP clients that send a refused message again half a
second later (each attempt has its own Message-ID). Once ``--kill-after``
messages reached the sink, the primary's postmaster and every backend get
SIGKILL; ``--promote-after`` seconds later the standby is promoted with
``pg_ctl promote``. No relay process is restarted.

Printed per mode: attempts acknowledged (250), acknowledged attempts lost
(never at the sink), duplicates (copies beyond the first of acknowledged
attempts), the longest time without a 250 around the fault, and the
seconds from the promotion until ingress accepted again, until the first
message accepted after the kill reached the sink (delivery resumed), and
until every acknowledged message had arrived.

    .venv/bin/python bench/failover/run.py                  # both modes
    .venv/bin/python bench/failover/run.py --modes async --rate 0   # unpaced
    .venv/bin/python bench/failover/run.py --throughput --modes single,async,sync

``--throughput``: no fault; ``--messages`` sent unpaced from ``--clients``
sessions on a single server (``single``, the plain ``Cluster``), or on a
primary with an asynchronous or synchronous standby. Printed: messages
accepted per second and the accept latency (MAIL FROM to the 250 after the
final dot, as the client sees it) at the 50th, 95th and 99th percentile;
delivery runs meanwhile, as in production.

Loopback only; nothing shared is touched (no 5432, no 6379).
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict
from pathlib import Path

CHECKOUT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(CHECKOUT))

from tests.support.cluster import Cluster  # noqa: E402
from tests.support.failover import HEADER, FailoverCluster, Load, run_failover  # noqa: E402


def throughput(mode: str, messages: int, clients: int, sink_delay: float) -> str:
    """One row of the throughput table: accepted/s and accept latency percentiles."""
    if mode == "single":
        cluster: Cluster = Cluster(sink_delay=sink_delay)
    else:
        cluster = FailoverCluster(synchronous=mode == "sync", sink_delay=sink_delay)
    with cluster:
        load = Load(cluster.smtp_port, messages, rate=0, clients=clients, tag=mode)
        load.wait(600)
    accepted = load.accepted()
    if not accepted:
        return f"| {mode} | 0 | - | - | - |"
    span = max(a.answered for a in accepted) - min(a.sent for a in load.attempts)
    latencies = sorted((a.answered - a.sent) * 1000 for a in accepted)

    def pct(p: float) -> float:
        return latencies[min(len(latencies) - 1, int(p * len(latencies)))]

    return (
        f"| {mode} | {len(accepted)} | {len(accepted) / span:.0f} "
        f"| {pct(0.5):.1f} | {pct(0.95):.1f} | {pct(0.99):.1f} |"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--modes", default="sync,async", help="sync, async or both (comma list)")
    parser.add_argument("--messages", type=int, default=600)
    parser.add_argument("--rate", type=float, default=40.0, help="messages/s overall; 0 = unpaced")
    parser.add_argument("--kill-after", type=int, default=100)
    parser.add_argument("--promote-after", type=float, default=3.0)
    parser.add_argument("--sink-delay", type=float, default=0.02)
    parser.add_argument("--settle", type=float, default=120.0)
    parser.add_argument("--json", type=Path, help="also write the results here")
    parser.add_argument("--throughput", action="store_true", help="no fault: msg/s and latency")
    parser.add_argument("--clients", type=int, default=4)
    args = parser.parse_args()
    if args.throughput:
        rows = [
            throughput(m.strip(), args.messages, args.clients, args.sink_delay)
            for m in args.modes.split(",")
        ]
        print("| database | accepted | msg/s | p50 ms | p95 ms | p99 ms |")
        print("|---|---|---|---|---|---|")
        print("\n".join(rows))
        return 0
    results = []
    for mode in args.modes.split(","):
        with FailoverCluster(synchronous=mode.strip() == "sync", sink_delay=args.sink_delay) as c:
            print(f"{mode}: relay up, logs in {c.logs}", flush=True)
            result = run_failover(
                c,
                messages=args.messages,
                rate=args.rate,
                clients=args.clients,
                kill_after=args.kill_after,
                promote_after=args.promote_after,
                settle=args.settle,
            )
        results.append(result)
        print(f"{mode}: {json.dumps(asdict(result))[:2000]}", flush=True)
    print(HEADER)
    for result in results:
        print(result.row())
    if args.json:
        args.json.write_text(json.dumps([asdict(r) for r in results], indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
