"""REST API: the message list (every filter, sorting, cursor pagination), the
detail, every message action with its conflicts, export and bulk actions."""

import io
import urllib.parse
import zipfile
from datetime import timedelta

import pytest

from queues.lib import clock
from queues.models import (
    Attempt,
    AuditEntry,
    DeliveryType,
    Message,
    MessageSource,
    MessageState,
    Recipient,
    RecipientState,
)
from tests.support.operator_factories import (
    api_client,
    make_message,
    make_queue,
    make_user,
    rstates,
)

pytestmark = pytest.mark.django_db


@pytest.fixture
def client():
    return api_client(make_user("operator", "olga"))


def ids(client, query=""):
    response = client.get(f"/api/v1/messages/?{query}")
    assert response.status_code == 200, response.content
    return [r["id"] for r in response.json()["results"]]


# --- the list ---------------------------------------------------------------------------


def test_the_list_shows_newest_first_with_status_queue_and_last_error(client):
    queue = make_queue()
    old = make_message("a@example.net", queue=queue, received_at=clock.now() - timedelta(hours=2))
    new = make_message(
        "b@example.net",
        "c@example.net",
        queue=queue,
        rstate=RecipientState.DEFERRED,
        subject="quarterly report",
        last_text="mailbox busy",
        last_code=450,
        last_enhanced="4.2.1",
        attempt_count=2,
    )
    rows = client.get("/api/v1/messages/").json()["results"]
    assert [r["id"] for r in rows] == [new.pk, old.pk]
    row = rows[0]
    assert row["status"] == "retry"
    assert row["sender"] == "a@example.org"
    assert row["recipients"] == ["b@example.net", "c@example.net"]
    assert row["subject"] == "quarterly report"
    assert row["queues"] == [{"id": queue.pk, "name": "example.net"}]
    assert row["last_error"] == "450 4.2.1 mailbox busy"
    assert row["attempt_count"] == 4
    assert row["size"] == len(bytes(new.data))
    assert row["source"] == "smtp" and row["received_at"] and row["expires_at"]
    assert row["message_id"] == "<quarterly-report@example.org>"
    assert rows[1]["status"] == "ready"


def test_it_filters_on_sender_recipient_domain_message_id_and_subject(client):
    queue = make_queue()
    a = make_message("u@example.net", sender="Alice@Example.org", queue=queue, subject="invoice 7")
    b = make_message("v@other.example", sender="bob@example.com", subject="minutes")
    null = make_message("w@example.net", sender="")
    assert ids(client, "sender=alice@example") == [a.pk]
    assert ids(client, "sender=%3C%3E") == [null.pk]
    assert ids(client, "recipient=v@other") == [b.pk]
    assert ids(client, "domain=EXAMPLE.NET") == [null.pk, a.pk]
    assert ids(client, "message_id=invoice-7@") == [a.pk]
    assert ids(client, "subject=MINUTES") == [b.pk]
    assert ids(client, "qid=" + a.qid.lower()) == [a.pk]
    assert ids(client, "sender=example&domain=other.example") == [b.pk]


