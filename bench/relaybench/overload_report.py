"""bench/overload's results: memory, the submission queue, back-pressure events,
both clients' figures and the exactly-once check, printed and written as JSON."""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from relaybench.util import percentile

MiB = 1024 * 1024
TRUSTED_SOURCE = "127.0.0.1"
UNTRUSTED_SOURCE = "127.0.0.5"

Percentile = Callable[[list[float], float], float | None]


@dataclass
class Results:
    """What one overload run measured."""

    sustainable: float  # msg/s, calibrated end to end
    offered_rate: float  # msg/s offered to the untrusted senders
    trusted: dict  # each client's figures (the load client's JSON)
    untrusted: dict
    poller: Any  # the submission queue, back-pressure rows and RSS over time
    mon: Any  # every process's peak memory and CPU
    events: list[tuple[float, str, str]]  # back-pressure events (s since the start)


def pct(values: list[float], p: float, percentile: Percentile = percentile) -> str:
    v = percentile(values, p)
    return "-" if v is None else f"{v:.1f}"


def report_memory(args: argparse.Namespace, poller: Any, mon: Any) -> None:
    print("\n-- peak memory (RSS, MiB; psutil every 0.1 s)")
    print(f"  {'process':48s} {'peak':>8s} {'max 1 proc':>11s} {'procs':>6s} {'CPU s':>7s}")
    for label, st in sorted(mon.stats.items()):
        print(
            f"  {label:48s} {st.peak_rss / MiB:8.1f} {st.peak_single_rss / MiB:11.1f} "
            f"{st.max_procs:6d} {st.cpu:7.1f}"
        )
    if poller.rss:
        marks = [poller.rss[0]] + [
            poller.rss[min(len(poller.rss) - 1, int(i))]
            for i in (args.duration / 4, args.duration / 2, 3 * args.duration / 4, args.duration)
        ]
        marks.append(poller.rss[-1])
        print(
            "  runsmtp RSS over time: "
            + ", ".join(f"{t:.0f}s {smtp / MiB:.1f}" for t, smtp, _ in marks)
        )
        print(
            "  worker tree RSS over time: "
            + ", ".join(f"{t:.0f}s {w / MiB:.1f}" for t, _, w in marks)
        )


