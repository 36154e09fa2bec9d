"""Isolation: silent next hops never delay routing or other destinations.

Real processes as `make run` starts them: a prefork worker for the `control`
queue (categorize, sweep) and a worker with a pool of threads for the
`delivery` queue. Several next hops accept TCP and never greet; each holds
its deliveries for the default connect and greeting timeouts (30 s, 5 min),
while a message to a healthy domain is routed and delivered in seconds.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator

import pytest

from queues.models import Recipient, RecipientState
from tests.support.sinks import find_free_port
from tests.test_system import body, wait_until

pytestmark = [pytest.mark.system, pytest.mark.django_db(transaction=True)]

SILENT_HOSTS = ("127.0.0.4", "127.0.0.5", "127.0.0.6", "127.0.0.7")


class SilentHop:
    """A real listening socket that accepts connections and never says a word."""

    def __init__(self, host: str) -> None:
        self.port = find_free_port([host])
        self.listener = socket.create_server((host, self.port))
        self.listener.settimeout(0.1)
        self.held: list[socket.socket] = []
        self._cond = threading.Condition()
        self._closed = False
        self._thread = threading.Thread(target=self._accept, name=f"silent {host}", daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        while not self._closed:
            try:
                conn, _ = self.listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            with self._cond:
                self.held.append(conn)
                self._cond.notify_all()

    def wait_for_connection(self, timeout: float) -> bool:
        with self._cond:
            return self._cond.wait_for(lambda: self.held, timeout)

    def close(self) -> None:
        """Hang up on every held connection, so the stuck deliveries end now."""
        self._closed = True
        self._thread.join(5)
        self.listener.close()
        with self._cond:
            for conn in self.held:
                conn.close()


@pytest.fixture
def silent_hops() -> Iterator[list[SilentHop]]:
    hops = [SilentHop(host) for host in SILENT_HOSTS]
    yield hops
    for hop in hops:
        hop.close()


def test_silent_next_hops_do_not_delay_a_healthy_domain(
    settings, processes, silent_hops, sink_factory, smtp_port, start_ingress
):
    # `processes` is requested before `silent_hops`, so the hops hang up first at
    # teardown and the workers stop without waiting out the greeting timeout.
    sink = sink_factory("127.0.0.2")
    routes = [
        f"silent{i}.test=[{hop.listener.getsockname()[0]}]:{hop.port}"
        for i, hop in enumerate(silent_hops)
    ]
    transports = ",".join([*routes, f"healthy.test=[127.0.0.2]:{smtp_port}"])
    settings.MAILRELAY_TRANSPORTS = transports
    ingress = start_ingress()
    env = {"MAILRELAY_TRANSPORTS": transports}  # default connect and greeting timeouts
    processes.control_worker(**env)
    processes.delivery_worker(**env)

    for i in range(len(silent_hops)):
        for n in range(3):
            code, _ = ingress.send(body(n), rcpt_to=[f"u{n}@silent{i}.test"])
            assert code == 250
    for hop in silent_hops:
        assert hop.wait_for_connection(timeout=30), "a silent hop was never tried:\n" + "\n".join(
            line for proc in processes.procs for line in proc.lines[-30:]
        )

    started = time.monotonic()
    code, _ = ingress.send(body(99), rcpt_to=["someone@healthy.test"])
    assert code == 250
    assert sink.wait_for(1, timeout=10), "the healthy domain waited behind the silent hops"
    elapsed = time.monotonic() - started
    assert sink.messages[0].data.endswith(body(99))
    wait_until(
        lambda: (
            Recipient.objects.get(address="someone@healthy.test").state == RecipientState.DELIVERED
        ),
        timeout=10,
        what="the healthy recipient recorded as delivered",
    )
    # ...while every silent hop still holds a delivery in its greeting wait.
    held = Recipient.objects.filter(address__contains="@silent", state=RecipientState.ACTIVE)
    assert {r.address.rpartition("@")[2] for r in held} == {
        f"silent{i}.test" for i in range(len(silent_hops))
    }
    print(f"healthy domain delivered {elapsed:.2f}s after accept")
