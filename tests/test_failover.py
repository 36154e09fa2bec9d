"""Losing the database machine (issue #25): nothing acknowledged is lost to a failover.

The relay runs as an operator runs it (``tests/support/cluster.py``: runsmtp,
the workers and beat as ``make run`` starts them, DEFAULT lease and sweep)
on a private primary and a synchronous streaming standby made with
``initdb`` and ``pg_basebackup`` (``tests/support/failover.py``), every
process given the multi-host ``DATABASE_URL`` that lists both. Mail streams
in; once delivery is under way the primary's postmaster and every backend
get SIGKILL, and 3 s later the standby is promoted (``pg_ctl promote``). No
relay process is restarted. Then:

- every message that got 250 arrives at the sink (0 lost);
- ingress accepts again within 15 s of the promotion, delivery resumes
  within 60 s (a message accepted after the kill arrives);
- at most one extra copy per outbound connection open at the kill;
- nothing was failed, expired or parked in Poison because the store was
  away, and every relay process is still the one started.

``bench/failover/run.py`` runs the same with an asynchronous standby too.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from tests.support.failover import FailoverCluster, run_failover

pytestmark = pytest.mark.system


@pytest.fixture
def cluster() -> Iterator[FailoverCluster]:
    with FailoverCluster(synchronous=True, sink_delay=0.02) as c:
        yield c


def test_kill_9_of_the_primary_and_promotion_of_a_synchronous_standby(
    cluster: FailoverCluster,
) -> None:
    pids = {name: proc.pid for name, proc in cluster.procs.items()}
    result = run_failover(cluster, messages=300, rate=40, kill_after=60, settle=75)
    where = f"{result}; logs in {cluster.logs}\n{cluster.log_tails()}"
    assert result.acknowledged >= 250, where
    assert not result.lost, where
    assert 0 <= result.accepting_after_promotion <= 15, where
    assert 0 <= result.delivery_resumed_after_promotion <= 60, where
    assert result.duplicates <= result.open_connections_at_kill, where
    assert set(result.states) == {"delivered"}, where
    poisoned = cluster.query(
        "SELECT count(*) FROM queues_message m JOIN queues_recipient r ON r.message_id = m.id "
        "JOIN queues_queue q ON q.id = r.queue_id "
        "WHERE q.delivery_type IN ('poison', 'dead_letter', 'unreachable') OR m.crash_count > 0"
    )[0][0]
    assert poisoned == 0, where
    assert all(p.alive() for p in cluster.procs.values()), where
    assert {name: proc.pid for name, proc in cluster.procs.items()} == pids
    if os.environ.get("FAULTS_KEEP_CLUSTER"):
        print(result)
