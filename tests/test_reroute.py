"""Re-route: a queue's mail goes to another next hop for a while, then back.

Real SMTP sinks on two loopback addresses play the queue's own next hop
(127.0.0.2, found through the loopback DNS server's MX) and the re-route's
(127.0.0.3); the engine runs in-process (tests/support/pipeline.drain) and the
sweep ends the re-route when the movable clock passes its end.
"""

from __future__ import annotations

from datetime import timedelta

import pytest

from delivery.qmgr.sweep import reclaim, sweep
from delivery.smtp.deliver import claim_round
from queues.accept import IncomingEnvelope, IncomingRecipient, message_accept
from queues.lib import clock
from queues.models import (
    AuditEntry,
    DeliveryType,
    Event,
    Link,
    Message,
    Queue,
    Recipient,
    RecipientState,
)
from queues.services.actions import ActionConflict, ActionInvalid, Via, queue_reroute
from tests.support.operator_factories import api_client, make_message, make_queue, make_user
from tests.support.pipeline import drain

pytestmark = pytest.mark.django_db

UNTIL = "2030-01-01T00:00:00Z"
BODY = b"From: a@example.org\r\nTo: u@example.net\r\nSubject: t\r\n\r\nhello\r\n"


def accept(rcpt: str = "u@example.net") -> Message:
    env = IncomingEnvelope(
        mail_from="a@example.org",
        recipients=[IncomingRecipient(rcpt)],
        client_address="127.0.0.1",
        client_helo="client.test",
    )
    return message_accept(env, BODY)


@pytest.fixture
def relay(dns_settings, settings, smtp_port):
    settings.MAILRELAY_REMOTE_SMTP_PORT = smtp_port
    settings.MAILRELAY_SMTP_CONNECT_TIMEOUT = timedelta(seconds=2)
    settings.MAILRELAY_SMTP_CLIENT_TIMEOUT = timedelta(seconds=5)
    dns_settings.mx("example.net", [(10, "mx1.example.net")])
    dns_settings.a("mx1.example.net", "127.0.0.2")
    return dns_settings


@pytest.fixture
def olga():
    return make_user("operator", "olga")


def _queue() -> Queue:
    return Queue.objects.select_related("link").get(name="example.net")


def test_a_rerouted_queue_goes_to_the_new_hop_until_its_end_then_back(
    relay, sink_factory, smtp_port, olga, bells
):
    home, other = sink_factory("127.0.0.2"), sink_factory("127.0.0.3")
    accept()
    drain()
    assert len(home.messages) == 1
    queue = _queue()
    home_link = queue.link_id

    hop = f"[127.0.0.3]:{smtp_port}"
    assert queue_reroute(queue, olga, Via.API, to=hop, until="1h") == 0
    queue = _queue()
    assert (queue.reroute_to, queue.reroute_by, queue.reroute_from_id) == (hop, "olga", home_link)
    assert abs((queue.reroute_until - clock.now() - timedelta(hours=1)).total_seconds()) < 5
    assert queue.link.name == hop and queue.link_id != home_link
    entry = AuditEntry.objects.get(action="queue_reroute")
    assert entry.detail.startswith(
        f"before: delivering, routed to mx1.example.net:{smtp_port}; "
        f"after: delivering, re-routed to {hop} until "
    )
    assert "by olga" in entry.detail

    # New mail of the domain is routed while re-routed: it stays on the re-route.
    accept("v@example.net")
    drain()
    assert [m.rcpt_tos for m in other.messages] == [["v@example.net"]]
    assert len(home.messages) == 1
    assert _queue().link_id == queue.link_id

    # The end: the sweep gives the queue back to its own next hop.
    clock.advance(timedelta(hours=1, seconds=1))
    assert sweep().timed_ended == 1
    queue = _queue()
    assert (queue.link_id, queue.reroute_to, queue.reroute_until, queue.reroute_from_id) == (
        home_link,
        "",
        None,
        None,
    )
    ended = Event.objects.get(kind="reroute_ended")
    assert ended.queue_id == queue.pk and "its end time came" in ended.text
    auto = AuditEntry.objects.get(via="system")
    assert (auto.actor_name, auto.action, auto.target_ids) == (
        "system",
        "queue_unroute",
        [queue.pk],
    )
    assert "re-route by olga to [127.0.0.3]" in auto.detail
    accept("w@example.net")
    drain()
    assert [m.rcpt_tos for m in home.messages][-1] == ["w@example.net"]
    assert len(other.messages) == 1


