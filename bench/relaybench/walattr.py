"""WAL by relation: what one phase's writes cost, in records and bytes, per table and index.

``relay_throughput --wal-by-relation`` notes PostgreSQL's WAL position as a
phase starts and when it is over, then reads the WAL in between with
``pg_waldump`` (the PostgreSQL binaries of the server; the bench runs as root
on the database's machine) and sums each record's total length by the
relation it touches, named from ``pg_class``'s file nodes. Every row version
and every index entry written is a WAL record, so this says, independently of
the machine's speed, which table or index a message's writes go to: a GIN
index that takes a new entry for every trigram at every row version shows as
what it is. Only records that name a relation of the bench's database are
counted: other databases' writes in the same window (a test suite running
beside) and records that name no relation (commits) are left out.
"""

from __future__ import annotations

import re
import subprocess
from collections import Counter
from pathlib import Path

import psycopg

ADMIN_URL = "postgresql://postgres@127.0.0.1:5432/postgres"
_RECORD = re.compile(r"rmgr: (\w+)\s+len \(rec/tot\):\s*\d+/\s*(\d+).*?desc: (\w+)")
_RELATION = re.compile(r"rel \d+/(\d+)/(\d+)")


def current_lsn() -> str:
    with psycopg.connect(ADMIN_URL, autocommit=True) as conn:
        return str(conn.execute("SELECT pg_current_wal_lsn()").fetchone()[0])


def _waldump() -> tuple[Path, Path]:
    """pg_waldump of the running server's version, and its WAL directory."""
    with psycopg.connect(ADMIN_URL, autocommit=True) as conn:
        data = conn.execute("SHOW data_directory").fetchone()[0]
        major = conn.execute("SHOW server_version_num").fetchone()[0][:-4]
    return Path(f"/usr/lib/postgresql/{major}/bin/pg_waldump"), Path(data) / "pg_wal"


def by_relation(start: str, end: str, database_url: str, messages: int, top: int = 24) -> str:
    """A table of the WAL between ``start`` and ``end``, per message, by relation."""
    with psycopg.connect(database_url, autocommit=True) as conn:
        database = str(
            conn.execute(
                "SELECT oid FROM pg_database WHERE datname = current_database()"
            ).fetchone()[0]
        )
        rows = conn.execute(
            "SELECT pg_relation_filenode(oid)::text, relname FROM pg_class "
            "WHERE pg_relation_filenode(oid) IS NOT NULL"
        ).fetchall()
    names = dict(rows)
    tool, wal = _waldump()
    out = subprocess.run(
        [str(tool), "-p", str(wal), "-s", start, "-e", end],
        capture_output=True,
        text=True,
        check=False,
    ).stdout
    records: Counter[str] = Counter()
    size: Counter[str] = Counter()
    for line in out.splitlines():
        m = _RECORD.search(line)
        if not m:
            continue
        r = _RELATION.search(line)
        if not r or r.group(1) != database:
            continue
        name = names.get(r.group(2), r.group(2))
        records[name] += 1
        size[name] += int(m.group(2))
    total = sum(size.values()) or 1
    n = max(messages, 1)
    lines = [
        f"-- WAL by relation ({start} .. {end}): {sum(records.values()) / n:.1f} records, "
        f"{total / n / 1024:.2f} kB a message",
        f"  {'relation':44} {'records/msg':>12} {'bytes/msg':>10} {'share':>6}",
    ]
    for name, b in size.most_common(top):
        lines.append(
            f"  {name:44} {records[name] / n:>12.2f} {b / n:>10.0f} {100 * b / total:>5.1f}%"
        )
    return "\n".join(lines)
