"""A queue's own page: depth, rates, link state and TLS, the explain summary, the
top errors, and the chart's live JSON with deferrals per minute."""

from __future__ import annotations

from datetime import timedelta

import pytest

from queues.lib import clock
from queues.models import Attempt, LinkState, QueueSample, Recipient, RecipientState
from tests.support.operator_factories import make_message, make_queue, make_user

pytestmark = pytest.mark.django_db


def test_the_queue_page_and_its_live_json(client):
    now = clock.now()
    q = make_queue("down.example")
    link = q.link
    link.state = LinkState.RETRY
    link.failure_count = 2
    link.first_failure_at = now - timedelta(minutes=2)
    link.next_retry_at = now + timedelta(minutes=1)
    link.last_tls = "TLSv1.3 verified (ca)"
    link.save()
    m = make_message(
        "u@down.example",
        queue=q,
        rstate=RecipientState.DEFERRED,
        last_text="connection refused",
        last_attempt_at=now - timedelta(minutes=1),
    )
    r = Recipient.objects.get(message=m)
    Recipient.objects.filter(pk=r.pk).update(next_attempt_at=link.next_retry_at)
    for minutes in (3, 2, 1):
        Attempt.objects.create(
            recipient=r,
            message=m,
            queue=q,
            started_at=now - timedelta(minutes=minutes, seconds=10),
            phase="connect",
            outcome="deferred",
        )
    for i, minutes in enumerate((4, 2, 0)):
        QueueSample.objects.create(
            sampled_at=now - timedelta(minutes=minutes),
            queue=q,
            seconds=120 if i else 60,
            depth=5 + i,
            incoming=2,
            delivered=1,
        )
    client.force_login(make_user("viewer"))
    page = client.get(f"/queues/{q.pk}/").content.decode()
    assert "TLSv1.3 verified (ca)" in page
    assert 'data-q="reason">link_retry' in page
    assert "connection refused" in page  # top errors
    data = client.get(f"/queues/{q.pk}/live.json").json()
    assert data["link"]["state"] == "retry" and data["link"]["tls"] == "TLSv1.3 verified (ca)"
    assert data["explain"]["reason"] == "link_retry"
    assert data["top_errors"][0]["recipients"] == 1
    history = data["history"]
    assert [p["depth"] for p in history] == [5, 6, 7]
    assert [p["in"] for p in history] == [2.0, 1.0, 1.0]
    assert sum(p["deferred"] for p in history) == pytest.approx(3 / 2 + 0.5, abs=1.01)
    assert history[-1]["deferred"] > 0
    # The queue list links each queue to its page.
    assert f'href="/queues/{q.pk}/" data-queue-page' in client.get("/queues/").content.decode()
    assert client.get("/queues/999999/").status_code == 404
