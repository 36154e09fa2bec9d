"""The Queue Viewer's pages and actions through Django's test client.

Rows are made directly (a queue, a link, messages accepted through the one
accept service and placed in the queue), so these tests need no DNS and no
SMTP peer; tests/test_ui_browser.py drives the whole engine in a browser.
"""

from __future__ import annotations

import io
import zipfile
from datetime import timedelta

import pytest
from django.urls import reverse

from queues.accept import IncomingEnvelope, IncomingRecipient, message_accept
from queues.lib import clock
from queues.models import (
    Attempt,
    AttemptOutcome,
    AttemptPhase,
    AuditEntry,
    DeliveryType,
    Event,
    Link,
    LinkState,
    Message,
    MessageState,
    Queue,
    Recipient,
    RecipientState,
)
from queues.services.counts import queues_recount
from tests.support.browser import make_user

pytestmark = pytest.mark.django_db


def body(subject: str = "Hello", text: str = "Hi there.\r\n") -> bytes:
    return (
        f"From: alice@example.org\r\nTo: bob@example.net\r\nSubject: {subject}\r\n\r\n{text}"
    ).encode()


def make_queue(name: str = "example.net", *, link_state: str = LinkState.READY) -> Queue:
    now = clock.now()
    link = Link.objects.create(
        name=f"mx:{name}",
        delivery_type=DeliveryType.DNS_MX,
        hosts=[{"host": f"mx.{name}", "port": 25, "preference": 10}],
        state=link_state,
        next_retry_at=now + timedelta(minutes=10) if link_state == LinkState.RETRY else None,
        last_error="connection refused by 192.0.2.1:25" if link_state == LinkState.RETRY else "",
        created_at=now,
    )
    return Queue.objects.create(
        name=name, delivery_type=DeliveryType.DNS_MX, link=link, created_at=now
    )


def queued(
    queue: Queue,
    *rcpts: str,
    sender: str = "alice@example.org",
    data: bytes | None = None,
    state: str = RecipientState.QUEUED,
    error: tuple[int, str, str] | None = None,
) -> Message:
    """A message accepted and routed to ``queue`` (as the categorizer would leave it)."""
    rcpts = rcpts or (f"bob@{queue.name}",)
    env = IncomingEnvelope(
        mail_from=sender,
        recipients=[IncomingRecipient(r, notify="FAILURE") for r in rcpts],
        client_address="192.0.2.7",
        client_helo="client.test",
        envid="ENV-1",
        ret="HDRS",
        body_type="8BITMIME",
    )
    message = message_accept(env, data if data is not None else body())
    Message.objects.filter(pk=message.pk).update(state=MessageState.QUEUED)
    changes = {"queue": queue, "state": state}
    if error is not None:
        code, enhanced, text = error
        changes.update(
            last_code=code,
            last_enhanced=enhanced,
            last_text=text,
            attempt_count=1,
            last_attempt_at=clock.now(),
        )
    Recipient.objects.filter(message=message).update(**changes)
    message.refresh_from_db()
    return message


@pytest.fixture
def operator(client):
    user = make_user("olga", "operator")
    client.force_login(user)
    return user


@pytest.fixture
def viewer(client):
    user = make_user("victor", "viewer")
    client.force_login(user)
    return user


# --- access -----------------------------------------------------------------------


def test_it_sends_anonymous_users_to_the_login_page(client):
    response = client.get("/queues/")
    assert response.status_code == 302
    assert response["Location"].startswith("/accounts/login/?next=/queues/")


def test_it_logs_in_through_the_form_and_lands_on_the_queues(client):
    make_user("olga", "operator")
    page = client.get("/accounts/login/")
    assert b'name="password"' in page.content
    response = client.post(
        "/accounts/login/", {"username": "olga", "password": "correct horse battery staple"}
    )
    assert response.status_code == 302
    assert client.get("/", follow=True).redirect_chain[-1][0] == "/queues/"


def test_it_refuses_a_signed_in_user_without_a_role(client):
    client.force_login(make_user("nobody", None))
    assert client.get("/queues/").status_code == 403
    assert client.get("/messages/").status_code == 403
    assert client.get("/live.json").status_code == 403