def test_waiting_mail_of_a_dead_hop_is_due_at_once_on_the_new_one(
    relay, sink_factory, smtp_port, olga, bells, django_capture_on_commit_callbacks
):
    other = sink_factory("127.0.0.3")  # nothing listens on 127.0.0.2: refused
    message = accept()
    drain()
    rcpt = Recipient.objects.get(message=message)
    assert rcpt.state == RecipientState.DEFERRED and rcpt.next_attempt_at > clock.now()
    client = api_client(olga)
    queue = _queue()
    body = {"to": f"[127.0.0.3]:{smtp_port}"}
    with django_capture_on_commit_callbacks(execute=True):
        response = client.post(f"/api/v1/queues/{queue.pk}/reroute/", body, format="json")
    assert response.status_code == 200, response.json()
    assert response.json()["reroute_to"] == f"[127.0.0.3]:{smtp_port}"
    assert response.json()["reroute_until"] is None
    assert _queue().link_id in bells.links  # rung after commit
    drain()
    assert len(other.messages) == 1
    assert Recipient.objects.get(message=message).state == RecipientState.DELIVERED

    # Ended by hand: back on the old link, audited with before and after.
    response = client.post(f"/api/v1/queues/{queue.pk}/unroute/", {}, format="json")
    assert response.status_code == 200
    assert _queue().link_id == queue.link_id
    entry = AuditEntry.objects.get(action="queue_unroute")
    assert "before: delivering, re-routed to" in entry.detail
    assert f"after: delivering, routed to mx1.example.net:{smtp_port}" in entry.detail
    again = client.post(f"/api/v1/queues/{queue.pk}/unroute/", {}, format="json")
    assert (again.status_code, again.json()) == (
        409,
        {"detail": "queue example.net is not re-routed"},
    )


def test_a_smart_host_name_is_looked_up_as_a_configured_next_hop_is(
    relay, sink_factory, smtp_port, olga
):
    other = sink_factory("127.0.0.3")
    relay.a("relay.test", "127.0.0.3")
    queue = make_queue("example.net")
    make_message("u@example.net", queue=queue)
    queue_reroute(queue, olga, Via.CLI, to=f"relay.test:{smtp_port}", until="2h")
    drain()
    assert len(other.messages) == 1


def test_a_reroute_is_refused_with_reasons(relay, olga):
    queue = make_queue("example.net")
    with pytest.raises(ActionInvalid, match="to: the next hop"):
        queue_reroute(queue, olga, Via.CLI, to="  ")
    with pytest.raises(ActionInvalid, match="bad brackets"):
        queue_reroute(queue, olga, Via.CLI, to="[10.0.0.9:25")
    with pytest.raises(ActionInvalid, match="does not exist in DNS"):
        queue_reroute(queue, olga, Via.CLI, to="nowhere.test")
    with pytest.raises(ActionInvalid, match="is not in the future"):
        queue_reroute(queue, olga, Via.CLI, to="[10.0.0.9]:25", until="2000-01-01T00:00:00Z")
    unreachable = make_queue("gone.example", delivery_type=DeliveryType.UNREACHABLE)
    with pytest.raises(ActionConflict, match="has no next hop to re-route"):
        queue_reroute(unreachable, olga, Via.CLI, to="[10.0.0.9]:25")
    client = api_client(olga)
    response = client.post(
        f"/api/v1/queues/{queue.pk}/reroute/", {"to": "[10.0.0.9:25"}, format="json"
    )
    assert response.status_code == 400 and response.json()["detail"].startswith("to: next hop")
    assert not AuditEntry.objects.exists()
    assert _queue().reroute_to == ""


def test_recipients_in_flight_finish_where_they_are(relay, olga):
    queue = make_queue("example.net")
    message = make_message("u@example.net", queue=queue)
    (rid,) = claim_round(queue.link_id, "worker-1", 10)
    queue_reroute(queue, olga, Via.UI, to="[10.0.0.9]:25")
    row = Recipient.objects.get(pk=rid)
    assert (row.state, row.lease_owner, row.queue_id) == (
        RecipientState.ACTIVE,
        "worker-1",
        queue.pk,
    )
    assert Recipient.objects.filter(message=message).count() == 1


