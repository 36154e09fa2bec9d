"""Postfix's ``smtp-sink`` as the final destination, and how deliveries are counted.

The sink runs as::

    smtp-sink -4 -c -h sink.bench.local -d DIR/cur/%H%M%S. [-u nobody] 127.0.0.1:PORT 1024

Counting uses both of its outputs:

- ``-c`` prints running counters (``sess=.. quit=.. mesg=N``, separated by
  ``\\r``) to stdout, unbuffered, whenever a "." is received. A reader thread
  keeps the latest ``mesg`` value and the wall-clock time it changed: that is
  the live progress used to wait for completion.
- ``-d`` writes every mail transaction to its own file (on tmpfs when
  ``/dev/shm`` exists, so the sink stays cheap). After a phase the harness
  renames ``cur/`` to the phase's name (smtp-sink re-creates ``cur/`` for the
  next message) and parses every file: the relay's queue id from its
  ``Received:`` header, the recipients, and our load client's
  ``X-Bench-Seq``. Duplicates and missing messages are found from those, and
  the newest file modification time is the time of the last delivery.

With ``tls=True`` (``--sink-tls``), or ``kind="asyncio"``, the sink is
``relaybench/tls_sink.py`` instead: the same two outputs, plus STARTTLS (with
``tls``) and an ``X-Client-TLS:`` line per dump, counted as ``DumpReport.tls``.
``DumpReport.signed`` counts the dumps whose header has a DKIM-Signature.
"""

from __future__ import annotations

import os
import pwd
import re
import subprocess
import sys
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from .util import Procs, wait_port

SMTP_SINK = "/usr/sbin/smtp-sink"

_RELAY_ID = re.compile(rb"\bby (\S+) \((mailrelay|Postfix)\) with \S+ id ([0-9A-Za-z]+)")
_SEQ = re.compile(rb"^X-Bench-Seq: (\S+)\.(\d+)\s*$", re.M)
_TLS = re.compile(rb"^X-Client-TLS: (.+)$", re.M)
_DKIM = re.compile(rb"^DKIM-Signature:", re.M | re.I)
TLS_SINK = Path(__file__).resolve().parent / "tls_sink.py"
KINDS = ("smtp-sink", "asyncio")


@dataclass
class Dump:
    path: Path
    mtime: float
    relay_id: str | None
    rcpts: list[str]
    seq: tuple[str, int] | None
    tls: str | None = None  # "TLSv1.3 TLS_AES_256_GCM_SHA384" (asyncio sink only)
    signed: bool = False  # a DKIM-Signature field in the header


@dataclass
class DumpReport:
    """What arrived at the sink during one phase."""

    files: int
    first_mtime: float | None
    last_mtime: float | None
    relay_ids: Counter[str] = field(default_factory=Counter)
    seqs: Counter[tuple[str, int]] = field(default_factory=Counter)
    without_id: int = 0
    tls: int = 0  # dumps received over TLS
    signed: int = 0  # dumps with a DKIM-Signature
    tls_versions: Counter[str] = field(default_factory=Counter)

    def duplicates_by_relay_id(self) -> int:
        return sum(n - 1 for n in self.relay_ids.values() if n > 1)

    def duplicates_by_seq(self) -> int:
        return sum(n - 1 for n in self.seqs.values() if n > 1)


def parse_dump(path: Path) -> Dump:
    raw = path.read_bytes()
    st = path.stat()
    head, _, _ = raw.partition(b"\n\n")  # smtp-sink's lines + the message header
    unfolded = re.sub(rb"\r?\n[ \t]+", b" ", head)
    m = _RELAY_ID.search(unfolded)
    s = _SEQ.search(unfolded)
    t = _TLS.search(head)
    tls = t.group(1).strip().decode("ascii", "replace") if t else None
    rcpts = [
        line[len(b"X-Rcpt-Args: ") :].decode("ascii", "replace")
        for line in head.splitlines()
        if line.startswith(b"X-Rcpt-Args: ")
    ]
    return Dump(
        path=path,
        mtime=st.st_mtime_ns / 1e9,
        relay_id=m.group(3).decode() if m else None,
        rcpts=rcpts,
        seq=(s.group(1).decode(), int(s.group(2))) if s else None,
        tls=None if tls in (None, "none") else tls,
        signed=_DKIM.search(head) is not None,
    )