def test_it_gives_viewers_no_content_and_no_action_buttons(client, viewer):
    queue = make_queue()
    message = queued(queue, data=body(text="secret body\r\n"))
    page = client.get("/queues/").content.decode()
    assert "example.net" in page
    assert "data-action=" not in page and 'name="ids"' not in page
    detail = client.get(f"/messages/{message.pk}/").content.decode()
    assert "secret body" not in detail
    assert "Export .eml" not in detail and "Suspend" not in detail
    assert "shown to operators only" in detail
    listing = client.get("/messages/").content.decode()
    assert message.qid in listing and "Review…" not in listing


@pytest.mark.parametrize(
    ("method", "url"),
    [
        ("post", "/queues/{q}/suspend/"),
        ("post", "/queues/{q}/retry/"),
        ("post", "/queues/selected/"),
        ("post", "/queues/by-filter/"),
        ("post", "/messages/{m}/suspend/"),
        ("post", "/messages/{m}/remove_ndr/"),
        ("post", "/messages/selected/"),
        ("post", "/messages/by-filter/"),
        ("get", "/messages/by-filter/"),
        ("get", "/messages/{m}/export/"),
    ],
)
def test_it_answers_403_to_a_viewers_action(client, viewer, method, url):
    queue = make_queue()
    message = queued(queue)
    data = {"action": "suspend", "ids": [message.pk]} if method == "post" else {"action": "suspend"}
    response = getattr(client, method)(url.format(q=queue.pk, m=message.pk), data)
    assert response.status_code == 403
    queue.refresh_from_db()
    message.refresh_from_db()
    assert not queue.suspended and not message.suspended
    assert not AuditEntry.objects.exists()


# --- queues -----------------------------------------------------------------------


def test_it_lists_queues_with_status_count_error_and_next_retry(client, viewer):
    down = make_queue("down.example", link_state=LinkState.RETRY)
    queued(down, error=(451, "4.4.1", "connection refused"))
    make_queue("fine.example")
    queues_recount(clock.now())
    page = client.get("/queues/").content.decode()
    row = page[page.index('data-queue-name="down.example"') :]
    row = row[: row.index("</tr>")]
    assert "Retry" in row and "connection refused by 192.0.2.1:25" in row
    assert "in 10 min" in row or "in 9 min" in row
    assert ">1</a>" in row  # message count, from the queue row
    assert "DNS MX" in row and "mx:down.example" in row


def test_it_sorts_queues_by_name_both_ways(client, viewer):
    for name in ("b.example", "c.example", "a.example"):
        make_queue(name)
    up = client.get("/queues/?sort=name").content.decode()
    assert up.index("a.example") < up.index("b.example") < up.index("c.example")
    down = client.get("/queues/?sort=-name").content.decode()
    assert down.index("c.example") < down.index("b.example") < down.index("a.example")


def test_it_shows_the_qshape_summary(client, viewer):
    queue = make_queue()
    queued(queue)
    queued(queue)
    page = client.get("/queues/qshape/").content.decode()
    assert "TOTAL" in page and "example.net" in page and "1280+" in page
    by_domain = client.get("/queues/qshape/?by=domain").content.decode()
    assert "?domain=example.net" in by_domain


# --- messages ---------------------------------------------------------------------


def test_it_filters_messages_on_sender_domain_subject_and_error(client, viewer):
    queue = make_queue()
    other = make_queue("other.example")
    hit = queued(queue, sender="carol@shop.example", data=body("Invoice 42"))
    queued(queue, sender="dave@example.org")
    failing = queued(other, state=RecipientState.DEFERRED, error=(450, "4.2.1", "mailbox busy"))

    def qids(query: str) -> set[str]:
        page = client.get("/messages/?" + query).content.decode()
        return {m.qid for m in Message.objects.all() if m.qid in page}

    assert qids("sender=carol") == {hit.qid}
    assert qids("subject=invoice") == {hit.qid}
    assert qids("domain=other.example") == {failing.qid}
    assert qids("error=busy") == {failing.qid}
    assert qids("status=retry") == {failing.qid}
    assert qids(f"queue={other.pk}") == {failing.qid}


def test_it_pages_messages_by_keyset(client, viewer):
    queue = make_queue()
    made = [queued(queue, f"u{i}@example.net") for i in range(5)]
    first = client.get("/messages/?limit=2&sort=received")
    assert [r["message"].pk for r in first.context["rows"]] == [m.pk for m in made[:2]]
    cursor = first.context["page"].next_cursor
    second = client.get(f"/messages/?limit=2&sort=received&cursor={cursor}")
    assert [r["message"].pk for r in second.context["rows"]] == [m.pk for m in made[2:4]]
    assert 'rel="prev"' in second.content.decode()


