"""Suspend for a time: a queue or a message suspended *until* a time resumes by
itself then. The sweep and the reclaim beat (delivery.qmgr.sweep) resume what is
due and ring the links; tested with the movable clock, and once in real time
with a short ``until`` and a real SMTP sink.
"""

from __future__ import annotations

import io
import time
from datetime import timedelta

import pytest
from django.core.management import call_command
from django.utils import timezone

from delivery.qmgr.sweep import reclaim, sweep
from queues.lib import clock
from queues.models import AuditEntry, Event, Message, Queue, Recipient, RecipientState
from queues.services.actions import (
    ActionInvalid,
    Via,
    message_resume,
    message_suspend,
    queue_suspend,
)
from queues.services.timed import end_due
from tests.support.operator_factories import api_client, make_message, make_queue, make_user
from tests.support.pipeline import drain

pytestmark = pytest.mark.django_db


@pytest.fixture
def olga():
    return make_user("operator", "olga")


def test_a_queue_suspended_until_a_time_resumes_by_itself_and_rings_its_link(
    olga, bells, django_capture_on_commit_callbacks
):
    queue = make_queue("example.net")
    make_message("u@example.net", queue=queue)
    assert queue_suspend(queue, olga, Via.UI, until="30m") == 1
    queue.refresh_from_db()
    assert (queue.suspended, queue.suspended_by) == (True, "olga")
    assert abs((queue.suspended_until - clock.now() - timedelta(minutes=30)).total_seconds()) < 5
    detail = AuditEntry.objects.get().detail
    assert detail.startswith("before: delivering, routed to example.net; after: suspended until ")
    assert "by olga" in detail

    clock.advance(timedelta(minutes=29))
    with django_capture_on_commit_callbacks(execute=True):
        assert sweep().timed_ended == 0
    assert Queue.objects.get(pk=queue.pk).suspended
    assert queue.link_id not in bells.links

    clock.advance(timedelta(minutes=1, seconds=1))
    with django_capture_on_commit_callbacks(execute=True):
        assert sweep().timed_ended == 1
    queue.refresh_from_db()
    assert (queue.suspended, queue.suspended_until, queue.suspended_by) == (False, None, "")
    assert bells.links.count(queue.link_id) >= 1
    event = Event.objects.get(kind="suspend_ended")
    assert event.queue_id == queue.pk and "suspension by olga ended" in event.text
    # The automatic end is in the audit log too: actor and via "system".
    auto = AuditEntry.objects.get(via="system")
    assert (auto.actor_id, auto.actor_name, auto.action, auto.target_type) == (
        None,
        "system",
        "queue_resume",
        "queue",
    )
    assert auto.target_ids == [queue.pk] and auto.count == 1
    assert "suspension by olga ended" in auto.detail
    # ... and the audit log's filters (API and page) find it by via.
    body = api_client(olga).get("/api/v1/audit/", {"via": "system"}).json()
    rows = body["results"] if isinstance(body, dict) else body
    assert [(r["actor"], r["via"], r["action"]) for r in rows] == [
        ("system", "system", "queue_resume")
    ]
    from django.test import Client

    page = Client()
    page.force_login(olga)
    html = page.get("/audit/", {"via": "system"}).content.decode()
    assert '<option value="system" selected>' in html and "queue_resume" in html
    assert ">queue_suspend<" not in html  # olga's own entry is via ui


def test_a_message_suspended_until_a_time_is_released_by_the_reclaim_beat(
    olga, bells, django_capture_on_commit_callbacks
):
    queue = make_queue("example.net")
    message = make_message("u@example.net", queue=queue)
    other = make_message("v@example.net", queue=queue)
    message_suspend(message, olga, Via.API, until="2h")
    message_suspend(other, olga, Via.API)  # until resumed by hand
    clock.advance(timedelta(hours=2, seconds=1))
    with django_capture_on_commit_callbacks(execute=True):
        assert reclaim().timed_ended == 1
    message.refresh_from_db()
    assert (message.suspended, message.suspended_until, message.suspended_by) == (False, None, "")
    assert Message.objects.get(pk=other.pk).suspended
    assert queue.link_id in bells.links
    assert "suspension by olga ended" in Event.objects.get(message=message).text
    auto = AuditEntry.objects.get(via="system")
    assert (auto.actor_name, auto.action, auto.target_ids, auto.count) == (
        "system",
        "message_resume",
        [message.pk],
        1,
    )
    assert f"{message.qid} (suspended by olga)" in auto.detail


