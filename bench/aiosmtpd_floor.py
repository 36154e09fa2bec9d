"""A floor for the ingress: aiosmtpd with a handler that does nothing.

The relay bench's load (Postfix's smtp-source: 20 sessions, 2 KB messages) into
an aiosmtpd ``Controller`` whose ``handle_DATA`` only answers 250, in this one
process. It prints, for each run and as the median, the rate and the CPU this
process spent per message (user + system): what aiosmtpd costs before a byte
is stored, to set beside Postfix's figures from ``bench/relay_throughput``.

    .venv/bin/python bench/aiosmtpd_floor.py [--messages 3000] [--runs 3]
"""

from __future__ import annotations

import argparse
import resource
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Callable

from aiosmtpd.controller import Controller


class Noop:
    """Counts the messages and answers 250."""

    def __init__(self) -> None:
        self.count = 0

    async def handle_DATA(self, server, session, envelope) -> str:  # noqa: ANN001 - aiosmtpd's hook
        self.count += 1
        return "250 2.0.0 Ok"


def cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def measure(
    port: int, messages: int, sessions: int, size: int, counted: Callable[[], int]
) -> tuple[float, float]:
    """Send ``messages`` with smtp-source to ``port``; wait until ``counted()`` has them
    all. (messages a second, CPU ms a message) of this process meanwhile."""
    cpu0, t0 = cpu_seconds(), time.monotonic()
    subprocess.run(
        ["smtp-source", "-s", str(sessions), "-l", str(size), "-m", str(messages)]
        + ["-f", "a@example.org", "-t", "b@example.net", f"127.0.0.1:{port}"],
        check=True,
    )
    while counted() < messages:
        time.sleep(0.01)
    elapsed, cpu = time.monotonic() - t0, cpu_seconds() - cpu0
    return messages / elapsed, 1000 * cpu / messages


def one_run(port: int, messages: int, sessions: int, size: int) -> tuple[float, float]:
    """(messages a second, CPU ms a message) of one run."""
    handler = Noop()
    controller = Controller(handler, hostname="127.0.0.1", port=port)
    controller.start()
    try:
        return measure(port, messages, sessions, size, lambda: handler.count)
    finally:
        controller.stop()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--messages", type=int, default=3000)
    parser.add_argument("--sessions", type=int, default=20)
    parser.add_argument("--size", type=int, default=2048, help="bytes a message")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--port", type=int, default=10025)
    args = parser.parse_args()
    if shutil.which("smtp-source") is None:
        print("smtp-source not found (Debian: apt-get install postfix)", file=sys.stderr)
        return 2
    rates, costs = [], []
    for n in range(1, args.runs + 1):
        rate, cost = one_run(args.port, args.messages, args.sessions, args.size)
        rates.append(rate)
        costs.append(cost)
        print(f"run {n}: {rate:.0f} msg/s, CPU {cost:.3f} ms/msg")
    print(
        f"aiosmtpd, handler that does nothing: median {statistics.median(rates):.0f} msg/s, "
        f"{statistics.median(costs):.3f} ms of CPU a message"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
