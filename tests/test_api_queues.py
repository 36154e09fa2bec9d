"""REST API: queues, links, their actions, history, qshape and deferrals by error."""

from datetime import timedelta

import pytest

from queues.lib import clock
from queues.models import (
    AuditEntry,
    DeliveryType,
    Link,
    LinkState,
    Queue,
    Recipient,
    RecipientState,
)
from queues.services.counts import queues_recount
from tests.support.operator_factories import (
    api_client,
    make_link,
    make_message,
    make_queue,
    make_user,
)

pytestmark = pytest.mark.django_db


@pytest.fixture
def client():
    return api_client(make_user("operator", "olga"))


@pytest.fixture
def viewer():
    return api_client(make_user("viewer", "vera"))


def test_the_queue_list_shows_status_counts_link_and_retry_time(client):
    link = make_link("mx.example.net", state=LinkState.RETRY, last_error="connect refused")
    link.next_retry_at = clock.now() + timedelta(minutes=10)
    link.save()
    busy = make_queue("example.net", link=link)
    quiet = make_queue("quiet.example")
    Queue.objects.filter(pk=quiet.pk).update(suspended=True)
    for i in range(3):
        make_message(f"u{i}@example.net", queue=busy, received_at=clock.now() - timedelta(hours=1))
    queues_recount(clock.now())
    data = client.get("/api/v1/queues/").json()
    rows = {r["name"]: r for r in data["results"]}
    assert rows["example.net"]["message_count"] == 3
    assert rows["example.net"]["status"] == "retry"
    assert rows["example.net"]["last_error"] == "connect refused"
    assert rows["example.net"]["next_retry_at"] is not None
    assert rows["example.net"]["link"]["name"] == "mx.example.net"
    assert 3590 <= rows["example.net"]["oldest_age_seconds"] <= 3700
    assert rows["quiet.example"]["status"] == "suspended"
    assert data["results"][0]["name"] == "example.net"  # largest first
    assert data["next"] is None and data["previous"] is None


def test_the_queue_list_filters_by_status_name_and_type(client):
    make_queue("a.example")
    b = make_queue("b.example")
    Queue.objects.filter(pk=b.pk).update(suspended=True)
    make_queue("Unreachable", delivery_type=DeliveryType.UNREACHABLE)

    def names(query):
        return sorted(r["name"] for r in client.get(f"/api/v1/queues/?{query}").json()["results"])

    assert names("status=suspended") == ["b.example"]
    assert names("status=ready") == ["Unreachable", "a.example"]
    assert names("name=a.ex") == ["a.example"]
    assert names("type=unreachable") == ["Unreachable"]
    assert client.get("/api/v1/queues/?status=sleepy").json() == {
        "detail": "status: 'sleepy' is not one of ready, active, retry, suspended"
    }


def test_the_queue_list_pages_by_cursor(client):
    for i in range(5):
        make_queue(f"q{i}.example")
    first = client.get("/api/v1/queues/?sort=name&limit=2").json()
    assert [r["name"] for r in first["results"]] == ["q0.example", "q1.example"]
    second = client.get(first["next"]).json()
    assert [r["name"] for r in second["results"]] == ["q2.example", "q3.example"]
    back = client.get(second["previous"]).json()
    assert [r["name"] for r in back["results"]] == ["q0.example", "q1.example"]


@pytest.mark.parametrize("verb", ["retry", "resubmit", "suspend", "resume"])
def test_each_queue_action_answers_with_the_updated_queue_and_is_audited(client, verb):
    queue = make_queue()
    make_message("u@example.net", queue=queue)
    if verb == "resume":
        Queue.objects.filter(pk=queue.pk).update(suspended=True)
    response = client.post(f"/api/v1/queues/{queue.pk}/{verb}/")
    assert response.status_code == 200, response.content
    assert response.json()["id"] == queue.pk
    assert response.json()["suspended"] is (verb == "suspend")
    entry = AuditEntry.objects.get()
    assert (entry.action, entry.via, entry.actor_name, entry.target_ids) == (
        f"queue_{verb}",
        "api",
        "olga",
        [queue.pk],
    )


def test_resuming_a_queue_that_is_not_suspended_is_a_409_and_changes_nothing(client):
    queue = make_queue()
    response = client.post(f"/api/v1/queues/{queue.pk}/resume/")
    assert response.status_code == 409
    assert response.json() == {"detail": "queue example.net is not suspended"}
    assert not AuditEntry.objects.exists()


def test_an_unknown_queue_is_a_404(client):
    assert client.post("/api/v1/queues/999/suspend/").status_code == 404
    assert "detail" in client.get("/api/v1/queues/999/").json()


