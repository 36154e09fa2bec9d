"""The machine side of the multi-host fault bench (``multihost.py``): the host
users, their access to the interpreter, the iptables partition (always removed
on exit), and which user owns a socket or a process (/proc)."""

from __future__ import annotations

import atexit
import os
import pwd
import signal
import socket
import subprocess
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from tests.support.cluster import PYTHON, Proc

CHECKOUT = Path(__file__).resolve().parents[2]
RULE_TAG = "mailrelay-multihost"

# --- machine set-up: users, interpreter access, iptables ---------------------------------


@dataclass
class Host:
    key: str  # "a" / "b"
    user: str
    uid: int = 0
    gid: int = 0
    smtp_port: int = 0
    folder: Path = Path()
    procs: dict[str, Proc] = field(default_factory=dict)

    @property
    def node(self) -> str:
        return f"host-{self.key}"


def ensure_user(name: str) -> tuple[int, int]:
    try:
        pw = pwd.getpwnam(name)
    except KeyError:
        subprocess.run(["useradd", "-r", "-M", "-s", "/usr/sbin/nologin", name], check=True)
        pw = pwd.getpwnam(name)
    return pw.pw_uid, pw.pw_gid


_ACLS: list[tuple[Path, str]] = []  # (folder, user) given --x for this run


def grant_interpreter_access(users: Iterable[str]) -> None:
    """Let the host users reach the venv's interpreter: ``--x`` (ACL) on every
    folder above it that others cannot enter. Undone by ``revoke_access``."""
    real = Path(os.path.realpath(PYTHON))
    for folder in [*reversed(real.parents), CHECKOUT]:
        if folder.stat().st_mode & 0o001:
            continue
        for user in users:
            subprocess.run(["setfacl", "-m", f"u:{user}:x", str(folder)], check=True)
            _ACLS.append((folder, user))


def revoke_access() -> None:
    while _ACLS:
        folder, user = _ACLS.pop()
        subprocess.run(["setfacl", "-x", f"u:{user}", str(folder)], check=False)


_RULES: list[list[str]] = []  # iptables rule specs currently installed by us


def _rule(uid: int) -> list[str]:
    return ["OUTPUT", "-o", "lo", "-m", "owner", "--uid-owner", str(uid)] + [
        *("-m", "comment", "--comment", RULE_TAG, "-j", "DROP")
    ]


def partition_on(uid: int) -> None:
    spec = _rule(uid)
    _RULES.append(spec)  # first: a signal right after -A still deletes it
    subprocess.run(["iptables", "-A", *spec], check=True)


def remove_rules() -> None:
    while _RULES:
        spec = _RULES.pop()
        # -D until it is gone (a rule added twice is deleted twice).
        while subprocess.run(["iptables", "-D", *spec], capture_output=True).returncode == 0:
            pass


def leftover_rules() -> list[str]:
    out = subprocess.run(["iptables", "-S"], capture_output=True, text=True, check=False)
    return [line for line in out.stdout.splitlines() if RULE_TAG in line]


def _cleanup() -> None:
    remove_rules()
    revoke_access()


def install_cleanup() -> None:
    atexit.register(_cleanup)

    def on_signal(signum: int, _frame: object) -> None:
        _cleanup()
        raise SystemExit(128 + signum)

    for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):
        signal.signal(sig, on_signal)


# --- who owns a socket, a process --------------------------------------------------------


def _addr(hexaddr: str) -> tuple[str, int]:
    ip, port = hexaddr.split(":")
    return socket.inet_ntoa(bytes.fromhex(ip)[::-1]), int(port, 16)


def tcp_sockets() -> list[tuple[tuple[str, int], tuple[str, int], str, int]]:
    """(local, remote, state, uid) of every IPv4 TCP socket (/proc/net/tcp)."""
    out = []
    with open("/proc/net/tcp") as f:
        next(f)
        for line in f:
            p = line.split()
            out.append((_addr(p[1]), _addr(p[2]), p[3], int(p[7])))
    return out


def outbound_open(uid: int, peer: tuple[str, int]) -> int:
    """Established connections of ``uid``'s sockets to ``peer``."""
    return sum(1 for _, r, st, u in tcp_sockets() if u == uid and r == peer and st == "01")


def pid_uid(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("Uid:"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None