class Sink:
    """One sink process on 127.0.0.1:``port`` that dumps into ``dump_root``.

    ``kind`` "smtp-sink" is Postfix's; "asyncio" is relaybench/tls_sink.py,
    which ``tls`` (offer STARTTLS) needs.
    """

    def __init__(
        self,
        procs: Procs,
        port: int,
        dump_root: Path,
        log_dir: Path,
        kind: str = "smtp-sink",
        tls: bool = False,
    ) -> None:
        if kind not in KINDS:
            raise ValueError(f"unknown sink {kind!r}")
        if tls and kind != "asyncio":
            raise ValueError("only the asyncio sink offers STARTTLS")
        self.kind = kind
        self.tls = tls
        self.procs = procs
        self.port = port
        self.dump_root = dump_root
        self.log_dir = log_dir
        self.count = 0  # the live "mesg=" counter
        self.sessions = 0  # "sess=": connections so far
        self.tls_sessions = 0  # "tls=" (asyncio sink): STARTTLS handshakes so far
        self.count_changed_at = time.time()
        self._phase_base = 0
        self._phase_base_sessions = (0, 0)
        self._proc: subprocess.Popen[bytes] | None = None
        self._reader: threading.Thread | None = None

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc else None

    @property
    def label(self) -> str:
        """The process monitor's label."""
        if self.kind == "smtp-sink":
            return "sink:smtp-sink"
        return "sink:asyncio sink" + (" (STARTTLS)" if self.tls else "")

    def describe(self) -> str:
        if self.kind == "smtp-sink":
            return "smtp-sink"
        return "asyncio sink" + (" offering STARTTLS" if self.tls else " (no STARTTLS)")

    def start(self) -> None:
        self.dump_root.mkdir(parents=True, exist_ok=True)
        cmd = self._asyncio_command() if self.kind == "asyncio" else self._smtp_sink_command()
        self._proc = self.procs.spawn(
            self.kind,
            cmd,
            stdout=subprocess.PIPE,
            stderr=self.log_dir / f"{self.kind}.err",
        )
        self._reader = threading.Thread(target=self._read_counters, daemon=True)
        self._reader.start()
        wait_port(self.port, 10, self._proc)

    def _asyncio_command(self) -> list[str]:
        cmd = [
            sys.executable,
            str(TLS_SINK),
            "--listen",
            f"127.0.0.1:{self.port}",
            "--dump",
            f"{self.dump_root}/cur",
            "--hostname",
            "sink.bench.local",
        ]
        return cmd + (["--starttls"] if self.tls else [])

    def _smtp_sink_command(self) -> list[str]:
        cmd = [
            SMTP_SINK,
            "-4",
            "-c",
            "-h",
            "sink.bench.local",
            "-d",
            f"{self.dump_root}/cur/%H%M%S.",
        ]
        if os.geteuid() == 0:
            # smtp-sink refuses to run as root; it drops to this user after bind.
            user = pwd.getpwnam("nobody")
            os.chown(self.dump_root, user.pw_uid, user.pw_gid)
            cmd += ["-u", "nobody"]
        return cmd + [f"127.0.0.1:{self.port}", "1024"]

    def _read_counters(self) -> None:
        assert self._proc and self._proc.stdout
        out = self._proc.stdout
        buf = b""
        while True:
            chunk = os.read(out.fileno(), 65536)
            if not chunk:
                return
            buf += chunk
            *records, buf = re.split(rb"[\r\n]", buf)
            for rec in reversed(records):
                m = re.search(rb"mesg=(\d+)", rec)
                if m:
                    sess = re.search(rb"sess=(\d+)", rec)
                    tls = re.search(rb"tls=(\d+)", rec)
                    self.sessions = int(sess.group(1)) if sess else self.sessions
                    self.tls_sessions = int(tls.group(1)) if tls else self.tls_sessions
                    value = int(m.group(1))
                    if value != self.count:
                        self.count = value
                        self.count_changed_at = time.time()
                    break

    def phase_count(self) -> int:
        """Messages received since the last ``rotate``."""
        return self.count - self._phase_base

    def phase_sessions(self) -> tuple[int, int]:
        """Connections and STARTTLS handshakes since the last ``rotate`` (as of the
        last message)."""
        base_sess, base_tls = self._phase_base_sessions
        return self.sessions - base_sess, self.tls_sessions - base_tls

    def wait_for(self, n: int, stall_timeout: float, progress: bool = True) -> bool:
        """Wait until ``n`` messages arrived in this phase, or nothing arrived for a while."""
        tty = sys.stdout.isatty()
        every = 1.0 if tty else 5.0
        end = "" if tty else "\n"
        cr = "\r" if tty else ""
        last_print = started = time.time()
        while True:
            got = self.phase_count()
            if got >= n:
                if progress:
                    print(f"{cr}    at the sink: {got}/{n}          ", flush=True)
                return True
            if self._proc is not None and self._proc.poll() is not None:
                raise RuntimeError(f"{self.kind} exited with {self._proc.returncode}")
            now = time.time()
            if now - max(self.count_changed_at, started) > stall_timeout:
                if progress:
                    print(
                        f"{cr}    at the sink: {got}/{n} - nothing arrived for "
                        f"{stall_timeout:.0f} s, giving up",
                        flush=True,
                    )
                return False
            if progress and now - last_print > every:
                print(f"{cr}    at the sink: {got}/{n}", end=end, flush=True)
                last_print = now
            time.sleep(0.02)

    def rotate(self, name: str) -> Path:
        """Move this phase's dump files aside (to ``name/``) and start counting afresh."""
        cur = self.dump_root / "cur"
        dest = self.dump_root / name
        if cur.exists():
            cur.rename(dest)
        else:
            dest.mkdir()
        self._phase_base = self.count
        self._phase_base_sessions = (self.sessions, self.tls_sessions)
        return dest

    @staticmethod
    def report(directory: Path) -> DumpReport:
        dumps = [parse_dump(p) for p in directory.iterdir() if p.is_file()]
        rep = DumpReport(
            files=len(dumps),
            first_mtime=min((d.mtime for d in dumps), default=None),
            last_mtime=max((d.mtime for d in dumps), default=None),
        )
        for d in dumps:
            if d.relay_id:
                rep.relay_ids[d.relay_id] += 1
            else:
                rep.without_id += 1
            if d.seq:
                rep.seqs[d.seq] += 1
            if d.tls:
                rep.tls += 1
                rep.tls_versions[d.tls] += 1
            rep.signed += d.signed
        return rep
