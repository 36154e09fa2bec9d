"""`runsmtp --processes N`: N server processes on one port (SO_REUSEPORT) under a supervisor."""

from __future__ import annotations

import os
import re
import signal
import smtplib
import socket
import sys

import psutil
import pytest

from delivery.management.commands.runsmtp import share
from queues.models import Message
from tests.support import processes

pytestmark = pytest.mark.django_db(transaction=True)


def start(count: int = 2, prefix: tuple[str, ...] = ()) -> tuple[processes.Proc, int]:
    proc = processes.Proc(
        "runsmtp",
        [*prefix, sys.executable, "manage.py", "runsmtp", "--processes", str(count)],
        processes.test_env(MAILRELAY_SMTP_LISTEN="127.0.0.1:0", MAILRELAY_HOSTNAME="relay.test"),
    )
    proc.wait_for_count("smtp: listening on 127.0.0.1:", count)
    ports = {
        int(m.group(1))
        for line in proc.lines
        if (m := re.search(r"listening on 127.0.0.1:(\d+)$", line))
    }
    assert len(ports) == 1, proc.lines  # every process on the same port
    return proc, ports.pop()


def children(proc: processes.Proc) -> list[psutil.Process]:
    return psutil.Process(proc.popen.pid).children()


def owner_of(client: socket.socket, pids: list[int]) -> int | None:
    """The process holding the server side of this client's connection."""
    mine = client.getsockname()
    for pid in pids:
        for conn in psutil.Process(pid).net_connections(kind="tcp"):
            if conn.raddr and (conn.raddr.ip, conn.raddr.port) == mine:
                return pid
    return None


def send(port: int, subject: str) -> int:
    with smtplib.SMTP("127.0.0.1", port, timeout=10) as client:
        client.ehlo("client.test")
        client.mail("a@example.org")
        client.rcpt("b@example.net")
        code, _text = client.data(f"Subject: {subject}\r\n\r\nbody\r\n".encode())
    return code


def test_two_processes_accept_on_one_port_and_one_killed_leaves_the_other_serving():
    proc, port = start(2)
    try:
        pids = [p.pid for p in children(proc)]
        assert len(pids) == 2
        # Connections are spread over both processes (the kernel hashes each one).
        clients = []
        owners = set()
        for _ in range(24):
            client = socket.create_connection(("127.0.0.1", port), timeout=10)
            assert client.recv(512).startswith(b"220 ")  # greeted: accepted by a process
            clients.append(client)
            owners.add(owner_of(client, pids))
        for client in clients:
            client.close()
        assert owners == set(pids)
        assert send(port, "both") == 250

        os.kill(pids[0], signal.SIGKILL)
        # Gone (its listening socket closed with it) once the supervisor has reaped it.
        proc.wait_for("exited with signal SIGKILL; restarting in 1s")
        assert psutil.Process(pids[1]).is_running()  # the other one is still there
        for i in range(10):  # every new connection goes to the survivor
            assert send(port, f"after kill {i}") == 250
        assert Message.objects.filter(subject__startswith="after kill").count() == 10
        # The supervisor starts a new one in its place.
        proc.wait_for_count("smtp: listening on 127.0.0.1:", 3)
        assert len(children(proc)) == 2

        proc.stop()  # SIGTERM to the group: all stop gracefully
        assert proc.popen.returncode == 0, proc.lines
        proc.wait_for("smtp: stopped")
    finally:
        proc.kill()


def test_the_processes_die_with_a_supervisor_killed_with_9():
    proc, port = start(2)
    try:
        kids = children(proc)
        os.kill(proc.popen.pid, signal.SIGKILL)  # the supervisor only, not its group
        gone, alive = psutil.wait_procs(kids, timeout=10)
        assert not alive
        with pytest.raises(OSError):
            socket.create_connection(("127.0.0.1", port), timeout=2)
    finally:
        proc.kill()


def test_a_supervisor_that_is_pid_1_keeps_its_children_as_in_a_container():
    """docker-compose runs `manage.py runsmtp` as the container's pid 1: its
    children have parent 1 from the start and must not take that for an
    orphaned child. A new pid namespace (unshare, as root) makes it pid 1 here."""
    proc, port = start(2, prefix=("unshare", "--fork", "--pid", "--kill-child"))
    try:
        assert send(port, "under pid 1") == 250
        assert not any("supervising runsmtp is gone" in line for line in proc.lines)
    finally:
        proc.kill()


def test_the_connection_limits_are_shared_between_the_processes():
    assert share(1000, 2) == 500
    assert share(50, 3) == 16  # rounded down: together never past the configured total
    assert share(1, 2) == 1  # but each process takes at least one
    assert share(0, 4) == 0  # no limit stays no limit
