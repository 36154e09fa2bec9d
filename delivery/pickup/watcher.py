"""The pickup and replay folder watchers.

``FolderWatcher`` does the work of one folder, synchronously: list the
``*.eml`` files, take those whose size and modification time did not change
since the previous poll, and submit each — or rename it ``.bad`` beside a
``.bad.txt`` saying why. ``PickupService`` runs one watcher per configured
folder on an asyncio loop (the SMTP ingress's, or ``runpickup``'s), with the
file and database work in one database thread, and stops taking files while
``allowed(kind)`` is False (back pressure).

Guarantees:
- a file is deleted only after its message is committed; a process that
  dies in between leaves the file, which is submitted again (at least once);
- a file that cannot be parsed is renamed ``.bad`` (not ``*.eml`` any more,
  so never taken again) and its reason written to ``.bad.txt``;
- a file still being written is not taken: writers write another name and
  rename to ``*.eml``, and a file must look the same on two polls in a row;
- several processes may watch one folder: a file is taken under an
  exclusive ``flock``, and only if its name still points to the locked file.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import fcntl
import logging
import os
import stat
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

from django.conf import settings
from django.db import connection

from delivery.pickup.parse import (
    BadFile,
    PickupLimits,
    Submission,
    parse_pickup,
    parse_replay,
)
from queues import counters
from queues.accept import message_accept
from queues.lib import clock
from queues.models import Event, EventLevel
from queues.signals import categorizer_work

log = logging.getLogger(__name__)

KINDS = ("pickup", "replay")
SUFFIX = ".eml"
BAD_SUFFIX = ".bad"
# Room in a replay file for its X- lines and the headers added on the way
# (our Received), beyond MAILRELAY_MAX_MESSAGE_SIZE.
REPLAY_SIZE_SLACK = 1024 * 1024
_READ_CHUNK = 1024 * 1024

Allowed = Callable[[str], bool]


def always_allowed(kind: str) -> bool:
    return True


# --------------------------------------------------------------------------- settings


@dataclass(frozen=True)
class FolderConfig:
    """One folder's settings, read once from ``django.conf.settings`` when watching starts."""

    kind: str  # "pickup" or "replay"
    directory: Path
    interval: float  # seconds between polls
    max_per_minute: int  # files taken per minute (0: no limit)
    limits: PickupLimits  # pickup only
    max_file_size: int  # bytes (0: no limit)
    hostname: str  # our name, the HELO of every message taken (MAILRELAY_HOSTNAME)

    @classmethod
    def from_settings(cls, kind: str) -> FolderConfig | None:
        """The folder's configuration, or None when its directory is not set."""
        if kind not in KINDS:
            raise ValueError(f"kind: one of {KINDS}")
        directory = str(getattr(settings, f"MAILRELAY_{kind.upper()}_DIR") or "")
        if not directory:
            return None
        interval: timedelta = settings.MAILRELAY_PICKUP_POLL_INTERVAL
        max_size = int(settings.MAILRELAY_MAX_MESSAGE_SIZE or 0)
        if kind == "replay" and max_size:
            max_size += REPLAY_SIZE_SLACK
        return cls(
            kind=kind,
            directory=Path(directory),
            interval=max(interval.total_seconds(), 0.001),
            max_per_minute=int(settings.MAILRELAY_PICKUP_MAX_MESSAGES_PER_MINUTE),
            limits=PickupLimits(
                max_header_size=int(settings.MAILRELAY_PICKUP_MAX_HEADER_SIZE),
                max_recipients=int(settings.MAILRELAY_PICKUP_MAX_RECIPIENTS_PER_MESSAGE),
            ),
            max_file_size=max_size,
            hostname=settings.MAILRELAY_HOSTNAME,
        )


def configured_folders() -> list[FolderConfig]:
    return [c for c in (FolderConfig.from_settings(k) for k in KINDS) if c is not None]


# --------------------------------------------------------------------------- one folder


class Outcome:
    SUBMITTED = "submitted"  # committed, file deleted
    BAD = "bad"  # renamed .bad with its reason
    SKIPPED = "skipped"  # gone, changed, or taken by another process: looked at again later
    FAILED = "failed"  # could not be read or stored now: left in place, tried again later


@dataclass(frozen=True)
class FileOutcome:
    name: str
    status: str
    qid: str = ""
    reason: str = ""


# size, mtime (ns), inode, device: the same four on two polls = done being written
_Identity = tuple[int, int, int, int]


def _identity(st: os.stat_result) -> _Identity:
    return (st.st_size, st.st_mtime_ns, st.st_ino, st.st_dev)


class _StoreFailed(Exception):
    pass


