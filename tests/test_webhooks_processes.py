"""Webhooks across processes, as `make run` starts them: the control and delivery
workers carry mail while the endpoint is down, the webhook worker (queue
`webhooks`) delivers every event, signed, once the endpoint is back."""

from __future__ import annotations

import json

import pytest
from django.db.models import Count

from queues.lib import clock
from tests.support.sinks import find_free_port
from tests.test_system import body, wait_until
from tests.test_webhooks import SECRET, Receiver, verify
from tracking import endpoints, record
from tracking.models import DeliveryState, WebhookAttempt, WebhookDelivery, WebhookEndpoint

pytestmark = [pytest.mark.system, pytest.mark.django_db(transaction=True)]


def test_mail_flows_while_the_endpoint_is_down_and_its_events_arrive_later(
    settings, processes, sink_factory, smtp_port, start_ingress
):
    sink = sink_factory("127.0.0.2")
    port = find_free_port(["127.0.0.1"])
    endpoint = endpoints.create(
        "root",
        "cli",
        name="siem",
        url=f"http://127.0.0.1:{port}/in",
        events=["received", "delivered"],
        secret=SECRET,
    )
    transports = f"example.net=[127.0.0.2]:{smtp_port}"
    settings.MAILRELAY_TRANSPORTS = transports
    ingress = start_ingress()
    env = {"MAILRELAY_TRANSPORTS": transports, "MAILRELAY_WEBHOOK_TIMEOUT": "2s"}
    processes.control_worker(**env)
    processes.delivery_worker(**env)
    webhooks = processes.worker("webhooks", 2, queues="webhooks", pool="threads", **env)

    for n in range(3):
        code, _ = ingress.send(body(n), rcpt_to=[f"u{n}@example.net"])
        assert code == 250
    assert sink.wait_for(3, timeout=20), "mail waited on the webhook endpoint"
    # Six events queued; the webhook worker tried, the endpoint rests (30 s).
    wait_until(
        lambda: WebhookDelivery.objects.count() == 6 and WebhookAttempt.objects.exists(),
        timeout=20,
        what="the webhook worker's first try",
    )
    assert WebhookEndpoint.objects.get().down_until is not None
    assert not WebhookDelivery.objects.filter(state=DeliveryState.DELIVERED).exists()

    receiver = Receiver(port)
    try:
        # Thirty seconds on: the endpoint's rest is over, beat's ring comes.
        WebhookEndpoint.objects.update(down_until=clock.now())
        WebhookDelivery.objects.update(next_attempt_at=clock.now())
        record.ring()
        with receiver.arrived:
            assert receiver.arrived.wait_for(lambda: len(receiver.requests) >= 6, timeout=20), (
                "\n".join(webhooks.lines[-30:])
            )
    finally:
        receiver.stop()
    payloads = []
    for headers, text in receiver.requests:
        assert verify(SECRET, headers["X-Mailrelay-Signature"], text.encode())
        payloads.append(json.loads(text))
    assert len({p["id"] for p in payloads}) == 6
    by_type = {
        row["event"]: row["n"]
        for row in WebhookDelivery.objects.values("event").annotate(n=Count("id"))
    }
    assert by_type == {"received": 3, "delivered": 3}
    assert sorted(p["recipient"] for p in payloads if p["type"] == "delivered") == [
        "u0@example.net",
        "u1@example.net",
        "u2@example.net",
    ]
    wait_until(
        lambda: WebhookDelivery.objects.filter(state=DeliveryState.DELIVERED).count() == 6,
        timeout=10,
        what="every webhook recorded as delivered",
    )
    assert endpoint.pk == WebhookEndpoint.objects.get().pk