def test_it_filters_on_status_queue_age_size_error_and_source(client):
    q1, q2 = make_queue("one.example"), make_queue("two.example")
    ready = make_message("a@one.example", queue=q1, received_at=clock.now() - timedelta(days=1))
    retry = make_message(
        "b@two.example", queue=q2, rstate=RecipientState.DEFERRED, last_text="450 mailbox full"
    )
    held = make_message("c@one.example", queue=q1, text="x" * 5000)
    Message.objects.filter(pk=held.pk).update(suspended=True)
    done = make_message("d@two.example", queue=q2, rstate=RecipientState.DELIVERED)
    failed = make_message(
        "e@two.example", queue=q2, rstate=RecipientState.FAILED, last_text="550 no such user"
    )
    dsn = make_message("f@one.example")
    Message.objects.filter(pk=dsn.pk).update(source=MessageSource.DSN)
    assert ids(client, "status=ready") == [ready.pk]
    assert ids(client, "status=retry") == [retry.pk]
    assert ids(client, "status=suspended") == [held.pk]
    assert ids(client, "status=delivered") == [done.pk]
    assert ids(client, "status=failed") == [failed.pk]
    assert ids(client, "status=submission") == [dsn.pk]
    assert ids(client, "status=ready,retry") == [retry.pk, ready.pk]
    assert ids(client, f"queue={q1.pk}") == [held.pk, ready.pk]
    assert ids(client, "older_than=2h") == [ready.pk]
    assert ids(client, "newer_than=2h&queue=" + str(q1.pk)) == [held.pk]
    assert ids(client, "min_size=4K") == [held.pk]
    assert len(ids(client, "max_size=4K")) == 5
    assert ids(client, "error=MAILBOX full") == [retry.pk]
    assert ids(client, "error=no such user") == [failed.pk]
    assert ids(client, "source=dsn") == [dsn.pk]
    assert len(ids(client, "source=smtp")) == 5


def test_a_message_in_flight_shows_as_active_and_one_being_routed_as_submission(client):
    queue = make_queue()
    active = make_message("a@example.net", queue=queue, rstate=RecipientState.ACTIVE)
    routing = make_message("b@example.net")
    Message.objects.filter(pk=routing.pk).update(state=MessageState.CATEGORIZING)
    assert ids(client, "status=active") == [active.pk]
    assert ids(client, "status=submission") == [routing.pk]


@pytest.mark.parametrize(
    ("query", "detail"),
    [
        ("status=lost", "status: 'lost' is not one of"),
        ("older_than=yesterday", "older_than: 'yesterday' is neither a duration"),
        ("min_size=big", "min_size: 'big' is not a size"),
        ("queue=x", "queue: 'x' is not a number"),
        ("sort=colour", "sort: 'colour' is not one of received, size, id"),
        ("cursor=nonsense", "cursor: not a cursor this list handed out"),
        ("limit=0", "limit: must be between 1 and 500"),
    ],
)
def test_a_filter_it_cannot_understand_is_a_400_that_says_why(client, query, detail):
    response = client.get(f"/api/v1/messages/?{query}")
    assert response.status_code == 400
    assert response.json()["detail"].startswith(detail)