def report_submission(poller: Any, events: list[tuple[float, str, str]]) -> None:
    subs = [s["submission"] for s in poller.samples]
    peak_i = max(range(len(subs)), key=subs.__getitem__) if subs else None
    print("\n-- submission queue")
    if peak_i is not None:
        print(
            f"  peak {subs[peak_i]} messages at {poller.samples[peak_i]['t']:.1f} s; "
            f"broker tasks peak {max(s['broker'] for s in poller.samples)}"
        )
        step = max(1, len(poller.samples) // 16)
        for s in poller.samples[::step]:
            sq = s["bp"].get("submission_queue")
            state = f"{sq[1]} {sq[2] or '-'} {sq[3]:.0f}s" if sq else "-"
            print(
                f"    {s['t']:6.1f}s  submission {s['submission']:6d}  "
                f"categorizing {s['categorizing']:5d}  bp[submission queue] {state}"
            )
    print("\n-- back-pressure events")
    for t, level, text in events:
        print(f"  {t:7.1f}s {level:7s} {text}")
    if not events:
        print("  none")


def report_clients(args: argparse.Namespace, trusted: dict, untrusted: dict) -> None:
    tarpit_floor = args.tarpit_threshold
    t_delays = trusted["mail_delays"]
    u_tarpitted = [x for x in untrusted["mail_delays"] if x >= tarpit_floor]
    print(f"\n-- trusted client ({TRUSTED_SOURCE})")
    print(
        f"  offered {trusted['offered']}, accepted {len(trusted['accepted'])}, "
        f"MAIL refused {trusted['refused']} {trusted['refused_replies'] or ''}, "
        f"other failures {trusted['other_failures']}"
    )
    print(
        f"  accept latency (dot -> 250) p50 {pct(trusted['accept_ms'], 50)} ms, "
        f"p99 {pct(trusted['accept_ms'], 99)} ms; "
        f"whole transaction (connect -> 250) p50 {pct(trusted['transaction_ms'], 50)}"
        f" ms, p99 {pct(trusted['transaction_ms'], 99)} ms; "
        f"MAIL FROM delayed >= {tarpit_floor:g}s: {len([x for x in t_delays if x >= tarpit_floor])}"
    )
    print(f"\n-- untrusted senders ({UNTRUSTED_SOURCE})")
    print(
        f"  offered {untrusted['offered']}, MAIL FROM sent {untrusted['attempted']}, "
        f"accepted {len(untrusted['accepted'])}"
    )
    print(
        f"  MAIL FROM tarpitted (reply after >= {tarpit_floor:g} s): {len(u_tarpitted)}"
        + (
            f" (delay p50 {percentile(u_tarpitted, 50):.1f} s, max {max(u_tarpitted):.1f} s)"
            if u_tarpitted
            else ""
        )
    )
    print(f"  MAIL FROM refused: {untrusted['refused']} {untrusted['refused_replies'] or ''}")
    print(f"  other failures {untrusted['other_failures']} {untrusted['errors'][:3] or ''}")


def report_delivery(trusted: dict, untrusted: dict, dumps: Any) -> bool:
    """Whether every message that got a 250 reached the sink exactly once."""
    print("\n-- every 250 delivered?")
    ok = True
    for tag, stats in (("T", trusted), ("U", untrusted)):
        accepted = set(stats["accepted"])
        delivered = {seq for (t, seq) in dumps.seqs if t == tag}
        missing = accepted - delivered
        extra = delivered - accepted
        dups = sum(n - 1 for (t, _), n in dumps.seqs.items() if t == tag and n > 1)
        ok &= not missing and not dups
        print(
            f"  {'trusted' if tag == 'T' else 'untrusted'}: {len(accepted)} got 250, "
            f"{len(delivered)} delivered, missing {len(missing)}, duplicates {dups}, "
            f"delivered without a 250 seen {len(extra)}"
        )
    print(f"  => {'yes: every message that got a 250 was delivered exactly once' if ok else 'NO'}")
    return ok


def report(args: argparse.Namespace, r: Results, dumps: Any) -> bool:
    """Print every result; True when every 250 was delivered exactly once."""
    print("\n== results ==")
    print(
        f"sustainable rate (calibrated end to end): {r.sustainable:.1f} msg/s; "
        f"offered to untrusted senders: {r.offered_rate:.1f} msg/s for {args.duration:.0f} s "
        f"over {args.sessions} sessions; trusted: {args.trusted_rate:g} msg/s"
    )
    report_memory(args, r.poller, r.mon)
    report_submission(r.poller, r.events)
    report_clients(args, r.trusted, r.untrusted)
    return report_delivery(r.trusted, r.untrusted, dumps)


def read_events(db_url: str, t_wall: float) -> list[tuple[float, str, str]]:
    """The back-pressure events the relay logged, in seconds since ``t_wall``."""
    import psycopg

    with psycopg.connect(db_url.replace("postgres://", "postgresql://")) as conn:
        rows = conn.execute(
            "SELECT extract(epoch FROM created_at), level, text FROM queues_event"
            " WHERE kind = 'backpressure' ORDER BY id"
        ).fetchall()
    return [(float(t) - t_wall, level, text) for t, level, text in rows]


def write_json(path: Path, r: Results) -> None:
    memory = {
        k: {"peak_rss": v.peak_rss, "peak_single": v.peak_single_rss, "procs": v.max_procs}
        | {"cpu": v.cpu}
        for k, v in r.mon.stats.items()
    }
    data = {
        "sustainable": r.sustainable,
        "offered_rate": r.offered_rate,
        "trusted": r.trusted,
        "untrusted": r.untrusted,
        "samples": r.poller.samples,
        "rss": r.poller.rss,
        "events": r.events,
        "memory": memory,
    }
    path.write_text(json.dumps(data, default=str))