def test_it_lists_a_page_of_messages_in_a_bounded_number_of_queries(
    client, viewer, django_assert_max_num_queries
):
    queue = make_queue()
    for i in range(30):
        queued(queue, f"u{i}@example.net", f"v{i}@example.net")
    # session + user + role, the page, its recipients, the totals and their recount
    # (counts lock, one statement over what the queues hold, the queue rows, their
    # update, in a savepoint): not one per message
    with django_assert_max_num_queries(15):
        response = client.get("/messages/?limit=30")
    assert len(response.context["rows"]) == 30


def test_it_explains_a_filter_it_cannot_read_and_offers_no_filter_action(client, operator):
    queued(make_queue())
    response = client.get("/messages/?older_than=yesterday-ish")
    assert response.status_code == 200
    page = response.content.decode()
    assert "older_than" in page
    assert response.context["rows"] == []
    # "by filter" on a filter that was not understood would select every message
    assert "Review…" not in page and 'id="by-filter"' not in page


def test_it_shows_a_message_with_envelope_recipients_attempts_and_events(client, operator):
    queue = make_queue()
    message = queued(queue, state=RecipientState.DEFERRED, error=(450, "4.2.1", "try later"))
    recipient = Recipient.objects.get(message=message)
    Attempt.objects.create(
        recipient=recipient,
        message=message,
        queue=queue,
        started_at=clock.now(),
        duration_ms=12,
        host="mx.example.net",
        ip="192.0.2.25",
        port=25,
        phase=AttemptPhase.RCPT,
        code=450,
        enhanced="4.2.1",
        text="try later",
        outcome=AttemptOutcome.DEFERRED,
    )
    Event.objects.create(created_at=clock.now(), kind="route", text="routed by MX", message=message)
    page = client.get(f"/messages/{message.pk}/").content.decode()
    for expected in (
        "&lt;alice@example.org&gt;",
        "BODY=8BITMIME",
        "RET=HDRS",
        "ENVID=ENV-1",
        "bob@example.net",
        "FAILURE",  # the recipient's NOTIFY
        "mx.example.net",
        "192.0.2.25:25",
        "450 4.2.1 try later",
        "routed by MX",
        "Received",  # our Received header, among the headers
        "Hi there.",
    ):
        assert expected in page, expected


def test_it_shows_the_body_as_escaped_text_never_as_html(client, operator):
    queue = make_queue()
    html = "<script>alert(1)</script><img src=x onerror=alert(2)>\r\n"
    message = queued(queue, data=body("<b>bold</b>", html))
    page = client.get(f"/messages/{message.pk}/").content.decode()
    assert "<script>alert(1)" not in page and "<img src=x" not in page
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in page
    assert "<b>bold</b>" not in page


# --- actions ----------------------------------------------------------------------


def test_it_suspends_and_resumes_a_queue_and_audits_both(client, operator):
    queue = make_queue()
    queued(queue)
    response = client.post(f"/queues/{queue.pk}/suspend/", {"next": "/queues/"}, follow=True)
    assert "Suspended queue example.net" in response.content.decode()
    queue.refresh_from_db()
    assert queue.suspended
    client.post(f"/queues/{queue.pk}/resume/")
    queue.refresh_from_db()
    assert not queue.suspended
    assert list(AuditEntry.objects.order_by("id").values_list("action", "via", "actor_name")) == [
        ("queue_suspend", "ui", "olga"),
        ("queue_resume", "ui", "olga"),
    ]


def test_it_shows_a_conflict_clearly_and_changes_nothing(client, operator):
    queue = make_queue()
    response = client.post(f"/queues/{queue.pk}/resume/", follow=True)
    text = response.content.decode()
    assert "Not done: queue example.net is not suspended" in text
    assert "Nothing was changed" in text
    message = queued(queue)
    Message.objects.filter(pk=message.pk).update(state=MessageState.DONE)
    response = client.post(f"/messages/{message.pk}/suspend/", follow=True)
    assert "is done" in response.content.decode()
    assert not Message.objects.get(pk=message.pk).suspended
    assert not AuditEntry.objects.exists()


