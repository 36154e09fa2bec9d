"""Traffic shaping across real Celery worker processes (delivery.shaping).

One shaping entry spans two destination domains, hence two links delivered
by tasks in two worker processes; the sinks count the connections open at
once (both together) and the messages received. The counters live in the
test broker's Redis database, as in production.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest
import redis
from django.db import close_old_connections

from delivery.shaping.limiter import keys
from queues.models import Link, Recipient, RecipientState
from queues.signals import link_work
from tests.test_shaping import PeerLog, peer_log  # noqa: F401 - the fixture
from tests.test_system import body

pytestmark = [pytest.mark.system, pytest.mark.django_db(transaction=True)]

POLICY = """
entries:
  - name: provider
    domain: [a.shaped.test, b.shaped.test]
    max_connections: 2
    max_messages_per_connection: 2
    max_message_rate: 10/min
"""


def wait_until(predicate: Callable[[], bool], timeout: float = 30, what: str = "") -> None:
    """Poll the database (there is no event to await there)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        close_old_connections()
        if predicate():
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what or predicate}")


def delivered() -> int:
    return Recipient.objects.filter(state=RecipientState.DELIVERED).count()


def task_runs(*workers) -> int:
    return sum("deliver_link" in line and "succeeded" in line for w in workers for line in w.lines)


def settled_runs(workers) -> bool:
    """No deliver_link task finished in the last 0.3 s (a task logs just after it
    let go of its link)."""
    before = task_runs(*workers)
    time.sleep(0.3)
    return task_runs(*workers) == before


@pytest.fixture
def shaped(settings, tmp_path, sink_factory, smtp_port, start_ingress):
    """Two domains at two next hops (two links), one shaping entry over both."""
    sinks = [sink_factory("127.0.0.2", delays={"DATA": 0.1})]
    sinks.append(sink_factory("127.0.0.4", delays={"DATA": 0.1}))
    transports = f"a.shaped.test=[127.0.0.2]:{smtp_port},b.shaped.test=[127.0.0.4]:{smtp_port}"
    path = tmp_path / "shaping.yaml"
    path.write_text(POLICY)
    settings.MAILRELAY_TRANSPORTS = transports
    settings.MAILRELAY_SHAPING = str(path)
    env = {"MAILRELAY_TRANSPORTS": transports, "MAILRELAY_SHAPING": str(path)}
    return sinks, env, start_ingress()


def test_two_connections_and_10_per_minute_hold_across_two_worker_processes(
    shaped,
    processes,
    broker: redis.Redis,
    peer_log: PeerLog,  # noqa: F811
):
    sinks, env, ingress = shaped
    workers = [processes.worker(name, concurrency=1, **env) for name in ("w1", "w2")]
    for i in range(8):
        for domain in ("a.shaped.test", "b.shaped.test"):
            assert ingress.send(body(i, 512), rcpt_to=[f"u{i}@{domain}"])[0] == 250
    wait_until(lambda: delivered() == 10, what="the first ten")
    # Exactly the window's ten went, never more than two connections at once.
    assert sum(len(s.messages) for s in sinks) == 10
    assert peer_log.peak <= 2
    assert len(peer_log.peers) >= 5  # two messages per connection at most
    # The rest wait for the window, unattempted; one wake-up is scheduled at its
    # end and nothing spins meanwhile (no task runs, no Redis refusals loop).
    # (The refusal comes with the round after the tenth: await it.)
    wake = keys("entry:provider")["wake"]
    wait_until(lambda: broker.exists(wake), what="the wake-up of the window")
    assert 50_000 < broker.pttl(wake) <= 60_000
    waiting = Recipient.objects.exclude(state=RecipientState.DELIVERED)
    assert sorted(waiting.values_list("attempt_count", flat=True)) == [0] * 6
    # Each link's task ends with its refused round (after its round wait,
    # MAILRELAY_DELIVERY_ROUND_WAIT): count from when both have let go.
    wait_until(lambda: not Link.objects.exclude(lease_owner="").exists(), what="both let go")
    wait_until(lambda: settled_runs(workers), what="the tasks' last log lines")
    runs = task_runs(*workers)
    time.sleep(1.5)  # proving that nothing happens: there is no event to await
    assert task_runs(*workers) <= runs + 1
    assert sum(len(s.messages) for s in sinks) == 10
    # The window passes (moved back a minute in Redis instead of waiting for
    # it); the doorbell rings the links and the rest go, still two at a time.
    msgs = keys("entry:provider")["msgs"]
    for member, score in broker.zrange(msgs, 0, -1, withscores=True):
        broker.zadd(msgs, {member: score - 61})
    for link_id in Link.objects.values_list("id", flat=True):
        link_work.send(sender=None, link_id=link_id)
    wait_until(lambda: delivered() == 16, what="the other six")
    assert sum(len(s.messages) for s in sinks) == 16
    assert peer_log.peak <= 2
    assert all(len(s.messages) == 8 for s in sinks)


def test_the_slots_of_a_worker_killed_with_9_come_back(
    shaped,
    processes,
    broker: redis.Redis,
    tmp_path,
    peer_log: PeerLog,  # noqa: F811
):
    sinks, env, ingress = shaped
    sinks[0].behaviour.delays = {"DATA": 30.0}  # the first round hangs at the final dot
    # At the default lease (30 s) and sweep interval: no short lease to help.
    first = processes.worker("w1", concurrency=1, **env)
    for i in range(4):
        assert ingress.send(body(i, 512), rcpt_to=[f"u{i}@a.shaped.test"])[0] == 250
    slots = keys("entry:provider")["slots"]
    # The sink is not asked for its commands as they come: poll its record.
    wait_until(lambda: sinks[0].verbs().count("DATA") == 2, what="both rounds at the final dot")
    assert broker.zcard(slots) == 2  # both of the entry's connections are held
    first.kill()  # SIGKILL: the slots are never released
    sinks[0].behaviour.delays = {}
    processes.worker("w2", concurrency=1, **env)
    processes.beat(tmp_path, **env)
    # The dead worker's leases run out: its recipients and its slots come back.
    wait_until(lambda: delivered() == 4, timeout=90, what="delivery after the leases ended")
    # w2's own round gives its slots back when it closes, a moment after its
    # last delivery is recorded; the dead worker's must be back by then too.
    wait_until(lambda: broker.zcard(slots) == 0, timeout=5, what="every slot given back")
    assert peer_log.peak <= 2
