"""README "Try it", as a newcomer on a machine with no internet follows it:
`manage.py demosink`, `make run` (runall, the embedded default: SQLite and the
filesystem broker) pointed at it with MAILRELAY_SMART_HOST, one message sent
over SMTP. It arrives at the sink, the Queue Viewer lists it delivered, the
tracking log has its life; the console warns once about a hostname of
`localhost` and repeats no warning (kombu's "No hostname was supplied")."""

from __future__ import annotations

import http.cookiejar
import os
import re
import signal
import smtplib
import subprocess
import sys
import threading
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.sinks import find_free_port
from tests.test_runall import ROOT, Runall

SENDER, RECIPIENT = "newcomer@example.org", "friend@example.net"


class Sink:
    """`manage.py demosink` in a process of its own; its console lines."""

    def __init__(self, port: int, env: dict[str, str]) -> None:
        self.lines: list[str] = []
        self.proc = subprocess.Popen(
            [sys.executable, "manage.py", "demosink", "--listen", f"127.0.0.1:{port}"],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line.rstrip())

    def wait_for(self, pattern: str, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while not any(re.search(pattern, line) for line in self.lines):
            assert time.monotonic() < deadline, f"demosink never printed {pattern!r}: {self.lines}"
            assert self.proc.poll() is None, f"demosink exited: {self.lines}"
            time.sleep(0.1)


@pytest.fixture
def quickstart(tmp_path) -> Iterator[tuple[Runall, Sink, int, dict[str, str]]]:
    sink_port, smtp, web = (find_free_port(["127.0.0.1"]) for _ in range(3))
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("DATABASE_URL", "CELERY_BROKER_URL", "MAILRELAY_TEST_DATABASE")
        and not k.startswith("PYTEST")
    }
    env.update(
        PYTHONUNBUFFERED="1",
        MAILRELAY_DATA_DIR=str(tmp_path / "var"),
        MAILRELAY_SMTP_LISTEN=f"127.0.0.1:{smtp}",
        MAILRELAY_WEB_LISTEN=f"127.0.0.1:{web}",
        MAILRELAY_SMART_HOST=f"[127.0.0.1]:{sink_port}",
        MAILRELAY_HOSTNAME="localhost",  # what a fresh machine often says its name is
        MAILRELAY_WORKER_CONCURRENCY="1",
        MAILRELAY_DELIVERY_CONCURRENCY="2",
    )
    sink = Sink(sink_port, env)
    run = Runall(env)
    try:
        sink.wait_for(r"^demosink: listening on \[127\.0\.0\.1\]:", timeout=30)
        yield run, sink, web, env
    finally:
        for proc in (run.proc, sink.proc):
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
                try:
                    proc.wait(30)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
                    raise


def _send(port: int, timeout: float = 60) -> None:
    message = f"From: {SENDER}\r\nTo: {RECIPIENT}\r\nSubject: my first message\r\n\r\nHello.\r\n"
    deadline = time.monotonic() + timeout
    while True:
        try:
            with smtplib.SMTP("127.0.0.1", port, timeout=10) as client:
                client.sendmail(SENDER, [RECIPIENT], message)
            return
        except OSError:
            assert time.monotonic() < deadline, "the ingress never answered"
            time.sleep(0.2)


def _queue_viewer_messages(web: int, data_dir: Path) -> str:
    """/messages/ as the admin `make run` created (its password is in the data folder)."""
    base = f"http://127.0.0.1:{web}"
    jar = http.cookiejar.CookieJar()
    opener = urllib.request.build_opener(urllib.request.HTTPCookieProcessor(jar))
    login = opener.open(f"{base}/accounts/login/", timeout=10).read().decode()
    token = re.search(r'name="csrfmiddlewaretoken" value="([^"]+)"', login)[1]
    form = {
        "csrfmiddlewaretoken": token,
        "username": "admin",
        "password": (data_dir / "admin-password.txt").read_text().strip(),
    }
    request = urllib.request.Request(
        f"{base}/accounts/login/",
        data=urllib.parse.urlencode(form).encode(),
        headers={"Referer": f"{base}/accounts/login/"},
    )
    opener.open(request, timeout=10).read()
    return opener.open(f"{base}/messages/", timeout=10).read().decode()


def test_a_newcomers_first_message_arrives_and_is_seen(quickstart):
    run, sink, web, env = quickstart
    run.wait_for(r"^beat: started")
    _send(int(env["MAILRELAY_SMTP_LISTEN"].rsplit(":", 1)[1]))
    sink.wait_for(rf"^demosink: message 1 from 127\.0\.0\.1: MAIL FROM:<{SENDER}>", timeout=60)
    assert "  Subject: my first message" in sink.lines
    deadline = time.monotonic() + 30
    while True:  # the delivery is recorded just after the sink's 250
        track = subprocess.run(
            [sys.executable, "manage.py", "track", "--recipient", RECIPIENT],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        if " delivered " in track or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    events = [line.split()[3] for line in track.splitlines()]
    assert events == ["delivered", "routed", "received"], track
    assert "remote_id=DEMO1" in track
    page = _queue_viewer_messages(web, Path(env["MAILRELAY_DATA_DIR"]))
    assert RECIPIENT in page and "my first message" in page
    assert re.search(r'class="badge delivered"', page), page
    console = run.output() + "\n".join(run.lines)
    assert "No hostname was supplied" not in "\n".join(run.lines)
    warnings = [line for line in run.lines if "our hostname 'localhost' is localhost" in line]
    assert len(warnings) == 1, warnings
    assert run.proc.poll() is None, console


@pytest.mark.parametrize(
    ("name", "warned"),
    [
        ("localhost", "is localhost"),
        ("LOCALHOST.localdomain.", "is localhost"),
        ("mailhost", "has no dot"),
        ("relay.example.com", None),
    ],
)
def test_a_hostname_receivers_refuse_is_named_in_a_warning(name, warned):
    from delivery.hostname import hostname_warning

    warning = hostname_warning(name)
    if warned is None:
        assert warning is None
    else:
        assert f"our hostname {name!r} {warned}" in warning and "MAILRELAY_HOSTNAME" in warning