def test_it_ignores_a_next_url_pointing_elsewhere(client, operator):
    queue = make_queue()
    response = client.post(f"/queues/{queue.pk}/suspend/", {"next": "https://evil.example/"})
    assert response["Location"] == "/queues/"


def test_it_acts_on_the_selected_queues(client, operator):
    a, b, c = make_queue("a.example"), make_queue("b.example"), make_queue("c.example")
    client.post("/queues/selected/", {"action": "suspend", "ids": [a.pk, b.pk]})
    assert set(Queue.objects.filter(suspended=True)) == {a, b}
    entry = AuditEntry.objects.get()
    assert (entry.action, entry.count, sorted(entry.target_ids)) == (
        "queue_suspend",
        2,
        sorted([a.pk, b.pk]),
    )
    assert not Queue.objects.get(pk=c.pk).suspended


def test_it_acts_on_the_selected_messages(client, operator):
    queue = make_queue()
    one, two, three = queued(queue), queued(queue), queued(queue)
    response = client.post(
        "/messages/selected/", {"action": "suspend", "ids": [one.pk, two.pk]}, follow=True
    )
    assert "2 of 2 selected messages changed" in response.content.decode()
    assert set(Message.objects.filter(suspended=True)) == {one, two}
    assert not Message.objects.get(pk=three.pk).suspended


def test_a_filter_action_shows_the_count_first_then_acts_on_confirm(client, operator):
    queue = make_queue()
    for i in range(3):
        queued(queue, sender=f"spam{i}@bulk.example")
    keep = queued(queue, sender="friend@example.org")
    page = client.get("/messages/by-filter/", {"action": "suspend", "sender": "bulk.example"})
    assert page.status_code == 200
    assert page.context["count"] == 3
    assert not Message.objects.filter(suspended=True).exists()  # nothing happens before confirm
    done = client.post(
        "/messages/by-filter/", {"action": "suspend", "sender": "bulk.example"}, follow=True
    )
    assert "3 matching messages changed" in done.content.decode()
    assert Message.objects.filter(suspended=True).count() == 3
    assert not Message.objects.get(pk=keep.pk).suspended
    entry = AuditEntry.objects.get()
    assert entry.filter == {"sender": "bulk.example"} and entry.count == 3


def test_it_removes_a_message_without_ndr(client, operator):
    queue = make_queue()
    message = queued(queue)
    client.post(f"/messages/{message.pk}/remove/")
    message.refresh_from_db()
    assert message.state == MessageState.DONE
    assert Recipient.objects.get(message=message).state == RecipientState.FAILED
    assert Message.objects.count() == 1  # no report was queued
    assert AuditEntry.objects.get().detail.startswith("without NDR; before: ")


def test_it_removes_a_message_with_an_ndr_to_the_sender(client, operator):
    queue = make_queue()
    message = queued(queue, sender="alice@example.org")
    client.post(f"/messages/{message.pk}/remove_ndr/")
    report = Message.objects.exclude(pk=message.pk).get()
    assert report.mail_from == ""
    assert Recipient.objects.get(message=report).address == "alice@example.org"


def test_it_exports_a_message_byte_for_byte(client, operator):
    queue = make_queue()
    raw = b"Subject: exact\r\nX-Odd:  spaced \r\n\r\n\xc3\xa9t\xc3\xa9 \r\n.\r\n"
    message = queued(queue, data=raw)
    response = client.get(f"/messages/{message.pk}/export/")
    assert response["Content-Type"] == "message/rfc822"
    assert f'filename="{message.qid}.eml"' in response["Content-Disposition"]
    content = b"".join(response.streaming_content)
    assert content == bytes(Message.objects.get(pk=message.pk).data)
    assert content.endswith(raw)
    assert response["Content-Length"] == str(len(content))
    assert AuditEntry.objects.get().action == "message_export"


def test_it_exports_the_selected_messages_as_a_zip(client, operator):
    queue = make_queue()
    one, two = queued(queue), queued(queue)
    response = client.post("/messages/selected/", {"action": "export", "ids": [one.pk, two.pk]})
    assert response["Content-Type"] == "application/zip"
    assert response.streaming  # from a temporary file, not built in memory
    archive = zipfile.ZipFile(io.BytesIO(b"".join(response.streaming_content)))
    assert sorted(archive.namelist()) == sorted([f"{one.qid}.eml", f"{two.qid}.eml"])
    assert archive.read(f"{one.qid}.eml") == bytes(Message.objects.get(pk=one.pk).data)