def test_a_bulk_queue_action_by_filter_first_counts_then_acts_on_confirm(client):
    make_queue("a.example")
    make_queue("b.example")
    body = {"action": "suspend", "filter": {"name": "example"}}
    response = client.post("/api/v1/queues/bulk/", body, format="json")
    assert response.json()["count"] == 2 and response.json()["confirmed"] is False
    assert not Queue.objects.filter(suspended=True).exists()
    response = client.post("/api/v1/queues/bulk/", {**body, "confirm": True}, format="json")
    assert response.json()["count"] == 2 and response.json()["confirmed"] is True
    assert Queue.objects.filter(suspended=True).count() == 2


def test_a_viewer_reads_queues_but_cannot_act_on_them(viewer):
    queue = make_queue()
    assert viewer.get("/api/v1/queues/").status_code == 200
    assert viewer.get(f"/api/v1/queues/{queue.pk}/").status_code == 200
    for verb in ("retry", "resubmit", "suspend", "resume"):
        response = viewer.post(f"/api/v1/queues/{queue.pk}/{verb}/")
        assert response.status_code == 403
        assert response.json() == {"detail": "this needs the operator role"}
    assert not Queue.objects.get(pk=queue.pk).suspended


def test_links_are_listed_with_their_state(client):
    make_link("mx.example.net", state=LinkState.RETRY, failure_count=3)
    data = client.get("/api/v1/links/").json()
    assert [(r["name"], r["state"], r["failure_count"]) for r in data["results"]] == [
        ("mx.example.net", "retry", 3)
    ]
    link = Link.objects.get()
    assert client.get(f"/api/v1/links/{link.pk}/").json()["name"] == "mx.example.net"


def test_recount_keeps_counts_rates_and_a_bounded_history(client):
    queue = make_queue()
    start = clock.now()
    queues_recount(start)
    for i in range(4):
        make_message(f"u{i}@example.net", queue=queue)
    clock.advance(timedelta(seconds=60))
    queues_recount(start + timedelta(seconds=60))
    queue.refresh_from_db()
    assert queue.message_count == 4
    assert queue.incoming_rate == 4.0  # four new messages in one minute
    assert queue.counted_at == start + timedelta(seconds=60)
    history = client.get(f"/api/v1/queues/{queue.pk}/history/").json()
    assert [p["depth"] for p in history] == [4]
    assert history[0]["incoming_per_minute"] == 4.0
    total = client.get("/api/v1/queues/history/").json()
    assert [p["depth"] for p in total] == [0, 4]
    clock.advance(timedelta(hours=3))
    queues_recount(clock.now())
    assert (
        client.get("/api/v1/queues/history/").json()[0]["at"]
        >= ((clock.now() - timedelta(hours=2)).isoformat()[:19])
    )


def test_recount_counts_the_submission_queue(client):
    make_message("u@example.net")  # waits for the categorizer
    queues_recount(clock.now())
    submission = Queue.objects.get(delivery_type=DeliveryType.SUBMISSION)
    assert submission.message_count == 1


def test_qshape_counts_waiting_recipients_per_queue_and_age(client):
    queue = make_queue()
    now = clock.now()
    # in arrival order: ids grow with arrival time, as they do when mail comes in
    make_message("old@example.net", queue=queue, received_at=now - timedelta(days=2))
    make_message("mid@example.net", queue=queue, received_at=now - timedelta(minutes=30))
    make_message("new@example.net", queue=queue, received_at=now - timedelta(minutes=1))
    Recipient.objects.filter(address="old@example.net").update(state=RecipientState.DEFERRED)
    data = client.get("/api/v1/qshape/").json()
    assert data["buckets"] == ["5", "10", "20", "40", "80", "160", "320", "640", "1280", "1280+"]
    row = data["rows"][0]
    assert (row["key"], row["total"]) == ("example.net", 3)
    assert row["counts"] == [1, 0, 0, 1, 0, 0, 0, 0, 0, 1]
    assert data["total"]["counts"] == row["counts"]
    by_domain = client.get("/api/v1/qshape/?by=domain").json()
    assert by_domain["rows"][0]["key"] == "example.net"
    assert client.get("/api/v1/qshape/?by=colour").status_code == 400


def test_deferrals_are_grouped_by_normalised_error_and_link_to_their_messages(client):
    queue = make_queue()
    for i, wait in enumerate((300, 600, 900)):
        make_message(
            f"u{i}@example.net",
            queue=queue,
            rstate=RecipientState.DEFERRED,
            last_text=f"greylisted for {wait}s, id Q{i}X7",
            last_code=451,
            last_enhanced="4.7.1",
        )
    other = make_message(
        "z@example.net", queue=queue, rstate=RecipientState.DEFERRED, last_text="mailbox busy"
    )
    groups = client.get(f"/api/v1/errors/?queue={queue.pk}").json()
    assert [(g["text"], g["recipients"], g["code"]) for g in groups] == [
        ("greylisted for #, id #", 3, 451),
        ("mailbox busy", 1, None),
    ]
    listed = client.get(groups[0]["messages"]).json()["results"]
    assert sorted(r["recipients"][0] for r in listed) == [
        "u0@example.net",
        "u1@example.net",
        "u2@example.net",
    ]
    assert other.pk not in [r["id"] for r in listed]
