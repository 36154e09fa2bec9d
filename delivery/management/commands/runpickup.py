"""`python manage.py runpickup`: the pickup and replay folder watchers, without the ingress.

``runsmtp`` runs the same watchers inside the ingress, where back pressure
can pause them; this command is for deployments without an ingress on the
machine, and for tests and scripts (``--once``).
"""

from __future__ import annotations

import asyncio
import signal
import time

from django.core.management.base import BaseCommand, CommandError

from delivery.pickup.watcher import FolderWatcher, Outcome, configured_folders, start_pickup


class Command(BaseCommand):
    help = "Submit the files dropped in MAILRELAY_PICKUP_DIR and MAILRELAY_REPLAY_DIR."

    def add_arguments(self, parser) -> None:
        parser.add_argument(
            "--once",
            action="store_true",
            help="take what the folders hold now (as soon as each file is stable), then exit",
        )

    def handle(self, *args, once: bool = False, **options) -> None:
        folders = configured_folders()
        if not folders:
            raise CommandError("set MAILRELAY_PICKUP_DIR and/or MAILRELAY_REPLAY_DIR")
        if once:
            self._once([FolderWatcher(f) for f in folders])
            return
        asyncio.run(self._serve())

    def _once(self, watchers: list[FolderWatcher]) -> None:
        """Poll until no folder holds a file still to take (unreadable ones are left)."""
        counts = {Outcome.SUBMITTED: 0, Outcome.BAD: 0}
        busy = True
        first = True
        while busy:
            busy = False
            for watcher in watchers:
                for outcome in watcher.poll():
                    if outcome.status in counts:
                        counts[outcome.status] += 1
                    self.stdout.write(f"{watcher.kind}: {outcome.name}: {_describe(outcome)}")
                busy = busy or first or watcher.pending() > 0
            first = False
            if busy:
                time.sleep(min(w.config.interval for w in watchers))
        self.stdout.write(
            f"pickup: {counts[Outcome.SUBMITTED]} submitted, {counts[Outcome.BAD]} bad"
        )

    async def _serve(self) -> None:
        service = start_pickup()
        for runner in service.runners.values():
            self.stdout.write(f"{runner.kind}: watching {runner.watcher.directory}")
        self.stdout.flush()
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(signum, stop.set)
        await stop.wait()
        self.stdout.write("pickup: stopping")
        await service.stop()
        self.stdout.write("pickup: stopped")
        self.stdout.flush()


def _describe(outcome) -> str:
    if outcome.status == Outcome.SUBMITTED:
        return f"submitted as {outcome.qid}"
    if outcome.status == Outcome.BAD:
        return f"bad: {outcome.reason}"
    return f"{outcome.status}: {outcome.reason}"
