"""The whole relay with real processes: SMTP in, Celery workers over Redis, sinks out.

These start real `celery worker` / `celery beat` processes against the test
database and the test Redis database, as production runs them.
"""

from __future__ import annotations

import os
import signal
import smtplib
import subprocess
import sys
import threading
import time
import urllib.request
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import pytest
from django.db import close_old_connections

from queues.models import Message, MessageState, Recipient, RecipientState
from tests.support.sinks import find_free_port

pytestmark = [pytest.mark.system, pytest.mark.django_db(transaction=True)]

ROOT = Path(__file__).resolve().parents[1]


def wait_until(predicate: Callable[[], bool], timeout: float = 30, what: str = "") -> None:
    """Poll the database (no event to await there) until ``predicate`` holds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        close_old_connections()
        if predicate():
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what or predicate}")


def body(n: int, size: int = 2048) -> bytes:
    head = (
        f"From: sender@example.org\r\nTo: rcpt@example.net\r\nSubject: system {n}\r\n"
        f"Message-ID: <system-{n}@example.org>\r\n\r\n"
    ).encode()
    line = b"0123456789abcdefghijklmnopqrstuvwxyz0123456789abcdefghijklmnopqrstuvwxyz\r\n"
    return head + line * max(1, (size - len(head)) // len(line))


@pytest.fixture
def relay_env(settings, sink_factory, smtp_port):
    """A smart host on 127.0.0.2 for the in-process ingress and the child workers."""
    sink = sink_factory("127.0.0.2")
    smart_host = f"[127.0.0.2]:{smtp_port}"
    settings.MAILRELAY_SMART_HOST = smart_host
    env = {"MAILRELAY_SMART_HOST": smart_host, "MAILRELAY_SWEEP_INTERVAL": "1s"}
    return sink, env


def test_it_relays_from_smtp_through_celery_to_the_sink_byte_exact(relay_env, ingress, processes):
    sink, env = relay_env
    processes.worker("w1", **env)
    replies = [ingress.send(body(i), rcpt_to=[f"u{i}@example.net"]) for i in range(3)]
    assert all(code == 250 for code, _ in replies)
    assert sink.wait_for(3, timeout=30)
    wait_until(lambda: Message.objects.filter(state=MessageState.DONE).count() == 3, what="done")
    for received in sink.messages:
        stored = Message.objects.get(recipients__address=received.rcpt_tos[0])
        assert received.data == bytes(stored.data)
        assert received.data.endswith(body(int(received.rcpt_tos[0][1])))
    assert sorted(text.rsplit(" ", 1)[1] for _, text in replies) == sorted(
        Message.objects.values_list("qid", flat=True)
    )


def test_a_worker_killed_mid_delivery_does_not_lose_the_message(
    settings, sink_factory, smtp_port, start_ingress, processes, tmp_path
):
    sink = sink_factory("127.0.0.3", delays={"DATA": 2.0})
    settings.MAILRELAY_SMART_HOST = f"[127.0.0.3]:{smtp_port}"
    ingress = start_ingress()
    env = {
        "MAILRELAY_SMART_HOST": settings.MAILRELAY_SMART_HOST,
        "MAILRELAY_SWEEP_INTERVAL": "1s",
        "MAILRELAY_DELIVERY_LEASE": "3s",
    }
    first = processes.worker("w1", **env)
    code, _ = ingress.send(body(1), rcpt_to=["u1@example.net"])
    assert code == 250
    assert sink.wait_until(lambda: "DATA" in sink.verbs(), timeout=30)
    first.kill()  # SIGKILL while the peer has not answered the end of data
    assert Recipient.objects.get().state == RecipientState.ACTIVE
    processes.worker("w2", **env)
    processes.beat(tmp_path, **env)
    wait_until(
        lambda: Recipient.objects.get().state == RecipientState.DELIVERED,
        timeout=60,
        what="delivery after the lease ran out",
    )
    assert len(sink.messages) >= 1  # at-least-once: the first copy may have landed too
    assert all(m.data.endswith(body(1)) for m in sink.messages)


def test_the_sweep_delivers_after_the_broker_was_flushed(
    relay_env, ingress, processes, broker, tmp_path
):
    sink, env = relay_env
    for i in range(5):
        assert ingress.send(body(i), rcpt_to=[f"u{i}@example.net"])[0] == 250
    assert broker.dbsize() > 0  # the doorbells are waiting in Redis...
    broker.flushdb()  # ...and are lost
    processes.worker("w1", **env)
    processes.beat(tmp_path, **env)
    assert sink.wait_for(5, timeout=60)
    wait_until(lambda: Message.objects.filter(state=MessageState.DONE).count() == 5, what="done")


def test_two_workers_deliver_a_thousand_messages_exactly_once(relay_env, ingress, processes):
    sink, env = relay_env
    processes.worker("w1", concurrency=2, **env)
    processes.worker("w2", concurrency=2, **env)
    total, sessions = 1000, 10
    errors: list[str] = []

    def client(start: int) -> None:
        try:
            with smtplib.SMTP(ingress.host, ingress.port, timeout=30) as smtp:
                for i in range(start, total, sessions):
                    smtp.sendmail("sender@example.org", [f"u{i}@example.net"], body(i, 1024))
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(repr(exc))

    threads = [threading.Thread(target=client, args=(s,)) for s in range(sessions)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors
    assert sink.wait_for(total, timeout=180)
    wait_until(
        lambda: Message.objects.filter(state=MessageState.DONE).count() == total,
        timeout=60,
        what="all done",
    )
    ids = Counter(m.data.split(b"Message-ID: ")[1].split(b"\r\n")[0] for m in sink.messages)
    assert len(ids) == total
    assert max(ids.values()) == 1  # exactly once
    assert Recipient.objects.filter(state=RecipientState.DELIVERED).count() == total


@pytest.mark.django_db(transaction=False)
def test_make_run_starts_everything_on_the_embedded_default(tmp_path, sink_factory, smtp_port):
    """`manage.py runall` with no DATABASE_URL / CELERY_BROKER_URL: SQLite + filesystem broker."""
    sink = sink_factory("127.0.0.2")
    smtp, web = find_free_port(["127.0.0.1"]), find_free_port(["127.0.0.1"])
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("DATABASE_URL", "CELERY_BROKER_URL", "MAILRELAY_TEST_DATABASE")
        and not k.startswith("PYTEST")
    }
    env.update(
        MAILRELAY_DATA_DIR=str(tmp_path / "var"),
        MAILRELAY_SMTP_LISTEN=f"127.0.0.1:{smtp}",
        MAILRELAY_WEB_LISTEN=f"127.0.0.1:{web}",
        MAILRELAY_SMART_HOST=f"[127.0.0.2]:{smtp_port}",
        MAILRELAY_WORKER_CONCURRENCY="2",
    )
    proc = subprocess.Popen(
        [sys.executable, "manage.py", "runall"],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    output: list[str] = []
    reader = threading.Thread(target=lambda: output.extend(proc.stdout or []), daemon=True)
    reader.start()
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                with smtplib.SMTP("127.0.0.1", smtp, timeout=10) as client:
                    client.sendmail("sender@example.org", ["u@example.net"], body(7))
                break
            except OSError:
                assert proc.poll() is None, "".join(output)
                assert time.monotonic() < deadline, "".join(output)
                time.sleep(0.2)
        assert sink.wait_for(1, timeout=60), "".join(output)
        assert sink.messages[0].data.endswith(body(7))
        with urllib.request.urlopen(f"http://127.0.0.1:{web}/healthz", timeout=10) as resp:
            assert resp.status == 200
        with urllib.request.urlopen(f"http://127.0.0.1:{web}/admin/login/", timeout=10) as resp:
            assert resp.status == 200
        # /metrics on the web process sums the counters of the ingress process too
        with urllib.request.urlopen(f"http://127.0.0.1:{web}/metrics", timeout=10) as resp:
            scraped = resp.read().decode()
        assert 'mailrelay_messages_accepted_total{source="smtp"} 1.0' in scraped
        assert "mailrelay_metrics_multiprocess 1.0" in scraped
        assert (tmp_path / "var" / "mailrelay.sqlite3").exists()
        assert (tmp_path / "var" / "admin-password.txt").exists()
    finally:
        os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            raise
    reader.join(5)
    text = "".join(output)
    assert "admin: created user 'admin'" in text
    assert "stopped" in text