def test_a_resume_by_hand_clears_the_time(olga):
    message = make_message("u@example.net", queue=make_queue())
    message_suspend(message, olga, Via.CLI, until="1h")
    message_resume(message, olga, Via.CLI)
    message.refresh_from_db()
    assert (message.suspended, message.suspended_until) == (False, None)
    clock.advance(timedelta(hours=2))
    assert end_due(clock.now()).total == 0
    assert not Event.objects.filter(kind="suspend_ended").exists()


def test_nothing_due_costs_three_small_queries(olga, django_assert_max_num_queries):
    message_suspend(make_message("u@example.net", queue=make_queue()), olga, Via.CLI, until="1h")
    with django_assert_max_num_queries(3):
        assert end_due(clock.now()).total == 0


def test_in_real_time_a_short_suspension_ends_and_the_mail_goes(
    settings, smtp_port, sink_factory, olga
):
    settings.MAILRELAY_TRANSPORTS = f"example.net=[127.0.0.2]:{smtp_port}"
    sink = sink_factory("127.0.0.2")
    message = make_message("u@example.net")  # in Submission: routed by drain
    message_suspend(message, olga, Via.API, until="0.3s")
    drain()
    assert sink.messages == []
    until = Message.objects.get(pk=message.pk).suspended_until
    time.sleep(max(0.0, (until - timezone.now()).total_seconds()) + 0.01)  # the time itself
    assert reclaim().timed_ended == 1
    drain()
    assert [m.rcpt_tos for m in sink.messages] == [["u@example.net"]]
    assert Recipient.objects.get(message=message).state == RecipientState.DELIVERED


def test_every_edge_takes_until(olga, client):
    queue = make_queue("example.net")
    message = make_message("u@example.net", queue=queue)
    api = api_client(olga)
    response = api.post(f"/api/v1/messages/{message.pk}/suspend/", {"until": "2h"}, format="json")
    assert response.status_code == 200 and response.json()["suspended_until"]
    response = api.post(f"/api/v1/queues/{queue.pk}/suspend/", {"until": "soon"}, format="json")
    assert response.status_code == 400
    assert response.json()["detail"].startswith("until: 'soon' is neither a duration")
    response = api.post(f"/api/v1/queues/{queue.pk}/resume/", {}, format="json")
    assert response.status_code == 409  # not suspended: the bad until changed nothing
    body = {"action": "suspend", "filter": {"name": "example"}, "until": "45m", "confirm": True}
    assert api.post("/api/v1/queues/bulk/", body, format="json").json()["count"] == 1
    queue.refresh_from_db()
    assert queue.suspended_until is not None and queue.suspended_by == "olga"
    out = io.StringIO()
    call_command("queue", "resume", "example.net", stdout=out)
    call_command("queue", "suspend", "example.net", "--until", "10m", "--user", "olga", stdout=out)
    assert Queue.objects.get(pk=queue.pk).suspended_by == "olga"
    client.force_login(olga)
    page = client.get("/queues/").content.decode()
    assert "suspended until " in page and "(in 9m" in page and "by olga" in page
    page = client.get(f"/messages/{message.pk}/").content.decode()
    assert 'id="message-suspension"' in page and "suspended until" in page
    with pytest.raises(ActionInvalid):
        message_suspend(make_message("x@example.net"), olga, Via.CLI, until="-5m")
    # By filter in the Queue Viewer: the confirmation carries the time.
    params = {"action": "suspend", "domain": "example.net", "until": "1h"}
    page = client.get("/messages/by-filter/", params)
    assert page.context["count"] == 1 and page.context["options"] == {"until": "1h"}
    client.post("/messages/by-filter/", params)
    held = Message.objects.get(recipients__address="x@example.net")
    assert held.suspended and held.suspended_until is not None


def test_a_queue_whose_resume_fails_neither_blocks_the_others_nor_stops_the_sweep(
    olga, monkeypatch, caplog
):
    from queues.services import actions

    broken, fine = make_queue("broken.example"), make_queue("fine.example")
    make_message("u@broken.example", queue=broken)
    make_message("u@fine.example", queue=fine)
    for queue in (broken, fine):
        assert queue_suspend(queue, olga, Via.UI, until="10m") == 1
    resume = actions.queue_core(actions.QueueAction.RESUME)

    def resume_unless_broken(queue, now):
        if queue.pk == broken.pk:
            raise RuntimeError("a row that cannot be resumed")
        return resume(queue, now)

    monkeypatch.setattr(actions, "queue_core", lambda action: resume_unless_broken)
    clock.advance(timedelta(minutes=11))
    assert sweep().timed_ended == 1  # the sweep went on past the broken queue
    assert not Queue.objects.get(pk=fine.pk).suspended
    assert Queue.objects.get(pk=broken.pk).suspended  # rolled back, tried again next pass
    assert f"resuming queue {broken.pk} failed" in caplog.text
