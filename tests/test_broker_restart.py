"""A Redis restart must not kill the workers: they reconnect and mail flows again.

Everything runs as real processes against a PRIVATE redis-server on a free
port (the shared Redis is never touched): `runsmtp`, the control and
delivery workers and beat, as `make run` starts them. Redis is killed with
SIGKILL and started again on the same port.
"""

from __future__ import annotations

import re
import shutil
import smtplib
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from queues.models import Message, MessageState
from tests.support import processes as procs
from tests.support.sinks import find_free_port
from tests.test_system import body

pytestmark = [pytest.mark.system, pytest.mark.django_db(transaction=True)]

REDIS_SERVER = shutil.which("redis-server") or "/usr/bin/redis-server"


class PrivateRedis:
    """A redis-server of this test's own, on a port of its own, without persistence."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.port = find_free_port(["127.0.0.1"])
        self.proc: subprocess.Popen | None = None
        self.url = f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        self.proc = subprocess.Popen(
            [
                REDIS_SERVER,
                *("--port", str(self.port), "--bind", "127.0.0.1"),
                *("--save", "", "--appendonly", "no", "--dir", str(self.folder)),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        client = redis.Redis.from_url(self.url, socket_connect_timeout=0.2)
        deadline = time.monotonic() + 10
        while True:
            try:
                client.ping()
                return
            except redis.ConnectionError:
                assert self.proc.poll() is None, "redis-server exited"
                assert time.monotonic() < deadline, "redis-server did not answer"
                time.sleep(0.05)

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)


@pytest.fixture
def private_redis(tmp_path: Path) -> Iterator[PrivateRedis]:
    if not Path(REDIS_SERVER).exists():
        # Not a skip: the test is part of the suite (.ci/run needs redis-server anyway).
        pytest.fail(f"no {REDIS_SERVER}: install Debian's redis-server")
    server = PrivateRedis(tmp_path)
    server.start()
    yield server
    server.kill()


def _send(port: int, n: int) -> None:
    with smtplib.SMTP("127.0.0.1", port, timeout=10) as client:
        client.sendmail("sender@example.org", [f"u{n}@example.net"], body(n))


def test_the_workers_survive_a_redis_restart_and_mail_flows_again(
    processes, private_redis, sink_factory, smtp_port, tmp_path
):
    # The peer takes 2 s over the final dot, so a delivery task is in flight
    # (received, not yet acknowledged) when Redis dies: the case that killed
    # the worker with celery 5.7.0.
    sink = sink_factory("127.0.0.2", delays={"DATA": 2.0})
    env = {
        "CELERY_BROKER_URL": private_redis.url,
        "MAILRELAY_SMART_HOST": f"[127.0.0.2]:{smtp_port}",
    }
    control = processes.control_worker(**env)
    delivery = processes.delivery_worker(concurrency=4, **env)
    beat = processes.beat(tmp_path, **env)
    smtp = procs.Proc(
        "runsmtp",
        [sys.executable, "manage.py", "runsmtp"],
        procs.test_env(MAILRELAY_SMTP_LISTEN="127.0.0.1:0", **env),
    )
    processes.procs.append(smtp)
    smtp.wait_for("smtp: listening on 127.0.0.1:")
    port = next(
        int(m.group(1))
        for line in smtp.lines
        if (m := re.search(r"listening on 127\.0\.0\.1:(\d+)$", line))
    )

    _send(port, 1)
    assert sink.wait_until(lambda: "DATA" in sink.verbs(), timeout=30)

    private_redis.kill()
    for worker in (control, delivery):
        worker.wait_for("Connection to broker lost", timeout=30)
    private_redis.start()  # same port, empty: the doorbells in flight are gone
    for worker in (control, delivery):
        worker.wait_for_count("Connected to redis://", 2, timeout=60)

    assert sink.wait_for(1, timeout=30)  # the round in flight finished
    _send(port, 2)
    assert sink.wait_until(
        lambda: any(m.data.endswith(body(2)) for m in sink.messages), timeout=30
    ), "\n".join(delivery.lines[-40:])
    for proc in (control, delivery, beat, smtp):
        assert proc.popen.poll() is None, f"{proc.name} died:\n" + "\n".join(proc.lines[-40:])
    for proc in (control, delivery):
        assert not [line for line in proc.lines if "Unrecoverable error" in line]


def _sentinel(folder: Path, master_port: int) -> tuple[subprocess.Popen, int]:
    """A Redis Sentinel (``redis-server --sentinel``) watching the master on ``master_port``."""
    port = find_free_port(["127.0.0.1"])
    conf = folder / "sentinel.conf"
    conf.write_text(
        f"port {port}\nbind 127.0.0.1\ndir {folder}\n"
        f"sentinel monitor relaymaster 127.0.0.1 {master_port} 1\n"
    )
    proc = subprocess.Popen(
        [REDIS_SERVER, str(conf), "--sentinel"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    client = redis.Redis(host="127.0.0.1", port=port, socket_connect_timeout=0.2)
    deadline = time.monotonic() + 10
    while True:
        try:
            if client.execute_command("SENTINEL", "get-master-addr-by-name", "relaymaster"):
                return proc, port
        except redis.ConnectionError:
            assert proc.poll() is None, "redis-server --sentinel exited"
        assert time.monotonic() < deadline, "the sentinel does not know the master"
        time.sleep(0.05)


def test_a_sentinel_broker_url_carries_the_doorbells(processes, private_redis, tmp_path):
    """CELERY_BROKER_URL=sentinel://… with MAILRELAY_BROKER_SENTINEL_MASTER: ingress
    rings through the master the sentinel names and a worker routes the message."""
    sentinel, port = _sentinel(tmp_path, private_redis.port)
    try:
        env = {
            "CELERY_BROKER_URL": f"sentinel://127.0.0.1:{port}/0",
            "MAILRELAY_BROKER_SENTINEL_MASTER": "relaymaster",
        }
        processes.control_worker(**env)
        smtp = procs.Proc(
            "runsmtp",
            [sys.executable, "manage.py", "runsmtp"],
            procs.test_env(MAILRELAY_SMTP_LISTEN="127.0.0.1:0", **env),
        )
        processes.procs.append(smtp)
        smtp.wait_for("smtp: listening on 127.0.0.1:")
        smtp_port = next(
            int(m.group(1))
            for line in smtp.lines
            if (m := re.search(r"listening on 127\.0\.0\.1:(\d+)$", line))
        )
        _send(smtp_port, 1)
        deadline = time.monotonic() + 30
        # No beat runs: only the doorbell, through the sentinel's master, starts routing.
        # (its routing may add a bounce: the message sent is the first one)
        while Message.objects.order_by("id").first().state == MessageState.SUBMISSION:
            assert time.monotonic() < deadline, "\n".join(smtp.lines[-20:])
            time.sleep(0.1)
    finally:
        # The workers stop while their broker still answers (without it a warm
        # shutdown waits out its grace); then the sentinel goes.
        processes.stop_all()
        sentinel.kill()
        sentinel.wait(10)
