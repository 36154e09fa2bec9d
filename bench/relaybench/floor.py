"""The design's floor: the least any relay built of mailrelay's parts must spend.

One Python process with nothing but what the design cannot do without:

- **aiosmtpd** receives (the design keeps it), a handler that prepends a
  ``Received:`` field and hands the message to
- **a group commit into PostgreSQL**: every message waiting is written by one
  ``INSERT ... SELECT FROM unnest(...)`` in one transaction, and only after
  the commit does each session get its 250 (never lose a message);
- **delivery from the store**: one loop reads what is not yet sent (in order,
  500 at a time), sends it over 20 SMTP sessions kept open to the next hop
  (pipelining MAIL, RCPT and DATA), and marks the sent rows done in one
  ``UPDATE`` a batch.

No Django, no Celery, no Redis, no second process, no categorizing, routing,
retry rules, claims or leases, no tracking rows, no DKIM, no Queue Viewer:
one row a message, written once and updated once. Whatever mailrelay does
beyond this is what its features cost; what this costs is what the design
(Python's aiosmtpd and a PostgreSQL store that answers 250 only after the
commit) costs before any feature. ``relay_throughput --floor`` runs it in
mailrelay's place beside Postfix, on the same load, sink and database.

    python bench/relaybench/floor.py --listen 127.0.0.1:PORT --next-hop 127.0.0.1:PORT \\
        --database postgres://postgres@127.0.0.1:5432/mailrelay_bench
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import os
import signal
import time

import psycopg
from aiosmtpd.smtp import SMTP, Envelope, Session

SCHEMA = """
DROP TABLE IF EXISTS floor_message;
CREATE TABLE floor_message (
    id bigserial PRIMARY KEY,
    mail_from text NOT NULL,
    rcpt text NOT NULL,
    data bytea NOT NULL,
    done boolean NOT NULL DEFAULT false
);
CREATE INDEX floor_waiting ON floor_message (id) WHERE NOT done;
"""
INSERT = (
    "INSERT INTO floor_message (mail_from, rcpt, data) "
    "SELECT * FROM unnest(%s::text[], %s::text[], %s::bytea[])"
)
WAITING = (
    "SELECT id, mail_from, rcpt, data FROM floor_message "
    "WHERE NOT done AND id > %s ORDER BY id LIMIT 500"
)
DONE = "UPDATE floor_message SET done = true WHERE id = ANY(%s)"
SESSIONS = 20
HERE = __file__


# --- what the bench (relay_throughput --floor) calls, in its own process ------------


def command(python: str, listen: str, next_hop: str, database: str) -> list[str]:
    """The command line that starts the floor relay."""
    return [python, HERE, "--listen", listen, "--next-hop", next_hop, "--database", database]


def reset(database: str) -> None:
    with psycopg.connect(database, autocommit=True) as conn:
        conn.execute("TRUNCATE floor_message")


def wait_done(database: str, expected: int, timeout: float) -> tuple[int, int]:
    """(stored, done) once every one of ``expected`` messages is done, or at the timeout."""
    deadline = time.monotonic() + timeout
    with psycopg.connect(database, autocommit=True) as conn:
        while True:
            stored, done = conn.execute(
                "SELECT count(*), count(*) FILTER (WHERE done) FROM floor_message"
            ).fetchone()
            if stored == done == expected or time.monotonic() > deadline:
                return stored, done
            time.sleep(0.2)


def host_port(text: str) -> tuple[str, int]:
    host, _, port = text.rpartition(":")
    return host, int(port)


class Store:
    """The group commit: every message waiting goes in with one statement."""

    def __init__(self, conn: psycopg.AsyncConnection, stored: asyncio.Event) -> None:
        self.conn = conn
        self.stored = stored
        self.waiting: list[tuple[tuple[str, str, bytes], asyncio.Future[None]]] = []
        self.wake = asyncio.Event()

    async def add(self, row: tuple[str, str, bytes]) -> None:
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.waiting.append((row, future))
        self.wake.set()
        await future

    async def run(self) -> None:
        while True:
            await self.wake.wait()
            self.wake.clear()
            batch, self.waiting = self.waiting, []
            if not batch:
                continue
            columns = list(zip(*(row for row, _ in batch), strict=True))
            try:
                async with self.conn.transaction():
                    await self.conn.execute(INSERT, [list(c) for c in columns])
            except Exception as exc:  # noqa: BLE001 - every session hears of it
                for _, future in batch:
                    future.set_exception(exc)
                continue
            for _, future in batch:
                future.set_result(None)
            self.stored.set()


class Handler:
    """aiosmtpd's hook: a Received field, then the group commit, then 250."""

    def __init__(self, store: Store) -> None:
        self.store = store
        self.ids = itertools.count(1)
        self.prefix = f"F{os.getpid():X}{int(time.time()):X}"

    async def handle_DATA(self, server: SMTP, session: Session, envelope: Envelope) -> str:
        qid = f"{self.prefix}{next(self.ids):X}"
        received = (
            f"Received: from {session.host_name} by floor.bench (mailrelay) with ESMTP id {qid}\r\n"
        ).encode()
        data = received + envelope.original_content
        try:
            for rcpt in envelope.rcpt_tos:
                await self.store.add((envelope.mail_from, rcpt, data))
        except Exception:  # noqa: BLE001
            return "451 4.3.0 Not stored"
        return f"250 2.0.0 Ok: queued as {qid}"