def test_it_asks_to_select_something_first(client, operator):
    response = client.post("/messages/selected/", {"action": "suspend"}, follow=True)
    assert "Select at least one message first" in response.content.decode()


# --- deferrals, audit, live -------------------------------------------------------


def test_it_groups_deferrals_by_normalised_error_and_links_to_the_messages(client, viewer):
    queue = make_queue()
    for i in range(3):
        queued(
            queue,
            state=RecipientState.DEFERRED,
            error=(451, "4.7.1", f"greylisted for {300 + i}s id {i}A{i}F"),
        )
    queued(queue, state=RecipientState.DEFERRED, error=(452, "4.2.2", "mailbox full"))
    response = client.get("/deferrals/")
    page = response.content.decode()
    assert "greylisted for # id #" in page
    groups = response.context["destinations"][0]["groups"]
    counts = {item["group"].text: item["group"].recipients for item in groups}
    assert counts == {"greylisted for # id #": 3, "mailbox full": 1}
    link = next(i["query"] for i in groups if i["group"].recipients == 3)
    listed = client.get("/messages/?" + link).context["rows"]
    assert len(listed) == 3


def test_it_shows_the_audit_log(client, operator):
    queue = make_queue()
    client.post(f"/queues/{queue.pk}/suspend/")
    page = client.get("/audit/").content.decode()
    assert "queue_suspend" in page and "olga" in page
    assert client.get("/audit/?action=message_remove").context["entries"] == []


def test_the_live_endpoint_reports_counts_states_and_history(client, viewer):
    queue = make_queue("down.example", link_state=LinkState.RETRY)
    message = queued(queue, state=RecipientState.DEFERRED, error=(421, "4.4.2", "timeout"))
    queues_recount(clock.now())
    clock.advance(timedelta(minutes=1))
    queues_recount(clock.now())
    data = client.get(
        "/live.json", {"queues": str(queue.pk), "messages": str(message.pk), "history": "1"}
    ).json()
    assert data["totals"]["messages"] == 1 and data["totals"]["retry_queues"] == 1
    q = data["queues"][str(queue.pk)]
    assert (q["count"], q["status"]) == (1, "retry")
    assert q["next_retry"].startswith("in ")
    assert data["messages"][str(message.pk)]["status"] == "retry"
    assert [p["depth"] for p in data["history"]] == [1, 1]
    assert reverse("ui:live") == "/live.json"


def test_a_queue_filter_action_counts_first_then_acts(client, operator):
    make_queue("a.example")
    make_queue("b.example")
    make_queue("other.test")
    page = client.get("/queues/by-filter/", {"action": "suspend", "name": ".example"})
    assert page.context["count"] == 2
    assert not Queue.objects.filter(suspended=True).exists()
    client.post("/queues/by-filter/", {"action": "suspend", "name": ".example"})
    assert set(Queue.objects.filter(suspended=True).values_list("name", flat=True)) == {
        "a.example",
        "b.example",
    }
    assert AuditEntry.objects.get().filter == {"name": ".example"}


def test_it_exports_every_message_of_a_filter_as_a_zip(client, operator):
    queue = make_queue()
    wanted = queued(queue, sender="carol@example.org")
    queued(queue, sender="dave@example.org")
    confirm = client.get("/messages/by-filter/", {"action": "export", "sender": "carol"})
    assert confirm.context["count"] == 1
    response = client.post("/messages/by-filter/", {"action": "export", "sender": "carol"})
    archive = zipfile.ZipFile(io.BytesIO(b"".join(response.streaming_content)))
    assert archive.namelist() == [f"{wanted.qid}.eml"]


def test_it_refuses_an_unknown_action(client, operator):
    queue = make_queue()
    message = queued(queue)
    assert client.post(f"/queues/{queue.pk}/explode/").status_code == 400
    assert client.post(f"/messages/{message.pk}/explode/").status_code == 400
    assert client.post("/messages/selected/", {"action": "explode"}).status_code == 400
    assert client.get("/messages/by-filter/", {"action": "explode"}).status_code == 400
    assert not AuditEntry.objects.exists()
