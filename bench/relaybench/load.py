"""An asyncio SMTP load client that records per-message accept latency.

Run as a separate process (so its CPU is measured on its own and it has its
own GIL)::

    python bench/relaybench/load.py --port 2525 --messages 5000 --size 2048 \
        --sessions 20 --tag RUN1 --out result.json

Like ``smtp-source -s 20 -l 2048 -m N`` it runs ``--sessions`` SMTP sessions
in parallel and by default sends one message per connection (``smtp-source``
without ``-d``); ``--per-connection`` sends more over one connection. It
speaks plain ESMTP without pipelining, one command and one reply at a time.

With ``--rate R`` the load is offered at R messages per second instead of
as fast as the sessions go: message n is not started before ``n / R``
seconds after the start (a session that falls behind starts at once, and
``--sessions`` bounds how many are in flight), so the accept latency is
measured at that offered rate, not at saturation.

Per message it records the accept latency: the time from sending the
end-of-data dot (the body is already written and drained) to reading the
final reply. Every message carries ``X-Bench-Seq: <tag>.<n>`` and a unique
recipient ``rcpt<n>@<domain>`` so the sink side can prove exactly-once
delivery.

The result (JSON) holds wall-clock (``time.time()``) timestamps of the first
connect and of the last accepted reply, the latencies (ms) of the accepted
messages, the accepted sequence numbers and the first rejections/errors.
This file deliberately imports only the standard library.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import sys
import time
from dataclasses import dataclass, field
from email.utils import formatdate


@dataclass
class Stats:
    first_connect: float | None = None  # wall clock
    last_accept: float | None = None  # wall clock
    latencies_ms: list[float] = field(default_factory=list)
    accepted: list[int] = field(default_factory=list)
    rejected: list[dict[str, object]] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    error_count: int = 0  # messages lost to a connection error (never answered)
    connections: int = 0


class SMTPReplyError(Exception):
    def __init__(self, command: str, code: int, text: str) -> None:
        super().__init__(f"{command}: {code} {text}")
        self.command, self.code, self.text = command, code, text


def build_message(seq: int, tag: str, size: int, sender: str, rcpt: str) -> bytes:
    """Headers plus ``size`` bytes of payload (CRLF lines of at most 78 characters)."""
    headers = (
        f"From: <{sender}>\r\n"
        f"To: <{rcpt}>\r\n"
        f"Subject: relay_throughput {tag} {seq}\r\n"
        f"Date: {formatdate(localtime=False)}\r\n"
        f"Message-ID: <{tag}.{seq}@loadclient.bench.local>\r\n"
        f"X-Bench-Seq: {tag}.{seq}\r\n"
        "\r\n"
    ).encode()
    lines = []
    remaining = size
    n = 0
    while remaining > 0:
        n += 1
        width = min(78, remaining - 2) if remaining > 2 else 0
        prefix = str(n)
        line = (prefix + "X" * max(0, width - len(prefix)))[: max(width, 0)]
        lines.append(line.encode() + b"\r\n")
        remaining -= len(lines[-1])
    return headers + b"".join(lines)


async def read_reply(reader: asyncio.StreamReader, command: str, expect: int) -> None:
    """Read one (possibly multi-line) reply; raise unless its code is ``expect``."""
    text_lines: list[str] = []
    while True:
        line = await reader.readline()
        if not line:
            raise ConnectionError(f"{command}: connection closed by the server")
        text = line.decode("utf-8", "replace").rstrip("\r\n")
        text_lines.append(text[4:])
        if len(text) < 4 or text[3] != "-":
            break
    try:
        code = int(text[:3])
    except ValueError:
        raise ConnectionError(f"{command}: malformed reply {text!r}") from None
    if code != expect:
        raise SMTPReplyError(command, code, " / ".join(text_lines))


class Load:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.next_seq = 0
        self.stats = Stats()
        self.deadline = time.monotonic() + args.timeout
        self.started = time.monotonic()
        self.late = 0  # messages started after their slot (the server could not keep up)

    async def pace(self, seq: int) -> None:
        """With --rate: wait for message ``seq``'s slot in the offered schedule."""
        if not self.args.rate:
            return
        due = self.started + seq / self.args.rate
        delay = due - time.monotonic()
        if delay > 0:
            await asyncio.sleep(delay)
        elif delay < -0.05:
            self.late += 1

    def take(self) -> int | None:
        if self.next_seq >= self.args.messages:
            return None
        seq = self.next_seq
        self.next_seq += 1
        return seq

    async def session(self) -> None:
        a = self.args
        seq = self.take()
        while seq is not None:
            if time.monotonic() > self.deadline:
                self.stats.errors.append("timeout: gave up before sending everything")
                return
            await self.pace(seq)
            now = time.time()
            if self.stats.first_connect is None:
                self.stats.first_connect = now
            writer: asyncio.StreamWriter | None = None
            try:
                reader, writer = await asyncio.open_connection(a.host, a.port)
                self.stats.connections += 1
                await read_reply(reader, "greeting", 220)
                writer.write(f"EHLO {a.helo}\r\n".encode())
                await read_reply(reader, "EHLO", 250)
                for _ in range(a.per_connection):
                    if a.per_connection > 1:
                        await self.pace(seq)
                    rcpt = f"rcpt{seq}@{a.rcpt_domain}"
                    data = build_message(seq, a.tag, a.size, a.sender, rcpt)
                    try:
                        writer.write(f"MAIL FROM:<{a.sender}> SIZE={len(data)}\r\n".encode())
                        await read_reply(reader, "MAIL", 250)
                        writer.write(f"RCPT TO:<{rcpt}>\r\n".encode())
                        await read_reply(reader, "RCPT", 250)
                        writer.write(b"DATA\r\n")
                        await read_reply(reader, "DATA", 354)
                        writer.write(data)  # no line starts with "."
                        await writer.drain()
                        t_dot = time.perf_counter()
                        writer.write(b".\r\n")
                        await read_reply(reader, "end of data", 250)
                        latency = time.perf_counter() - t_dot
                        self.stats.last_accept = time.time()
                        self.stats.latencies_ms.append(latency * 1000.0)
                        self.stats.accepted.append(seq)
                    except SMTPReplyError as exc:
                        self.stats.rejected.append(
                            {"seq": seq, "command": exc.command, "code": exc.code, "text": exc.text}
                        )
                        writer.write(b"RSET\r\n")
                        await read_reply(reader, "RSET", 250)
                    seq = self.take()
                    if seq is None:
                        break
                writer.write(b"QUIT\r\n")
                await read_reply(reader, "QUIT", 221)
            except (OSError, ConnectionError, SMTPReplyError, asyncio.IncompleteReadError) as exc:
                self.stats.error_count += 1
                if len(self.stats.errors) < 20:
                    self.stats.errors.append(f"message {seq}: {exc}")
                seq = self.take()  # that message is lost to the client, not retried
            finally:
                if writer is not None:
                    writer.close()
                    with contextlib.suppress(OSError, ConnectionError):
                        await writer.wait_closed()

    async def run(self) -> Stats:
        self.started = time.monotonic()
        await asyncio.gather(*(self.session() for _ in range(self.args.sessions)))
        return self.stats


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--messages", type=int, default=5000)
    p.add_argument("--size", type=int, default=2048, help="payload bytes (without headers)")
    p.add_argument("--sessions", type=int, default=20)
    p.add_argument("--per-connection", type=int, default=1)
    p.add_argument("--tag", default="bench")
    p.add_argument("--helo", default="loadclient.bench.local")
    p.add_argument("--sender", default="sender@example.org")
    p.add_argument("--rcpt-domain", default="example.net")
    p.add_argument("--timeout", type=float, default=600.0, help="give up after this many s")
    p.add_argument(
        "--rate",
        type=float,
        default=0.0,
        help="offered load in messages per second (0: as fast as the sessions go)",
    )
    p.add_argument("--out", required=True, help="write the JSON result here")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    load = Load(args)
    stats = asyncio.run(load.run())
    result = {
        "rate": args.rate,
        "late": load.late,
        "first_connect": stats.first_connect,
        "last_accept": stats.last_accept,
        "latencies_ms": stats.latencies_ms,
        "accepted": stats.accepted,
        "rejected": stats.rejected[:50],
        "rejected_count": len(stats.rejected),
        "errors": stats.errors,
        "error_count": stats.error_count,
        "connections": stats.connections,
    }
    with open(args.out, "w") as fh:
        json.dump(result, fh)
    return 0


if __name__ == "__main__":
    sys.exit(main())
