"""Ownership at the default settings, with real Celery worker and beat processes."""

from __future__ import annotations

import pytest

from queues.models import Attempt, Message, MessageState, Recipient, RecipientState
from tests.test_system import body, wait_until

pytestmark = [pytest.mark.system, pytest.mark.django_db(transaction=True)]


def test_a_next_hop_slower_than_the_lease_gets_exactly_one_copy(
    settings, sink_factory, smtp_port, start_ingress, processes, tmp_path
):
    """Two messages on one connection to a peer that takes 16 s to answer each
    final dot: the round lasts longer than the default 30 s lease, so it stays
    owned only because its worker renews it. Beat runs the sweep and the
    reclaim at their defaults all the while; nothing is taken back, each
    message arrives once, and every attempt is recorded."""
    assert settings.MAILRELAY_DELIVERY_LEASE.total_seconds() == 30  # the default
    sink = sink_factory("127.0.0.5", delays={"DATA": 16.0})
    settings.MAILRELAY_SMART_HOST = f"[127.0.0.5]:{smtp_port}"
    ingress = start_ingress()
    env = {"MAILRELAY_SMART_HOST": settings.MAILRELAY_SMART_HOST}
    for i in range(2):  # both queued before a worker runs: one round, one connection
        assert ingress.send(body(i), rcpt_to=[f"slow{i}@example.net"])[0] == 250
    processes.worker("w1", **env)
    processes.beat(tmp_path, **env)
    wait_until(
        lambda: Message.objects.filter(state=MessageState.DONE).count() == 2,
        timeout=90,
        what="both messages delivered and recorded",
    )
    assert sorted(m.rcpt_tos[0] for m in sink.messages) == [
        "slow0@example.net",
        "slow1@example.net",
    ]
    assert sink.connections == 1
    assert set(Recipient.objects.values_list("state", flat=True)) == {RecipientState.DELIVERED}
    assert Attempt.objects.count() == 2
    assert set(Recipient.objects.values_list("attempt_count", flat=True)) == {1}
