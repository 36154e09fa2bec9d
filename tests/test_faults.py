"""The fault matrix at the DEFAULT lease and sweep settings, on a whole relay.

Each test starts the relay as an operator does (``tests/support/cluster.py``:
private PostgreSQL and Redis, ``runsmtp``, the workers and beat exactly as
``make run`` starts them, no MAILRELAY_DELIVERY_LEASE or SWEEP_INTERVAL
override) with a sink that takes 70 ms per message, so a fault lands in the
middle of delivery rounds. The fault hits while mail streams in; then:

- every message that got ``250`` arrives at the sink within 90 s of the fault;
- no message arrives more than twice, and only a message that a delivery
  round held (``active``) when the fault hit may arrive twice.

``FAULTS_ROOT=/path/to/tree`` runs the same tests against another source tree
(e.g. an older commit extracted with ``git archive``), with this checkout's
virtualenv; ``FAULTS_KEEP_CLUSTER=1`` keeps the cluster's folder and logs.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.cluster import ROOT, Cluster, SendResult

pytestmark = pytest.mark.system

MESSAGES = 200
FAULT_AFTER = 40  # messages at the sink before the fault: rounds are running
SINK_DELAY = 0.07  # seconds per message at the sink (reply to the final dot)
RECOVERY = 90.0  # seconds from the fault until the last accepted message arrived
FINAL = {"delivered", "failed", "expired"}


@pytest.fixture
def cluster() -> Iterator[Cluster]:
    # Its own folder under /tmp (the postgres user must reach it; pytest's tmp_path
    # is private to root), removed afterwards unless FAULTS_KEEP_CLUSTER is set.
    root = Path(os.environ.get("FAULTS_ROOT", ROOT))
    with Cluster(root=root, sink_delay=SINK_DELAY) as c:
        yield c


def _diagnose(cluster: Cluster, sent: SendResult) -> str:
    got = set(cluster.received_ids())
    missing = [m for m in sent.accepted if m not in got]
    return (
        f"{len(missing)} of {len(sent.accepted)} accepted messages missing "
        f"(e.g. {missing[:3]}); recipient states {cluster.states()}; "
        f"link leases {cluster.leases()}; logs in {cluster.logs}"
    )


def _wait_settled(cluster: Cluster, timeout: float) -> None:
    """Wait until no recipient is still on its way, so late second copies are counted."""
    deadline = time.monotonic() + timeout
    while set(cluster.states()) - FINAL and time.monotonic() < deadline:
        time.sleep(0.2)  # polling the database: there is nothing to wait on


def _assert_recovered(
    cluster: Cluster, sent: SendResult, fault_at: float, in_flight: set[str]
) -> None:
    assert len(sent.accepted) >= MESSAGES // 2, f"too few accepted: {sent.refused[:5]}"
    left = RECOVERY - (time.monotonic() - fault_at)
    assert cluster.wait_delivered(sent.accepted, max(0.0, left)), _diagnose(cluster, sent)
    _wait_settled(cluster, 30)
    copies = cluster.copies()
    twice = {mid for mid, n in copies.items() if n > 1}
    assert max(copies.values()) <= 2, f"a message arrived {max(copies.values())} times"
    assert twice <= in_flight, (
        f"{len(twice - in_flight)} messages arrived twice that no round held at the fault: "
        f"{sorted(twice - in_flight)[:5]}"
    )


def test_kill_9_of_the_delivery_worker_mid_stream(cluster: Cluster) -> None:
    """The delivery worker is killed with -9 while rounds run and mail streams in;
    a fresh one starts at once (as a supervisor would). The dead worker's claims
    must come back within the default lease, not hold the link for its lifetime."""
    job = cluster.send_async(MESSAGES, clients=4, tag="kill")
    assert cluster.wait_sink_count(FAULT_AFTER, 60), "delivery never started"
    worker = cluster.delivery_worker
    with cluster.sink._cond:  # the outbound connections open at the kill
        open_at_kill = cluster.sink.active_connections
        cluster.kill(worker)
    fault_at = time.monotonic()
    in_flight = cluster.in_flight()  # exact: their owner is dead, nobody else holds them yet
    cluster.start_process(worker)
    sent = job.wait(120)
    _assert_recovered(cluster, sent, fault_at, in_flight)
    # Each outcome is committed before its connection's next transaction: at
    # most the message in flight on each open connection arrives twice.
    duplicates = sum(n - 1 for n in cluster.copies().values())
    assert duplicates <= open_at_kill, (
        f"{duplicates} duplicates with {open_at_kill} outbound connections open at the kill"
    )


def test_postgresql_restart_mid_delivery(cluster: Cluster) -> None:
    """PostgreSQL stops at once (every backend killed, crash recovery) and starts
    again while rounds run and mail streams in; no relay process is restarted."""
    job = cluster.send_async(MESSAGES, clients=4, tag="pg")
    assert cluster.wait_sink_count(FAULT_AFTER, 60), "delivery never started"
    in_flight = cluster.in_flight()
    fault_at = time.monotonic()
    cluster.restart_postgres()
    # A round claimed between the snapshot and the stop still holds its recipients.
    in_flight |= cluster.in_flight()
    sent = job.wait(120)
    _assert_recovered(cluster, sent, fault_at, in_flight)
    assert all(p.alive() for p in cluster.procs.values()), "a relay process died"