class FolderWatcher:
    """One pickup or replay folder. Not thread-safe: one thread polls it at a time."""

    def __init__(self, config: FolderConfig, *, now: Callable[[], float] = time.monotonic):
        self.config = config
        self.kind = config.kind
        self.directory = config.directory
        self._now = now
        self._seen: dict[str, _Identity] = {}  # name → identity at the previous poll
        # Files this process must not take again while they are unchanged: one
        # whose message was committed but that could not be deleted, or one
        # that could not be renamed .bad.
        self._stuck: dict[str, _Identity] = {}
        self._unreadable: dict[str, _Identity] = {}  # warned about once
        self._taken: deque[float] = deque()  # when files were taken, for the rate limit
        self._listing_failed = False

    # --- polling

    def poll(self, allowed: Callable[[], bool] = lambda: True) -> list[FileOutcome]:
        """One poll: take every stable file the rate limit allows, while ``allowed()``."""
        outcomes: list[FileOutcome] = []
        for name in self.stable_files():
            if not allowed() or not self.has_budget():
                break
            outcome = self.take(name)
            outcomes.append(outcome)
            if outcome.status == Outcome.FAILED and outcome.reason.startswith("database"):
                break  # the next file would fail the same way; try again next poll
        return outcomes

    def pending(self) -> int:
        """``*.eml`` files seen and not yet taken (stuck and unreadable ones excluded)."""
        return sum(1 for n in self._seen if n not in self._stuck and n not in self._unreadable)

    def stable_files(self) -> list[str]:
        """Names of ``*.eml`` files unchanged since the previous poll, oldest first."""
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            entries = list(os.scandir(self.directory))
        except OSError as exc:
            if not self._listing_failed:
                log.error("%s folder %s cannot be read: %s", self.kind, self.directory, exc)
                self._listing_failed = True
            return []
        self._listing_failed = False
        current: dict[str, _Identity] = {}
        for entry in entries:
            name = entry.name
            if name.startswith(".") or not name.lower().endswith(SUFFIX):
                continue
            try:
                st = entry.stat(follow_symlinks=False)
            except FileNotFoundError:
                continue
            if not stat.S_ISREG(st.st_mode):  # links and devices are never taken
                continue
            current[name] = _identity(st)
        stable = [name for name, ident in current.items() if self._seen.get(name) == ident]
        self._seen = current
        for known in (self._stuck, self._unreadable):
            for name in list(known):
                if current.get(name) != known[name]:
                    del known[name]  # gone or replaced: a new file under that name
        stable = [name for name in stable if name not in self._stuck]
        stable.sort(key=lambda name: (current[name][1], name))
        return stable

    def has_budget(self) -> bool:
        limit = self.config.max_per_minute
        if limit <= 0:
            return True
        horizon = self._now() - 60.0
        while self._taken and self._taken[0] <= horizon:
            self._taken.popleft()
        return len(self._taken) < limit

    # --- one file

    def take(self, name: str) -> FileOutcome:
        """Submit one file, or rename it .bad. Never raises for a file's fault."""
        path = self.directory / name
        expected = self._seen.get(name)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
        except FileNotFoundError:
            self._seen.pop(name, None)
            return FileOutcome(name, Outcome.SKIPPED, reason="gone")
        except OSError as exc:
            return self._cannot_open(name, expected, exc)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return FileOutcome(name, Outcome.SKIPPED, reason="taken by another process")
            ident = _identity(os.fstat(fd))
            try:
                at_path = _identity(os.lstat(path))
            except FileNotFoundError:
                at_path = None
            if at_path != ident:  # another process finished it while we waited
                self._seen.pop(name, None)
                return FileOutcome(name, Outcome.SKIPPED, reason="gone")
            if expected is not None and ident != expected:
                self._seen[name] = ident
                return FileOutcome(name, Outcome.SKIPPED, reason="still changing")
            return self._take_locked(name, path, fd, ident)
        finally:
            os.close(fd)  # releases the lock

    def _take_locked(self, name: str, path: Path, fd: int, ident: _Identity) -> FileOutcome:
        self._taken.append(self._now())
        self._seen.pop(name, None)
        limit = self.config.max_file_size
        if limit and ident[0] > limit:
            return self._bad(
                name, path, ident, f"the file is {ident[0]} bytes; the limit is {limit}"
            )
        try:
            raw = _read_all(fd)
        except OSError as exc:
            return self._cannot_open(name, ident, exc)
        try:
            submission = self._parse(raw)
        except BadFile as exc:
            return self._bad(name, path, ident, exc.reason)
        except Exception as exc:  # noqa: BLE001 - a parser bug must not retry the file forever
            log.exception("%s: parsing %s failed", self.kind, path)
            return self._bad(name, path, ident, f"could not be parsed: {exc!r}")
        try:
            qid = _store(submission)
        except _StoreFailed as exc:
            self._taken.pop()  # not taken after all
            self._seen[name] = ident
            return FileOutcome(name, Outcome.FAILED, reason=f"database: {exc}")
        counters.count_accepted(self.kind)
        counters.count_pickup_file(self.kind, Outcome.SUBMITTED)
        env_ = submission.envelope
        log.info(
            "%s: %s from=<%s> nrcpt=%d size=%d file=%s",
            qid,
            self.kind,
            env_.mail_from,
            len(env_.recipients),
            len(submission.data),
            path,
        )
        try:
            os.unlink(path)
        except OSError as exc:
            # Committed: taking it again would send it twice.
            self._stuck[name] = ident
            log.error(
                "%s: %s was submitted but cannot be deleted (%s); remove it by hand, "
                "or it is submitted again when mailrelay restarts",
                qid,
                path,
                exc,
            )
        _ring()
        return FileOutcome(name, Outcome.SUBMITTED, qid=qid)

    def _parse(self, raw: bytes) -> Submission:
        if self.kind == "replay":
            submission = parse_replay(raw)
        else:
            submission = parse_pickup(raw, self.config.limits, clock.now())
        submission.envelope = dataclasses.replace(
            submission.envelope,
            client_helo=self.config.hostname,
            client_name="localhost",
        )
        return submission

    def _cannot_open(self, name: str, ident: _Identity | None, exc: OSError) -> FileOutcome:
        # Exchange leaves a file it cannot open and looks again at the next poll
        # (permissions may be fixed meanwhile); say so once, not every poll.
        if self._unreadable.get(name) != ident or ident is None:
            log.warning("%s: cannot read %s: %s", self.kind, self.directory / name, exc)
        if ident is not None:
            self._unreadable[name] = ident
            self._seen[name] = ident
        return FileOutcome(name, Outcome.FAILED, reason=f"cannot read: {exc}")

    def _bad(self, name: str, path: Path, ident: _Identity, reason: str) -> FileOutcome:
        target = _free_bad_name(self.directory, name[: -len(SUFFIX)])
        note = target.with_name(target.name + ".txt")
        when = clock.now().isoformat(timespec="seconds")
        text = f"{when} {self.kind} {name}: {reason}\n"
        try:
            _write_atomically(note, text.encode("utf-8"))
            os.rename(path, target)
        except OSError as exc:
            self._stuck[name] = ident
            log.error("%s: %s is bad (%s) but cannot be renamed: %s", self.kind, path, reason, exc)
            return FileOutcome(name, Outcome.FAILED, reason=f"bad, not renamed: {reason}")
        counters.count_pickup_file(self.kind, Outcome.BAD)
        log.warning("%s: %s is bad, renamed %s: %s", self.kind, path, target.name, reason)
        _event(self.kind, f"{name} renamed {target.name}: {reason}", target.name, reason)
        return FileOutcome(name, Outcome.BAD, reason=reason)