def test_cursor_pagination_walks_forward_and_back_without_gaps_or_repeats(client):
    now = clock.now()
    made = []
    for i in range(7):
        # two messages share each arrival time: the id breaks the tie
        made.append(make_message(f"u{i}@example.net", received_at=now - timedelta(minutes=i // 2)))
    assert len(made) == 7
    expected = [
        m.pk
        for m in sorted(Message.objects.all(), key=lambda m: (m.received_at, m.pk), reverse=True)
    ]
    seen, pages, url = [], [], "/api/v1/messages/?limit=3"
    while url:
        page = client.get(url).json()
        pages.append(page)
        seen += [r["id"] for r in page["results"]]
        url = page["next"]
    assert seen == expected
    assert [len(p["results"]) for p in pages] == [3, 3, 1]
    back = client.get(pages[2]["previous"]).json()
    assert [r["id"] for r in back["results"]] == expected[3:6]
    first = client.get(back["previous"]).json()
    assert [r["id"] for r in first["results"]] == expected[:3]
    assert first["previous"] is None


def test_it_sorts_by_size_both_ways_across_pages(client):
    for n in (300, 100, 200, 100):
        make_message("u@example.net", text="x" * n)
    sizes = lambda rows: [r["size"] for r in rows]  # noqa: E731
    page = client.get("/api/v1/messages/?sort=size&limit=3").json()
    rest = client.get(page["next"]).json()
    everything = sizes(page["results"]) + sizes(rest["results"])
    assert everything == sorted(everything) and len(everything) == 4
    desc = client.get("/api/v1/messages/?sort=-size").json()["results"]
    assert sizes(desc) == sorted(sizes(desc), reverse=True)


# --- the detail -----------------------------------------------------------------------


def test_the_detail_has_envelope_headers_recipients_attempts_events_and_preview(client):
    queue = make_queue()
    message = make_message("u@example.net", queue=queue, rstate=RecipientState.DEFERRED)
    Message.objects.filter(pk=message.pk).update(ret="HDRS", envid="env-42")
    Recipient.objects.update(notify="FAILURE,DELAY", orcpt="rfc822;u@example.net")
    r = Recipient.objects.get()
    Attempt.objects.create(
        recipient=r,
        message=message,
        queue=queue,
        started_at=clock.now(),
        host="mx.example.net",
        ip="192.0.2.1",
        port=25,
        phase="rcpt",
        code=450,
        enhanced="4.2.1",
        text="try later",
        outcome="deferred",
    )
    message.events.create(created_at=clock.now(), kind="note", text="something happened")
    data = client.get(f"/api/v1/messages/{message.pk}/").json()
    assert data["envelope"]["mail_from"] == "a@example.org"
    assert data["envelope"]["ret"] == "HDRS" and data["envelope"]["envid"] == "env-42"
    assert data["envelope"]["rcpt_to"] == [
        {"address": "u@example.net", "orcpt": "rfc822;u@example.net", "notify": "FAILURE,DELAY"}
    ]
    assert data["envelope"]["client_helo"] == "client.test"
    assert data["recipients"][0]["state"] == "deferred"
    assert data["recipients"][0]["queue"]["name"] == "example.net"
    assert [(a["host"], a["code"], a["text"]) for a in data["attempts"]] == [
        ("mx.example.net", 450, "try later")
    ]
    assert [e["text"] for e in data["events"]] == ["something happened"]
    headers = dict((k.lower(), v) for k, v in data["headers"])
    assert headers["subject"] == "hello"
    assert headers["received"].startswith("from client.test")
    assert data["preview"] == {"text": "line one\r\n", "truncated": False}
    assert client.get(f"/api/v1/messages/{message.qid}/").json()["id"] == message.pk


def test_a_viewer_sees_the_envelope_and_subject_but_no_headers_or_body():
    viewer = api_client(make_user("viewer", "vera"))
    message = make_message("u@example.net")
    data = viewer.get(f"/api/v1/messages/{message.pk}/").json()
    assert data["subject"] == "hello"
    assert data["envelope"]["mail_from"] == "a@example.org"
    assert data["headers"] is None and data["preview"] is None and data["message_id"] is None
    assert viewer.get("/api/v1/messages/").json()["results"][0]["message_id"] is None
    assert viewer.get(f"/api/v1/messages/{message.pk}/export/").status_code == 403


# --- actions --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("verb", "suspended", "after"),
    [
        ("suspend", False, "suspended"),
        ("resume", True, "ready"),
        ("resubmit", False, "submission"),
        ("remove", False, "failed"),
    ],
)
def test_each_message_action_answers_with_the_updated_message_and_is_audited(
    client, verb, suspended, after
):
    message = make_message("u@example.net", queue=make_queue())
    Message.objects.filter(pk=message.pk).update(suspended=suspended)
    response = client.post(f"/api/v1/messages/{message.pk}/{verb}/", {}, format="json")
    assert response.status_code == 200, response.content
    assert response.json()["status"] == after
    entry = AuditEntry.objects.get()
    assert (entry.action, entry.via, entry.target_type, entry.target_ids, entry.count) == (
        f"message_{verb}",
        "api",
        "message",
        [message.pk],
        1,
    )


def test_remove_with_ndr_queues_a_report_to_the_sender(client):
    message = make_message("u@example.net", queue=make_queue())
    response = client.post(f"/api/v1/messages/{message.pk}/remove/", {"ndr": True}, format="json")
    assert response.status_code == 200
    assert rstates(message) == [RecipientState.FAILED]
    report = Message.objects.exclude(pk=message.pk).get()
    assert report.source == MessageSource.DSN and report.mail_from == ""
    assert list(report.recipients.values_list("address", flat=True)) == ["a@example.org"]


def test_remove_without_ndr_sends_nothing(client):
    message = make_message("u@example.net", queue=make_queue())
    client.post(f"/api/v1/messages/{message.pk}/remove/", {"ndr": False}, format="json")
    assert Message.objects.count() == 1


def test_remove_with_a_body_it_cannot_understand_is_a_400(client):
    message = make_message("u@example.net", queue=make_queue())
    response = client.post(
        f"/api/v1/messages/{message.pk}/remove/", {"ndr": "maybe"}, format="json"
    )
    assert response.status_code == 400
    assert response.json()["detail"].startswith("ndr: ")
    assert rstates(message) == [RecipientState.QUEUED]


@pytest.mark.parametrize("verb", ["suspend", "resume", "resubmit", "remove"])
def test_acting_on_a_delivered_message_is_a_409_and_changes_nothing(client, verb):
    message = make_message("u@example.net", queue=make_queue(), rstate=RecipientState.DELIVERED)
    response = client.post(f"/api/v1/messages/{message.pk}/{verb}/", {}, format="json")
    assert response.status_code == 409
    assert "is done" in response.json()["detail"]
    assert rstates(message) == [RecipientState.DELIVERED]
    assert not AuditEntry.objects.exists()


def test_export_answers_exactly_the_stored_bytes_as_an_eml_attachment(client):
    message = make_message("u@example.net", text="bin\xe4r \x00 and .dots\r\n.\r\n")
    response = client.get(f"/api/v1/messages/{message.pk}/export/", HTTP_ACCEPT="message/rfc822")
    assert response.status_code == 200
    assert response["Content-Type"] == "message/rfc822"
    assert response["Content-Disposition"] == f'attachment; filename="{message.qid}.eml"'
    content = b"".join(response.streaming_content)
    assert content == bytes(Message.objects.get(pk=message.pk).data)
    assert response["Content-Length"] == str(len(content))
    assert AuditEntry.objects.get().action == "message_export"


def test_bulk_by_ids_acts_at_once(client):
    queue = make_queue()
    a, b = make_message("a@example.net", queue=queue), make_message("b@example.net", queue=queue)
    response = client.post(
        "/api/v1/messages/bulk/", {"action": "suspend", "ids": [a.pk, b.pk]}, format="json"
    )
    assert response.json() == {
        "action": "suspend",
        "count": 2,
        "confirmed": True,
        "detail": "suspend: 2 changed",
    }
    assert Message.objects.filter(suspended=True).count() == 2
    assert AuditEntry.objects.get().target_ids == [a.pk, b.pk]


def test_bulk_by_filter_without_confirm_only_counts(client):
    queue = make_queue()
    for i in range(3):
        make_message(f"u{i}@example.net", queue=queue)
    make_message("x@other.example")
    body = {"action": "remove", "filter": {"domain": "example.net"}, "ndr": False}
    response = client.post("/api/v1/messages/bulk/", body, format="json")
    assert response.status_code == 200
    assert response.json()["count"] == 3 and response.json()["confirmed"] is False
    assert not Recipient.objects.filter(state=RecipientState.FAILED).exists()
    assert not AuditEntry.objects.exists()
    response = client.post("/api/v1/messages/bulk/", {**body, "confirm": True}, format="json")
    assert response.json()["count"] == 3 and response.json()["confirmed"] is True
    assert Recipient.objects.filter(state=RecipientState.FAILED).count() == 3
    entry = AuditEntry.objects.get()
    assert (entry.action, entry.filter, entry.count) == (
        "message_remove",
        {"domain": "example.net"},
        3,
    )


@pytest.mark.parametrize(
    ("body", "detail"),
    [
        ({"action": "suspend"}, "give either ids or filter"),
        (
            {"action": "explode", "ids": [1]},
            "action: one of suspend, resume, resubmit, retry, remove",
        ),
        ({"action": "suspend", "filter": {"status": "lost"}}, "status: 'lost' is not one of"),
        ({"action": "suspend", "ids": ["x"]}, "ids: "),
    ],
)
def test_a_bulk_request_it_cannot_understand_is_a_400(client, body, detail):
    response = client.post("/api/v1/messages/bulk/", body, format="json")
    assert response.status_code == 400
    assert response.json()["detail"].startswith(detail)


def test_bulk_export_is_a_zip_of_the_exact_messages(client):
    a = make_message("a@example.net", subject="one")
    b = make_message("b@example.net", subject="two")
    make_message("c@example.net", subject="three")
    response = client.post(
        "/api/v1/messages/bulk-export/", {"filter": {"subject": "o"}}, format="json"
    )
    assert response.status_code == 200
    assert response["Content-Type"] == "application/zip"
    archive = zipfile.ZipFile(io.BytesIO(b"".join(response.streaming_content)))
    assert sorted(archive.namelist()) == sorted([f"{a.qid}.eml", f"{b.qid}.eml"])
    assert archive.read(f"{a.qid}.eml") == bytes(a.data)


def test_a_poison_message_can_be_listed_and_released(client):
    poison = make_queue("Poison", delivery_type=DeliveryType.POISON)
    message = make_message("u@example.net", queue=poison, rstate=RecipientState.DEFERRED)
    Message.objects.filter(pk=message.pk).update(suspended=True, crash_count=3)
    assert ids(client, f"queue={poison.pk}&status=suspended") == [message.pk]
    response = client.post(f"/api/v1/messages/{message.pk}/resume/")
    assert response.json()["status"] == "submission"


@pytest.mark.parametrize(
    "text",
    [
        "mailbox busy, try again in 300 seconds",
        "greylisted (see https://grey.example/3f2a9c?id=77) [retry+later]",
        "too many connections from 192.0.2.7",
        "quota exceeded: 10240K > 8192K *",
    ],
)
def test_an_error_group_finds_every_message_whose_error_normalises_to_it(client, text):
    from queues.filters import error_normalize, error_pattern

    queue = make_queue()
    message = make_message(
        "u@example.net", queue=queue, rstate=RecipientState.DEFERRED, last_text=text
    )
    make_message("v@example.net", queue=queue, rstate=RecipientState.DEFERRED, last_text="other")
    group = error_normalize(text)
    assert "#" in group and not any(c.isdigit() for c in group)
    import re

    assert re.search(error_pattern(group), text)
    assert ids(client, f"queue={queue.pk}&error_group={urllib.parse.quote(group)}") == [message.pk]


def test_export_in_replay_format_feeds_the_replay_folder():
    """The seed's path starts here: export in replay format (tests/test_pickup.py drops
    such a file in the replay folder and sees it delivered)."""
    from rest_framework.test import APIClient

    from queues.accept import IncomingEnvelope, IncomingRecipient, message_accept
    from queues.replay import replay_format
    from tests.support.operator_factories import make_user

    original = message_accept(
        IncomingEnvelope(
            mail_from="a@example.org",
            recipients=[IncomingRecipient("b@example.net", notify="FAILURE")],
            envid="E1",
        ),
        b"Subject: replay me\r\n\r\nbody\r\n",
    )
    client = APIClient()
    client.force_authenticate(make_user("operator", "op"))
    response = client.get(f"/api/v1/messages/{original.pk}/export/?format=replay")
    assert response.status_code == 200
    assert response["Content-Type"] == "message/rfc822"
    body = b"".join(response.streaming_content)
    assert body.startswith(b"X-Sender: <a@example.org> ENVID=E1\r\n")
    assert b"X-Receiver: <b@example.net> NOTIFY=FAILURE\r\n" in body
    assert body.endswith(bytes(Message.objects.get(pk=original.pk).data))
    assert body == replay_format(original, original.recipients.all())
