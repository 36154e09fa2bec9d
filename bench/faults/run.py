"""The fault matrix as a benchmark: how long until mail flows again, what is lost, what doubles.

For each fault a fresh relay is started at its DEFAULT settings on private
PostgreSQL and Redis (``tests/support/cluster.py``: ``runsmtp``, the workers
and beat as ``make run`` starts them, a recording sink as the smart host that
takes ``--sink-delay`` per message). ``--messages`` messages stream in from
4 SMTP clients; when ``--fault-after`` of them reached the sink the fault
hits (the ingress kill: when a third of them got ``250``):

- ``worker-kill``: SIGKILL to the delivery worker's process group, a fresh
  worker started at once (as a supervisor would);
- ``ingress-kill``: SIGKILL to ``runsmtp``, a fresh one started at once;
- ``postgres-restart``: ``pg_ctl stop -m immediate`` (crash recovery), start;
- ``redis-restart``: SIGKILL to redis-server, a new one on the same port
  (default persistence: what was not saved is lost);
- ``broker-flush``: ``FLUSHALL`` on the broker.

Printed per fault: the time from the fault until the last accepted message
(``250``) arrived at the sink, or "not recovered" after ``--cap`` seconds;
messages lost (accepted, not at the sink at the end); duplicates (copies
beyond the first, counted by Message-ID, after the relay settled); and the
recipients a round held when the fault hit.

    .venv/bin/python bench/faults/run.py                       # this checkout
    .venv/bin/python bench/faults/run.py --root /work/before   # another tree
    .venv/bin/python bench/faults/run.py --faults worker-kill --cap 120

``--root`` runs the relay from another source tree (e.g. an older commit
extracted with ``git archive``) with this checkout's virtualenv: every
child gets that tree as ``cwd`` and ``PYTHONPATH``, checked before start.
Nothing shared is touched (no 5432, no 6379).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

CHECKOUT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(CHECKOUT))

from tests.support.cluster import Cluster  # noqa: E402

FINAL = {"delivered", "failed", "expired"}


@dataclass
class Outcome:
    fault: str
    accepted: int
    refused: int
    in_flight: int
    recovered_s: float | None  # None: not within the cap
    lost: int
    duplicates: int
    states: dict[str, int]
    note: str = ""


def _kill_and_restart(name_of: Callable[[Cluster], str]) -> Callable[[Cluster], None]:
    def fault(cluster: Cluster) -> None:
        name = name_of(cluster)
        cluster.kill(name)
        cluster.start_process(name)

    return fault


FAULTS: dict[str, Callable[[Cluster], None]] = {
    "worker-kill": _kill_and_restart(lambda c: c.delivery_worker),
    "ingress-kill": _kill_and_restart(lambda c: "smtp"),
    "postgres-restart": Cluster.restart_postgres,
    "redis-restart": Cluster.restart_redis,
    "broker-flush": Cluster.flush_broker,
}


def _settle(cluster: Cluster, timeout: float) -> dict[str, int]:
    """Wait (polling the database) until no recipient is on its way, so late copies count."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            states = cluster.states()
        except Exception:  # noqa: BLE001 - the database may still be starting
            states = {}
        if (states and not set(states) - FINAL) or time.monotonic() > deadline:
            return states
        time.sleep(0.25)


def run_fault(name: str, args: argparse.Namespace) -> Outcome:
    with Cluster(root=args.root, sink_delay=args.sink_delay) as cluster:
        job = cluster.send_async(args.messages, clients=4, tag=name)
        if name == "ingress-kill":
            # The ingress is hit while it receives: a third of the stream accepted.
            started = job.wait_accepted(args.messages // 3, 120)
        else:
            started = cluster.wait_sink_count(args.fault_after, 120)
        if not started:
            raise RuntimeError(f"{name}: the stream never started (logs in {cluster.logs})")
        in_flight = cluster.in_flight()
        fault_at = time.monotonic()
        FAULTS[name](cluster)
        sent = job.wait(args.cap)
        left = args.cap - (time.monotonic() - fault_at)
        recovered = cluster.wait_delivered(sent.accepted, max(0.0, left))
        recovered_s = time.monotonic() - fault_at if recovered else None
        states = _settle(cluster, 15 if recovered else 0)
        copies = cluster.copies()
        arrived = set(copies)
        return Outcome(
            fault=name,
            accepted=len(sent.accepted),
            refused=len(sent.refused),
            in_flight=len(in_flight),
            recovered_s=recovered_s,
            lost=sum(1 for m in sent.accepted if m not in arrived),
            duplicates=sum(n - 1 for n in copies.values()),
            states=states,
        )


def _fmt(o: Outcome, cap: float) -> str:
    rec = f"{o.recovered_s:7.1f} s" if o.recovered_s is not None else f"not recovered in {cap:g}s"
    states = ", ".join(f"{k} {v}" for k, v in sorted(o.states.items()))
    return (
        f"{o.fault:17} {rec:>24} {o.lost:5} {o.duplicates:5} {o.accepted:5}/{o.refused:<4} "
        f"{o.in_flight:5}  {states}"
    )


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--root", type=Path, default=CHECKOUT, help="source tree the relay runs from")
    p.add_argument("--faults", default=",".join(FAULTS), help="comma list of " + ", ".join(FAULTS))
    p.add_argument("--messages", type=int, default=300)
    p.add_argument("--fault-after", type=int, default=60, help="messages at the sink first")
    p.add_argument("--sink-delay", type=float, default=0.07, help="seconds per message")
    p.add_argument("--cap", type=float, default=300, help="seconds before 'not recovered'")
    p.add_argument("--json", type=Path, help="also write the outcomes here")
    args = p.parse_args(argv)
    print(
        f"relay from {args.root.resolve()}; {args.messages} messages, fault after "
        f"{args.fault_after} at the sink, sink {args.sink_delay * 1000:g} ms/message"
    )
    header = (
        f"{'fault':17} {'fault -> last delivered':>24} {'lost':>5} {'dups':>5} "
        f"{'acc/refused':>10} {'in-fl':>5}  recipient states at the end"
    )
    print(header)
    outcomes = []
    for name in args.faults.split(","):
        try:
            outcome = run_fault(name, args)
        except Exception as exc:  # noqa: BLE001 - report it and go on with the next fault
            print(f"{name:17} failed to run: {exc}")
            continue
        outcomes.append(outcome)
        print(_fmt(outcome, args.cap), flush=True)
    if args.json:
        args.json.write_text(json.dumps([asdict(o) for o in outcomes], indent=2))
    return 0 if all(o.recovered_s is not None and o.lost == 0 for o in outcomes) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
