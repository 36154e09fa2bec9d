"""The database away and back, as the relay's processes live it (issue #25).

The outage is real for the processes: the test database stops taking new
connections (``ALTER DATABASE … ALLOW_CONNECTIONS false``) and every session
of theirs is terminated, as a primary that died or a failover in progress
does to them; then it takes connections again. The test's own session is
spared, so it can look and restore.

- ``runsmtp`` answers every message meanwhile ``451 4.3.0``, logs one line
  per 451 (no traceback), the outage once as it starts and once as it ends,
  and takes mail again without a restart;
- a worker whose task finds the database away waits for it and does the
  work once it is back (no beat runs here: nothing else would), instead of
  failing the task with a traceback.
"""

from __future__ import annotations

import contextlib
import re
import smtplib
import sys
import time
from collections.abc import Iterator

import psycopg
import pytest
from django.db import connection

from queues.models import Message, MessageState
from tests.support import processes
from tests.support.processes import ProcessRunner

pytestmark = [pytest.mark.system, pytest.mark.django_db(transaction=True)]


@contextlib.contextmanager
def database_away() -> Iterator[None]:
    """No new connection to the test database; every other session of it ended
    (from the server's ``postgres`` database: a database cannot lock itself out)."""
    db = connection.settings_dict
    with connection.cursor() as cur:
        cur.execute("SELECT pg_backend_pid()")
        mine = cur.fetchone()[0]
    admin = psycopg.connect(
        host=db["HOST"] or "127.0.0.1",
        port=db["PORT"] or 5432,
        user=db["USER"] or "postgres",
        password=db["PASSWORD"] or None,
        dbname="postgres",
        autocommit=True,
    )
    try:
        admin.execute(f'ALTER DATABASE "{db["NAME"]}" ALLOW_CONNECTIONS false')
        admin.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
            "WHERE datname = %s AND pid <> %s",
            (db["NAME"], mine),
        )
        yield
    finally:
        admin.execute(f'ALTER DATABASE "{db["NAME"]}" ALLOW_CONNECTIONS true')
        admin.close()


def start_runsmtp() -> tuple[processes.Proc, int]:
    env = processes.test_env(MAILRELAY_SMTP_LISTEN="127.0.0.1:0", MAILRELAY_HOSTNAME="relay.test")
    proc = processes.Proc("runsmtp", [sys.executable, "manage.py", "runsmtp"], env)
    proc.wait_for("listening on 127.0.0.1:")
    port = next(
        int(m.group(1))
        for line in proc.lines
        if (m := re.search(r"listening on 127\.0\.0\.1:(\d+)$", line))
    )
    return proc, port


def send(port: int, subject: str) -> tuple[int, str]:
    with smtplib.SMTP("127.0.0.1", port, timeout=20) as client:
        client.ehlo("client.test")
        client.mail("a@example.org")
        client.rcpt("b@example.net")
        code, text = client.data(f"Subject: {subject}\r\n\r\nbody\r\n".encode())
    return code, text.decode()


def lines(proc: processes.Proc, text: str) -> list[str]:
    return [line for line in proc.lines if text in line]


def test_ingress_answers_451_with_one_line_each_and_logs_the_outage_once() -> None:
    proc, port = start_runsmtp()
    try:
        assert send(port, "before")[0] == 250, "\n".join(proc.lines)
        with database_away():
            answers = [send(port, f"during {i}") for i in range(5)]
            assert all(code == 451 and text.startswith("4.3.0") for code, text in answers), answers
        assert send(port, "after")[0] == 250
        proc.wait_for("database available again")
    finally:
        proc.stop()
    assert len(lines(proc, "451 4.3.0 message from 127.0.0.1 not stored")) == 5, proc.lines
    assert len(lines(proc, "database unavailable")) == 1, proc.lines
    assert len(lines(proc, "database available again")) == 1, proc.lines
    assert not lines(proc, "Traceback"), "\n".join(proc.lines)
    stored = set(Message.objects.values_list("subject", flat=True))
    assert stored == {"before", "after"}


def test_a_task_that_finds_the_database_away_waits_and_then_does_its_work(
    processes: ProcessRunner,
) -> None:
    proc, port = start_runsmtp()
    try:
        # Stored and rung for while no worker runs: the categorize task waits in the broker.
        assert send(port, "waits")[0] == 250
    finally:
        proc.stop()
    message = Message.objects.get(subject="waits")
    assert message.state == MessageState.SUBMISSION
    with database_away():
        worker = processes.control_worker(concurrency=1)
        worker.wait_for("delivery.tasks.categorize")  # received: it runs and finds no database
        worker.wait_for("database unavailable")
        time.sleep(0.5)
    deadline = time.monotonic() + 20
    while Message.objects.get(pk=message.pk).state == MessageState.SUBMISSION:
        assert time.monotonic() < deadline, "\n".join(worker.lines[-40:])
        time.sleep(0.1)
    assert not lines(worker, "raised unexpected"), "\n".join(worker.lines)
    assert not lines(worker, "Traceback"), "\n".join(worker.lines)


@pytest.mark.django_db(transaction=True)
def test_a_task_starts_on_a_fresh_connection_when_the_one_it_inherits_is_broken() -> None:
    """Before each task (``task_prerun``, delivery.qmgr.tasks) a connection that
    broke or outlived CONN_MAX_AGE is closed, so the task opens a new one rather
    than failing on the dead one (a PostgreSQL restart between two tasks)."""
    from delivery.qmgr import tasks

    connection.ensure_connection()
    inherited = connection.connection
    connection.close_at = time.monotonic() - 1  # as if it were obsolete
    tasks.sweep.apply()
    assert connection.connection is not None
    assert connection.connection is not inherited
    # A connection in good order is kept.
    kept = connection.connection
    connection.close_at = None
    tasks.sweep.apply()
    assert connection.connection is kept
