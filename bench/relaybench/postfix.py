"""A private Postfix instance: the reference relay.

Everything lives in one temporary directory (``etc/`` = config_directory,
``spool/`` = queue_directory, ``data/`` = data_directory, ``maillog``); it
listens on 127.0.0.1:<port> only (an smtpd entry in its own master.cf),
relays everything to ``relayhost = [127.0.0.1]:<sink port>``, trusts
``mynetworks = 127.0.0.0/8`` and delivers nothing locally. Otherwise it runs
with Postfix's defaults (queue files are fsync'ed, connection caching on
demand, 20 parallel deliveries per destination), except:

- ``enable_long_queue_ids = yes`` so that queue ids (used to prove
  exactly-once delivery at the sink) never repeat within a run;
- ``chroot = n`` in master.cf (a chroot jail needs copies of system files;
  it does not change the work done per message).

It is started with ``postfix -c DIR start`` (as root: master drops to the
``postfix`` user) and stopped with ``postfix -c DIR stop`` (then ``abort``,
then the master's pid is killed if it still runs).
"""

from __future__ import annotations

import contextlib
import os
import pwd
import shutil
import time
from pathlib import Path

import psutil

from .util import run_with_tty, wait_port

POSTFIX = "/usr/sbin/postfix"

MASTER_CF = """\
# service type  private unpriv  chroot  wakeup  maxproc command + args
127.0.0.1:{port} inet n - n - - smtpd
cleanup   unix  n       -       n       -       0       cleanup
qmgr      unix  n       -       n       300     1       qmgr
rewrite   unix  -       -       n       -       -       trivial-rewrite
bounce    unix  -       -       n       -       0       bounce
defer     unix  -       -       n       -       0       bounce
trace     unix  -       -       n       -       0       bounce
verify    unix  -       -       n       -       1       verify
flush     unix  n       -       n       1000?   0       flush
proxymap  unix  -       -       n       -       -       proxymap
proxywrite unix -       -       n       -       1       proxymap
smtp      unix  -       -       n       -       -       smtp
relay     unix  -       -       n       -       -       smtp
showq     unix  n       -       n       -       -       showq
error     unix  -       -       n       -       -       error
retry     unix  -       -       n       -       -       error
discard   unix  -       -       n       -       -       discard
anvil     unix  -       -       n       -       1       anvil
scache    unix  -       -       n       -       1       scache
postlog   unix-dgram n  -       n       -       1       postlogd
# the TLS session cache and PRNG; without it smtp disables TLS (--sink-tls)
tlsmgr    unix  -       -       n       1000?   1       tlsmgr
"""

MAIN_CF = """\
compatibility_level = 3.6
queue_directory = {base}/spool
data_directory = {base}/data
mail_owner = postfix
setgid_group = postdrop
myhostname = postfix.bench.local
mydomain = bench.local
myorigin = $myhostname
mydestination =
inet_interfaces = 127.0.0.1
inet_protocols = ipv4
mynetworks = 127.0.0.0/8
relayhost = [127.0.0.1]:{sink_port}
smtpd_relay_restrictions = permit_mynetworks, reject
local_recipient_maps =
local_transport = error:5.1.1 no local delivery here
alias_maps =
alias_database =
smtp_tls_security_level = {smtp_tls}
smtpd_tls_security_level = none
enable_long_queue_ids = yes
maillog_file = {base}/maillog
maillog_file_prefixes = {base}
biff = no
append_dot_mydomain = no
"""

QUEUE_DIRS = ("maildrop", "incoming", "active", "deferred", "hold")


def version() -> str:
    status, out = run_with_tty(["/usr/sbin/postconf", "-h", "mail_version"])
    return out.strip() if status == 0 else "?"


def system_postfix_running() -> bool:
    """Is the machine's own (default-instance) Postfix running?"""
    status, _ = run_with_tty([POSTFIX, "status"])
    return status == 0


class PostfixInstance:
    def __init__(self, base: Path, port: int, sink_port: int, smtp_tls: str = "none") -> None:
        """``smtp_tls``: smtp_tls_security_level, "may" when the sink offers STARTTLS."""
        self.base = base
        self.smtp_tls = smtp_tls
        self.etc = base / "etc"
        self.spool = base / "spool"
        self.port = port
        self.sink_port = sink_port
        self.started = False

    def _postfix(self, *args: str, check: bool = True) -> str:
        status, out = run_with_tty([POSTFIX, "-c", str(self.etc), *args])
        if check and status != 0:
            raise RuntimeError(f"postfix {' '.join(args)} failed ({status}):\n{out}")
        return out

    def setup(self) -> None:
        if os.geteuid() != 0:
            raise RuntimeError(
                "the Postfix reference needs root (postfix start); use --skip-postfix"
            )
        for d in (self.etc, self.spool, self.base / "data"):
            d.mkdir(parents=True, exist_ok=True)
        self.base.chmod(0o755)
        pf = pwd.getpwnam("postfix")
        os.chown(self.base / "data", pf.pw_uid, pf.pw_gid)
        (self.base / "data").chmod(0o700)
        (self.etc / "main.cf").write_text(
            MAIN_CF.format(base=self.base, sink_port=self.sink_port, smtp_tls=self.smtp_tls)
        )
        (self.etc / "master.cf").write_text(MASTER_CF.format(port=self.port))
        # Creates the queue's subdirectories with the right owners, checks the config.
        self._postfix("check")

    def start(self) -> None:
        self._postfix("start")
        self.started = True
        wait_port(self.port, 20)

    def master_pid(self) -> int | None:
        try:
            return int((self.spool / "pid" / "master.pid").read_text().split()[0])
        except (OSError, ValueError, IndexError):
            return None

    def queued(self) -> int:
        """Messages still in the queue (any state)."""
        n = 0
        for name in QUEUE_DIRS:
            for _, _, files in os.walk(self.spool / name):
                n += len(files)
        return n

    def wait_empty(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.queued() == 0:
                return True
            time.sleep(0.1)
        return self.queued() == 0

    def delivered_lines(self) -> int:
        """``status=sent`` lines in the maillog so far."""
        try:
            with open(self.base / "maillog", "rb") as fh:
                return sum(1 for line in fh if b" status=sent " in line)
        except OSError:
            return 0

    def stop(self) -> None:
        if not self.started:
            return
        pid = self.master_pid()
        master: psutil.Process | None = None
        if pid:
            with contextlib.suppress(psutil.Error):
                master = psutil.Process(pid)
        try:
            self._postfix("stop", check=False)
            if master is not None:
                with contextlib.suppress(psutil.Error):
                    master.wait(20)
        finally:
            if master is not None and master.is_running():
                self._postfix("abort", check=False)
                with contextlib.suppress(psutil.Error):
                    master.wait(5)
                if master.is_running():
                    for p in [*master.children(recursive=True), master]:
                        with contextlib.suppress(psutil.Error):
                            p.kill()
            self.started = False

    def labels(self) -> dict[int, str]:
        """Processes of this instance by name, for the monitor."""
        pid = self.master_pid()
        out: dict[int, str] = {}
        if pid is None:
            return out
        try:
            master = psutil.Process(pid)
            procs = [master, *master.children(recursive=True)]
        except psutil.Error:
            return out
        for p in procs:
            with contextlib.suppress(psutil.Error):
                out[p.pid] = f"postfix:{p.name()}"
        return out

    def remove(self) -> None:
        shutil.rmtree(self.base, ignore_errors=True)