def _free_bad_name(directory: Path, stem: str) -> Path:
    """``stem.bad``, else ``stem.1.bad``, ``stem.2.bad``, …: never over an earlier one."""
    for n in range(10000):
        target = directory / (f"{stem}{BAD_SUFFIX}" if n == 0 else f"{stem}.{n}{BAD_SUFFIX}")
        if not target.exists() and not target.with_name(target.name + ".txt").exists():
            return target
    return directory / f"{stem}.{time.time_ns()}{BAD_SUFFIX}"


def _read_all(fd: int) -> bytes:
    chunks = []
    while chunk := os.read(fd, _READ_CHUNK):
        chunks.append(chunk)
    return b"".join(chunks)


def _write_atomically(path: Path, data: bytes) -> None:
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    temporary.write_bytes(data)
    os.replace(temporary, path)


def _store(submission: Submission) -> str:
    """Commit the message; returns its queue id. Raises _StoreFailed (file stays)."""
    try:
        return message_accept(submission.envelope, submission.data).qid
    except Exception as exc:
        log.exception("storing a message from a pickup/replay file failed")
        # After a failed COMMIT or a lost server the connection is unusable: drop it
        # so the next try reconnects (the connection is this thread's own).
        if not connection.in_atomic_block:
            with contextlib.suppress(Exception):
                connection.close()
        raise _StoreFailed(str(exc) or type(exc).__name__) from exc


def _ring() -> None:
    categorizer_work.send(sender=None)


