#!/usr/bin/env python3
"""tracking_search: the tracking search with 10 million rows, p50 / p95 per query kind.

    .venv/bin/python bench/tracking_search/run.py [--rows 10000000] [--days 30]
        [--runs 200] [--reuse] [--keep]

1. (Re)creates the PostgreSQL database ``mailrelay_tracking_bench`` next to
   the one ``DATABASE_URL`` names, migrates it (the day partitions of the
   last ``--days`` days are made by ``tracking.partitions``) and loads
   ``--rows`` tracking rows spread evenly over those days with one set-based
   INSERT … SELECT generate_series per day into the partitioned table (its
   indexes in place, as in production), then ANALYZE. Shape: a message has
   three rows (received, routed, then delivered / deferred / failed), 5,000
   senders, 200,000 recipients, every delivered row a remote queue id.
   ``--reuse`` keeps a database that already holds the data.
2. Runs ``--runs`` searches per query kind with varying values, through the
   API view (``GET /api/v1/tracking/`` in-process with Django's test client,
   as an operator: DRF, serialization and all) and prints p50 / p95 / max.
   Target: p95 under 200 ms for every kind.

It is a script, not a test. See bench/tracking_search/README.md for the last run.
"""

from __future__ import annotations

import argparse
import os
import random
import secrets
import statistics
import sys
import time
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import psycopg

ROOT = Path(__file__).resolve().parents[2]
BENCH_DB = "mailrelay_tracking_bench"


def bench_url() -> str:
    base = os.environ.get("DATABASE_URL", "postgres://postgres@127.0.0.1:5432/mailrelay")
    parts = urlsplit(base)
    return urlunsplit(parts._replace(path=f"/{BENCH_DB}")), urlunsplit(
        parts._replace(path="/postgres")
    )


def recreate(admin_url: str) -> None:
    with psycopg.connect(admin_url, autocommit=True) as conn:
        conn.execute(f"DROP DATABASE IF EXISTS {BENCH_DB} WITH (FORCE)")
        conn.execute(f"CREATE DATABASE {BENCH_DB}")


def setup_django(url: str) -> None:
    os.environ["DATABASE_URL"] = url
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "mailrelay.settings")
    os.environ["DJANGO_DEBUG"] = "false"  # no query log in memory
    os.environ["DJANGO_ALLOWED_HOSTS"] = "testserver"
    os.environ.setdefault("DJANGO_SECRET_KEY", secrets.token_urlsafe(48))
    sys.path.insert(0, str(ROOT))
    import django

    django.setup()


DAY_SQL = """
INSERT INTO tracking_event (at, event, event_id, qid, message_pk, message_id, sender, recipient,
    client, size, queue, next_hop, host, ip, tls, code, enhanced, reply, remote_id)
SELECT %(start)s::timestamptz + (g - %(first)s)::bigint * %(step)s * interval '1 microsecond',
    CASE g %% 3 WHEN 0 THEN 'received' WHEN 1 THEN 'routed'
        ELSE (ARRAY['delivered','delivered','delivered','deferred','failed'])[1 + (g / 3) %% 5] END,
    gen_random_uuid(),
    'B' || lpad(upper(to_hex(g / 3)), 11, '0'),
    g / 3,
    CASE WHEN g %% 3 = 0 THEN '<' || (g / 3) || '@bench.example>' ELSE '' END,
    'sender' || ((g / 3) %% 5000) || '@s' || ((g / 3) %% 50) || '.example',
    CASE WHEN g %% 3 = 0 THEN ''
        ELSE 'rcpt' || ((g / 3) %% 200000) || '@r' || ((g / 3) %% 1000) || '.example' END,
    CASE WHEN g %% 3 = 0 THEN '192.0.2.' || (g %% 250) ELSE '' END,
    CASE WHEN g %% 3 = 0 THEN 2000 + g %% 50000 END,
    CASE WHEN g %% 3 = 1 THEN 'r' || ((g / 3) %% 1000) || '.example' ELSE '' END,
    CASE WHEN g %% 3 = 1 THEN 'mx.r' || ((g / 3) %% 1000) || '.example' ELSE '' END,
    CASE WHEN g %% 3 = 2 THEN 'mx.r' || ((g / 3) %% 1000) || '.example' ELSE '' END,
    CASE WHEN g %% 3 = 2 THEN '198.51.100.' || ((g / 3) %% 250) ELSE '' END,
    CASE WHEN g %% 3 = 2 THEN 'TLSv1.3 TLS_AES_256_GCM_SHA384 unverified' ELSE '' END,
    CASE WHEN g %% 3 = 2 THEN 250 END,
    CASE WHEN g %% 3 = 2 THEN '2.0.0' ELSE '' END,
    CASE WHEN g %% 3 = 2 THEN '250 2.0.0 Ok: queued as R' || upper(to_hex(g)) ELSE '' END,
    CASE WHEN g %% 3 = 2 AND (g / 3) %% 5 < 3 THEN 'R' || upper(to_hex(g)) ELSE '' END
FROM generate_series(%(first)s, %(last)s) g
"""