def test_the_queue_list_and_the_command_say_where_a_queue_goes(relay, olga, client):
    queue = make_queue("example.net")
    queue_reroute(queue, olga, Via.UI, to="[10.0.0.9]:25", until="2h")
    client.force_login(olga)
    page = client.get("/queues/").content.decode()
    assert "re-routed to [10.0.0.9]:25 until " in page and "by olga" in page
    assert 'data-action="unroute"' in page
    from io import StringIO

    from django.core.management import call_command

    out = StringIO()
    call_command("queue", "list", stdout=out)
    assert "re-routed to [10.0.0.9]:25 until" in out.getvalue()
    # The reclaim beat ends it too, when its time comes.
    clock.advance(timedelta(hours=2, seconds=1))
    assert reclaim().timed_ended == 1
    assert Link.objects.get(pk=_queue().link_id).name == "example.net"


def test_the_confirmation_page_previews_a_reroute_by_filter_with_its_options(relay, olga, client):
    for name in ("a.example", "b.example"):
        make_queue(name)
    make_queue("gone.example", delivery_type=DeliveryType.UNREACHABLE)
    client.force_login(olga)
    page = client.get("/queues/by-filter/", {"action": "reroute", "name": "example"})
    assert page.context["count"] == 0  # nothing can change before a next hop is given
    assert [name for name, _ in page.context["option_fields"]] == ["to", "until"]
    # Confirmed without one: a clear error, nothing changed (never a silent "0 re-routed").
    response = client.post("/queues/by-filter/", {"action": "reroute", "name": "example"})
    assert response.status_code == 302
    shown = client.get(response["Location"]).content.decode()
    assert "Not done: to: reroute needs to" in shown and "Nothing was changed" in shown
    assert not Queue.objects.exclude(reroute_to="").exists()
    assert not AuditEntry.objects.exists()
    params = {"action": "reroute", "name": "example", "to": "[10.0.0.9]:25", "until": UNTIL}
    page = client.get("/queues/by-filter/", params)
    assert (page.context["count"], page.context["options"]) == (
        2,
        {"to": "[10.0.0.9]:25", "until": UNTIL},
    )
    assert 'name="to" value="[10.0.0.9]:25"' in page.content.decode()
    client.post("/queues/by-filter/", params)
    rerouted = Queue.objects.exclude(reroute_to="")
    assert sorted(rerouted.values_list("name", flat=True)) == ["a.example", "b.example"]
    entry = AuditEntry.objects.get(action="queue_reroute")
    assert entry.count == 2 and entry.filter == {"name": "example"}
    assert entry.detail.splitlines()[1].startswith(
        "a.example: before: delivering, routed to a.example; after: delivering, re-routed to "
        "[10.0.0.9]:25 until "
    )
    # Again with the same options (the same end time): nothing left to change.
    assert client.get("/queues/by-filter/", params).context["count"] == 0


def test_a_bulk_reroute_without_a_next_hop_is_refused_everywhere(relay, olga, client):
    make_queue("example.net")
    make_queue("b.example")
    api = api_client(olga)
    for body in (
        {"action": "reroute", "filter": {"name": "example"}},
        {"action": "reroute", "filter": {"name": "example"}, "confirm": True},
        {
            "action": "reroute",
            "ids": list(Queue.objects.values_list("id", flat=True)),
            "confirm": True,
            "to": "  ",
        },
    ):
        response = api.post("/api/v1/queues/bulk/", body, format="json")
        assert response.status_code == 400, body
        assert response.json()["detail"].startswith("to: reroute needs to")
    # The selected queues' form in the UI.
    client.force_login(olga)
    ids = [str(i) for i in Queue.objects.values_list("id", flat=True)]
    response = client.post("/queues/selected/", {"action": "reroute", "ids": ids})
    shown = client.get(response["Location"]).content.decode()
    assert "Not done: to: reroute needs to" in shown
    # The command, for real and as a dry run.
    from django.core.management import CommandError, call_command

    for extra in ([], ["--dry-run"]):
        with pytest.raises(CommandError, match="to: "):
            call_command("queue", "reroute", "example.net", *extra)
    assert not Queue.objects.exclude(reroute_to="").exists()
    assert not AuditEntry.objects.exists()
