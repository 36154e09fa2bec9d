"""The ingress's own session cost: the relay's SMTP session with no database behind it.

``bench/aiosmtpd_floor.py`` measures aiosmtpd with a handler that does
nothing. This measures what the relay adds on top of it before a byte is
stored: ``InboundServer`` and ``InboundSMTP`` as ``runsmtp`` runs them (the
adapter, HELO/EHLO, MAIL and RCPT with their checks, DATA read in blocks,
the message's checks in ``RelayHandler``), under the same load (Postfix's
smtp-source: 20 sessions, 2 KB messages, one message a connection), with
``InboundServer.store`` answering at once instead of preparing and committing
the message. It prints, for each run and as the median, the rate and this
process's CPU per message (user + system), beside aiosmtpd's floor measured
in the same process, one after the other (``--floor``).

The difference between the two is the per-connection and per-command work on
the relay's side of the adapter; the rest of ``runsmtp``'s CPU a message
(``bench/relay_throughput``) is preparing and committing the message.

    .venv/bin/python bench/session_floor.py [--messages 3000] [--runs 5] [--floor]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import statistics
import sys
import threading
from collections.abc import Awaitable, Callable
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "mailrelay.settings")
os.environ.setdefault("MAILRELAY_RELAY_NETWORKS", "127.0.0.0/8")

import django  # noqa: E402

django.setup()

from aiosmtpd_floor import measure  # noqa: E402
from aiosmtpd_floor import one_run as floor_run  # noqa: E402

from delivery.smtpd.config import InboundConfig  # noqa: E402
from delivery.smtpd.server import InboundServer  # noqa: E402
from queues.accept import IncomingEnvelope  # noqa: E402


class Answered:
    """``InboundServer.store`` that counts the message and answers with a queue id."""

    def __init__(self) -> None:
        self.count = 0

    async def __call__(self, envelope: IncomingEnvelope, data: bytes) -> str:
        self.count += 1
        return "4ZXQ0000001"


class Stored(Answered):
    """The real ``InboundServer.store`` (prepared, group-committed into the
    database, the categorizer rung), counted."""

    def __init__(self, store: Callable[[IncomingEnvelope, bytes], Awaitable[str]]) -> None:
        super().__init__()
        self.store = store

    async def __call__(self, envelope: IncomingEnvelope, data: bytes) -> str:
        qid = await self.store(envelope, data)
        self.count += 1
        return qid


def one_run(
    port: int, messages: int, sessions: int, size: int, *, store: bool = False
) -> tuple[float, float]:
    """(messages a second, CPU ms a message) of one run of the relay's session."""
    loop = asyncio.new_event_loop()
    server = InboundServer(InboundConfig.from_settings())
    answered = Stored(server.store) if store else Answered()
    server.store = answered  # type: ignore[method-assign] - RelayHandler calls it
    loop.run_until_complete(server.start([("127.0.0.1", port)]))
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        return measure(port, messages, sessions, size, lambda: answered.count)
    finally:
        asyncio.run_coroutine_threadsafe(server.stop(grace=1.0), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--messages", type=int, default=3000)
    parser.add_argument("--sessions", type=int, default=20)
    parser.add_argument("--size", type=int, default=2048, help="bytes a message")
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--port", type=int, default=10026)
    parser.add_argument("--floor", action="store_true", help="aiosmtpd's floor too, alternating")
    parser.add_argument(
        "--store",
        action="store_true",
        help="store the messages as runsmtp does (DATABASE_URL, migrated; CELERY_BROKER_URL)",
    )
    args = parser.parse_args()
    if shutil.which("smtp-source") is None:
        print("smtp-source not found (Debian: apt-get install postfix)", file=sys.stderr)
        return 2
    costs: dict[str, list[float]] = {"relay session": [], "aiosmtpd floor": []}
    for n in range(1, args.runs + 1):
        rate, cost = one_run(args.port, args.messages, args.sessions, args.size, store=args.store)
        costs["relay session"].append(cost)
        line = f"run {n}: relay session {rate:.0f} msg/s, CPU {cost:.3f} ms/msg"
        if args.floor:
            rate, cost = floor_run(args.port + 1, args.messages, args.sessions, args.size)
            costs["aiosmtpd floor"].append(cost)
            line += f"; aiosmtpd floor {rate:.0f} msg/s, CPU {cost:.3f} ms/msg"
        print(line, flush=True)
    for name, values in costs.items():
        if values:
            print(f"{name}: median {statistics.median(values):.3f} ms of CPU a message")
    return 0


if __name__ == "__main__":
    sys.exit(main())