def load(rows: int, days: int) -> None:
    from datetime import UTC, datetime, timedelta

    from django.db import connection

    from tracking import partitions

    now = datetime.now(UTC)
    per_day = rows // days
    start_day = (now - timedelta(days=days - 1)).date()
    started = time.monotonic()
    for i in range(days):
        day = start_day + timedelta(days=i)
        if day not in partitions.partitions():
            partitions.create_partition(day)
        start = datetime(day.year, day.month, day.day, tzinfo=UTC)
        first, last = i * per_day, (i + 1) * per_day - 1
        step = int(86_400_000_000 / per_day)
        with connection.cursor() as cur:
            cur.execute(DAY_SQL, {"start": start, "first": first, "last": last, "step": step})
        print(f"  day {i + 1}/{days} loaded ({time.monotonic() - started:.0f} s)", flush=True)
    with connection.cursor() as cur:
        cur.execute("ANALYZE tracking_event")
    print(f"loaded {per_day * days:,} rows in {time.monotonic() - started:.0f} s", flush=True)


def kinds(rows: int) -> dict[str, callable]:
    messages = rows // 3

    def msg() -> int:
        return random.randrange(messages)

    return {
        "sender": lambda: {"sender": f"sender{(m := msg()) % 5000}@s{m % 50}.example"},
        "sender, 2d": lambda: {
            "sender": f"sender{(m := msg()) % 5000}@s{m % 50}.example",
            "since": "2d",
        },
        "recipient": lambda: {"recipient": f"RCPT{(m := msg()) % 200000}@r{m % 1000}.example"},
        "message_id": lambda: {"message_id": f"{msg()}@bench.example"},
        "qid": lambda: {"qid": f"B{msg():011X}"},
        "remote_id": lambda: {"remote_id": f"R{3 * (msg() // 5 * 5 + random.randrange(3)) + 2:X}"},
        "event failed": lambda: {"event": "failed"},
        "event deferred, 1d, sender": lambda: {
            "event": "deferred",
            "since": "1d",
            "sender": f"sender{(m := msg()) % 5000}@s{m % 50}.example",
        },
        # Event-only searches over a time range (the case of the (event, at) index):
        # a common event (1 row in 15) and one with no row at all (worst case).
        "event failed, 2d window": lambda: {
            "event": "failed",
            "since": f"{(h := random.randint(50, 700))}h",
            "until": f"{h - 48}h",
        },
        "event expired (none), 1d": lambda: {"event": "expired", "since": "1d"},
        "time window 2h": lambda: {"since": f"{random.randint(3, 700)}h", "until": "2h"},
        "newest": lambda: {},
    }


def measure(runs: int, rows: int) -> None:
    from django.contrib.auth.models import Group, User
    from django.test import Client

    user, _ = User.objects.get_or_create(username="bench-operator")
    user.groups.add(Group.objects.get_or_create(name="operator")[0])
    client = Client()
    client.force_login(user)
    print(f"\n{'query kind':32} {'p50 ms':>8} {'p95 ms':>8} {'max ms':>8} {'rows/page':>9}")
    for name, params in kinds(rows).items():
        times, found = [], []
        for i in range(runs + 5):
            query = params()
            t = time.perf_counter()
            response = client.get("/api/v1/tracking/", query)
            elapsed = (time.perf_counter() - t) * 1000
            assert response.status_code == 200, response.content[:300]
            if i >= 5:  # warm-up
                times.append(elapsed)
                found.append(len(response.json()["results"]))
        times.sort()
        p95 = times[int(len(times) * 0.95) - 1]
        print(
            f"{name:32} {statistics.median(times):8.1f} {p95:8.1f} {times[-1]:8.1f} "
            f"{statistics.mean(found):9.1f}",
            flush=True,
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=10_000_000)
    parser.add_argument("--days", type=int, default=30)
    parser.add_argument("--runs", type=int, default=200)
    parser.add_argument("--reuse", action="store_true")
    parser.add_argument("--keep", action="store_true")
    args = parser.parse_args()
    url, admin = bench_url()
    if not args.reuse:
        recreate(admin)
    setup_django(url)
    from django.core.management import call_command

    from tracking import partitions

    partitions.DAYS_AHEAD = 1
    call_command("migrate", verbosity=0)
    if not args.reuse:
        load(args.rows, args.days)
    try:
        measure(args.runs, args.rows)
    finally:
        if not args.keep:
            from django.db import connections

            connections.close_all()
            with psycopg.connect(admin, autocommit=True) as conn:
                conn.execute(f"DROP DATABASE IF EXISTS {BENCH_DB} WITH (FORCE)")


if __name__ == "__main__":
    main()
