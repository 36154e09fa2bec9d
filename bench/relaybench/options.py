"""relay_throughput's command line."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from relaybench.mailrelay import DKIM_ALGORITHMS
from relaybench.sink import KINDS as SINK_KINDS

LOADERS = ("smtp-source", "client")


def _systems(p: argparse.ArgumentParser) -> None:
    """What runs: which systems, and mailrelay's processes."""
    p.add_argument("--messages", "-m", type=int, default=5000, help="messages per load")
    p.add_argument("--size", "-l", type=int, default=2048, help="payload bytes per message")
    p.add_argument("--sessions", "-s", type=int, default=20, help="concurrent SMTP sessions")
    p.add_argument("--skip-postfix", action="store_true", help="measure mailrelay only")
    p.add_argument("--skip-mailrelay", action="store_true", help="measure Postfix only")
    p.add_argument(
        "--wal-by-relation",
        action="store_true",
        help="after each mailrelay phase, PostgreSQL's WAL of the phase by table and index "
        "(pg_waldump; root on the database's machine)",
    )
    p.add_argument(
        "--floor",
        action="store_true",
        help="run the design's floor (relaybench/floor.py: aiosmtpd, a group commit into "
        "PostgreSQL, 20 kept sessions out, nothing else) in mailrelay's place",
    )
    p.add_argument(
        "--workers",
        choices=("make-run", "single"),
        default="make-run",
        help="the celery workers make run starts (control prefork, delivery threads, "
        "webhooks threads), or one prefork worker on every queue (--worker-concurrency)",
    )
    p.add_argument(
        "--worker-concurrency",
        type=int,
        default=int(os.environ.get("MAILRELAY_WORKER_CONCURRENCY", "4")),
        help="with --workers single: celery worker --concurrency",
    )
    p.add_argument(
        "--beat",
        action="store_true",
        help="also run celery beat (the sweep); off: lost doorbells show as stalls",
    )
    p.add_argument(
        "--compose",
        action="store_true",
        help="run mailrelay's processes as docker-compose.yml does: also the web app "
        "(its gunicorn command) and celery beat",
    )
    p.add_argument(
        "--runs",
        type=int,
        default=1,
        help="run the comparison this many times (order alternating) and print the "
        "median of each figure",
    )


def _load(p: argparse.ArgumentParser) -> None:
    """The load and the destination."""
    p.add_argument(
        "--loaders",
        default=",".join(LOADERS),
        help="comma list of loads to run: smtp-source, client",
    )
    p.add_argument(
        "--sink",
        choices=SINK_KINDS,
        default="smtp-sink",
        help="the final destination: Postfix's smtp-sink or relaybench/tls_sink.py",
    )
    p.add_argument(
        "--sink-tls",
        action="store_true",
        help="the sink offers STARTTLS (implies --sink asyncio); both relays use it (may)",
    )
    p.add_argument(
        "--dkim",
        choices=DKIM_ALGORITHMS,
        default="none",
        help="mailrelay signs every message with a key of this kind (needs --skip-postfix)",
    )


def _control(p: argparse.ArgumentParser) -> None:
    """Warm-up, time limits, profiling and output."""
    p.add_argument("--warmup", type=int, default=200, help="warm-up messages per system")
    p.add_argument(
        "--stall-timeout",
        type=float,
        default=60.0,
        help="give up when nothing reaches the sink for this long (s)",
    )
    p.add_argument("--timeout", type=float, default=900.0, help="load client time limit (s)")
    p.add_argument(
        "--rate",
        type=float,
        default=0.0,
        help="the asyncio client offers this many msg/s (accept latency at that rate; "
        "0: as fast as it goes); smtp-source always goes as fast as it can",
    )
    p.add_argument(
        "--linger",
        type=float,
        default=1.0,
        help="seconds to wait after the last delivery for duplicates",
    )
    p.add_argument(
        "--profile",
        type=Path,
        metavar="DIR",
        help="py-spy runsmtp and the worker during mailrelay's smtp-source load",
    )
    p.add_argument(
        "--wait-idle",
        type=float,
        default=0.0,
        metavar="SECONDS",
        help="before each system, wait up to this long for the machine to be idle",
    )
    p.add_argument("--json", type=Path, metavar="FILE", help="also write the figures as JSON")
    p.add_argument(
        "--keep-temp",
        action="store_true",
        help="keep the temporary directory (logs, Postfix queue, sink dumps)",
    )


def parse_args() -> argparse.Namespace:
    """The options, checked (bench/README.md lists them)."""
    p = argparse.ArgumentParser(
        description="Relay throughput of mailrelay and of a private Postfix, side by side.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    _systems(p)
    _load(p)
    _control(p)
    args = p.parse_args()
    args.loaders = [x.strip() for x in args.loaders.split(",") if x.strip()]
    bad = [x for x in args.loaders if x not in LOADERS]
    if bad:
        p.error(f"unknown load {bad}; choose from {LOADERS}")
    if args.profile:
        args.profile = args.profile.resolve()
    if args.sink_tls:
        args.sink = "asyncio"
    if args.compose:
        args.beat = True
    if args.runs < 1:
        p.error("--runs must be at least 1")
    if args.dkim != "none" and not args.skip_postfix:
        p.error("--dkim signs in mailrelay only (the Postfix here has no milter): --skip-postfix")
    return args