class Client:
    """One SMTP session to the next hop, kept open, pipelining each transaction."""

    def __init__(self, host: str, port: int) -> None:
        self.host, self.port = host, port
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def reply(self) -> int:
        assert self.reader is not None
        while True:
            line = await self.reader.readline()
            if len(line) < 4:
                raise ConnectionError("the next hop closed the session")
            if line[3:4] != b"-":
                return int(line[:3])

    async def open(self) -> None:
        self.reader, self.writer = await asyncio.open_connection(self.host, self.port)
        await self.reply()
        self.writer.write(b"EHLO floor.bench\r\n")
        await self.reply()

    async def send(self, mail_from: str, rcpt: str, data: bytes) -> bool:
        if self.writer is None:
            await self.open()
        assert self.writer is not None
        self.writer.write(f"MAIL FROM:<{mail_from}>\r\nRCPT TO:<{rcpt}>\r\nDATA\r\n".encode())
        codes = [await self.reply() for _ in range(3)]
        if codes[2] != 354:
            self.writer.write(b"RSET\r\n")
            await self.reply()
            return False
        body = data.replace(b"\r\n.", b"\r\n..")
        if body.startswith(b"."):
            body = b"." + body
        if not body.endswith(b"\r\n"):
            body += b"\r\n"
        self.writer.write(body + b".\r\n")
        return await self.reply() == 250


async def deliver(conn: psycopg.AsyncConnection, stored: asyncio.Event, hop: str) -> None:
    """Send what is stored and not yet sent, batch by batch, and mark it done."""
    clients = [Client(*host_port(hop)) for _ in range(SESSIONS)]
    last = 0
    while True:
        await stored.wait()
        stored.clear()
        while True:
            cur = await conn.execute(WAITING, (last,))
            rows = await cur.fetchall()
            if not rows:
                break
            last = rows[-1][0]
            shares = [rows[n :: len(clients)] for n in range(len(clients))]

            async def send_share(client: Client, share: list[tuple]) -> list[int]:
                return [i for i, f, r, d in share if await client.send(f, r, d)]

            sent = await asyncio.gather(
                *(send_share(c, s) for c, s in zip(clients, shares, strict=True) if s)
            )
            await conn.execute(DONE, ([i for ids in sent for i in ids],))


async def main(args: argparse.Namespace) -> None:
    setup = await psycopg.AsyncConnection.connect(args.database, autocommit=True)
    await setup.execute(SCHEMA)
    await setup.close()
    ingress = await psycopg.AsyncConnection.connect(args.database)
    delivery = await psycopg.AsyncConnection.connect(args.database, autocommit=True)
    stored = asyncio.Event()
    store = Store(ingress, stored)
    handler = Handler(store)
    host, port = host_port(args.listen)
    loop = asyncio.get_running_loop()
    server = await loop.create_server(
        lambda: SMTP(handler, hostname="floor.bench", enable_SMTPUTF8=True), host, port
    )
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    tasks = [
        asyncio.create_task(store.run()),
        asyncio.create_task(deliver(delivery, stored, args.next_hop)),
    ]
    print(f"floor relay on {args.listen}, next hop {args.next_hop}", flush=True)
    await stop.wait()
    server.close()
    for task in tasks:
        task.cancel()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--listen", required=True, help="HOST:PORT")
    parser.add_argument("--next-hop", required=True, help="HOST:PORT")
    parser.add_argument("--database", required=True)
    asyncio.run(main(parser.parse_args()))