def _event(kind: str, text: str, bad_name: str, reason: str) -> None:
    """A warning in the events list, so operators see bad files without reading logs."""
    try:
        Event.objects.create(
            created_at=clock.now(),
            level=EventLevel.WARNING,
            kind=f"{kind}_bad_file",
            text=text,
            data={"folder": kind, "file": bad_name, "reason": reason},
        )
    except Exception:  # noqa: BLE001 - the .bad.txt and the log carry it anyway
        log.warning("could not record the bad-file event", exc_info=True)


# --------------------------------------------------------------------------- on a loop


class FolderRunner:
    """Polls one watcher every ``interval`` on the event loop; file work in ``executor``."""

    def __init__(
        self,
        watcher: FolderWatcher,
        allowed: Allowed,
        executor: concurrent.futures.Executor,
    ) -> None:
        self.watcher = watcher
        self.kind = watcher.kind
        self._allowed = allowed
        self._executor = executor
        self._stop = asyncio.Event()
        self._changed = asyncio.Condition()
        self.paused = False
        self.polls = 0  # completed polls (paused ones too)
        self.submitted = 0
        self.bad = 0
        self.task: asyncio.Task | None = None

    def allowed(self) -> bool:
        try:
            return bool(self._allowed(self.kind))
        except Exception:  # noqa: BLE001 - a broken monitor pauses, it does not crash us
            log.exception("%s: the back-pressure check failed; pausing", self.kind)
            return False

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        while not self._stop.is_set():
            try:
                if self.allowed():
                    if self.paused:
                        log.info("%s: resumed (back pressure eased)", self.kind)
                        self.paused = False
                    await self._poll(loop)
                elif not self.paused:
                    log.warning("%s: paused by back pressure", self.kind)
                    self.paused = True
            except Exception:  # noqa: BLE001 - one bad poll must not end the watcher
                log.exception("%s: poll failed", self.kind)
            async with self._changed:
                self.polls += 1
                self._changed.notify_all()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stop.wait(), self.watcher.config.interval)

    async def _poll(self, loop: asyncio.AbstractEventLoop) -> None:
        names = await loop.run_in_executor(self._executor, self.watcher.stable_files)
        for name in names:
            # Back pressure is checked here, on the loop, between files.
            if self._stop.is_set() or not self.allowed() or not self.watcher.has_budget():
                break
            outcome = await loop.run_in_executor(self._executor, self.watcher.take, name)
            if outcome.status in (Outcome.SUBMITTED, Outcome.BAD):
                async with self._changed:
                    if outcome.status == Outcome.SUBMITTED:
                        self.submitted += 1
                    else:
                        self.bad += 1
                    self._changed.notify_all()
            if outcome.status == Outcome.FAILED and outcome.reason.startswith("database"):
                break

    async def wait_until(self, predicate: Callable[[FolderRunner], bool]) -> None:
        """Wait until ``predicate(self)`` holds after a poll or a file (tests, tools)."""
        async with self._changed:
            await self._changed.wait_for(lambda: predicate(self))

    async def stop(self) -> None:
        self._stop.set()
        if self.task is not None:
            await self.task


class PickupService:
    """The running watchers of one process; ``await stop()`` before the loop ends."""

    def __init__(self, runners: list[FolderRunner], executor: concurrent.futures.Executor):
        self.runners = {r.kind: r for r in runners}
        self._executor = executor
        self._stopped = False

    async def stop(self) -> None:
        """Finish the file in hand, stop polling, close the database thread's connection."""
        if self._stopped:
            return
        self._stopped = True
        for runner in self.runners.values():
            await runner.stop()
        await asyncio.get_running_loop().run_in_executor(None, self._executor.shutdown)


def start_pickup(
    loop: asyncio.AbstractEventLoop | None = None,
    *,
    allowed: Allowed = always_allowed,
    folders: list[FolderConfig] | None = None,
) -> PickupService:
    """Start watching MAILRELAY_PICKUP_DIR and MAILRELAY_REPLAY_DIR (those set) on ``loop``.

    Call it from a coroutine on the loop (the running loop is used by
    default). ``allowed("pickup")`` / ``allowed("replay")`` is asked before
    each poll and each file, on the loop: while it is False the folder is
    left alone; polling resumes by itself. With no folder configured the
    service does nothing.
    """
    from delivery.smtpd.server import DatabaseExecutor  # its threads close their connections

    loop = loop or asyncio.get_running_loop()
    folders = configured_folders() if folders is None else folders
    executor = DatabaseExecutor(1, name="pickup-db") if folders else _NoExecutor()
    runners = [FolderRunner(FolderWatcher(f), allowed, executor) for f in folders]
    for runner in runners:
        runner.task = loop.create_task(runner.run(), name=f"mailrelay-{runner.kind}")
        log.info("%s: watching %s", runner.kind, runner.watcher.directory)
    return PickupService(runners, executor)


class _NoExecutor(concurrent.futures.Executor):
    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        return None
