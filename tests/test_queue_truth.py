"""The Queue Viewer tells the truth (issue #23): one definition of what a queue
holds behind every count, list, page, API field, CLI table and action; counts
exact when read (or dated); the special queues show and act on their messages;
the earliest next attempt; retry now per message; removals ask first."""

from __future__ import annotations

import io
import re
import threading
from datetime import timedelta

import pytest
from django.core.management import call_command
from django.db import connection

from delivery.qmgr.sweep import _links_with_due_work
from delivery.qmgr.tasks import categorize_pending
from delivery.smtp.deliver import deliver_link
from queues.accept import IncomingEnvelope, IncomingRecipient, message_accept
from queues.holdings import held_count
from queues.lib import clock
from queues.models import (
    AuditEntry,
    DeliveryType,
    Link,
    LinkState,
    Message,
    MessageState,
    Queue,
    Recipient,
    RecipientState,
)
from queues.services.counts import queues_recount
from tests.support.operator_factories import api_client, make_message, make_queue, make_user


def run(*args: str) -> str:
    out = io.StringIO()
    call_command(*args, stdout=out, stderr=io.StringIO())
    return out.getvalue()


def cli_counts() -> dict[str, int]:
    rows = run("queue", "list").splitlines()[1:]
    return {line.split()[1]: int(line.split()[4]) for line in rows if line.split()[0].isdigit()}


def api_counts(client) -> dict[str, int]:
    return {q["name"]: q["message_count"] for q in client.get("/api/v1/queues/").json()["results"]}


@pytest.mark.django_db
def test_counts_are_exact_when_read_without_waiting_for_a_recount(client):
    queue = make_queue("example.net")
    for i in range(3):
        make_message(f"u{i}@example.net", queue=queue)
    make_message("busy@example.net", queue=queue, rstate=RecipientState.ACTIVE)
    client.force_login(make_user("viewer"))
    page = client.get("/queues/")
    assert page.context["totals"]["messages"] == 4
    assert page.context["totals"]["as_of"] == ""  # counted for this read
    row = next(r for r in page.context["rows"] if r["queue"].pk == queue.pk)
    assert row["queue"].message_count == 4
    api = api_client(make_user("operator", "olga"))
    listed = api.get("/api/v1/queues/").json()
    assert listed["counts"]["exact"] is True
    assert api_counts(api)["example.net"] == 4
    assert api.get(f"/api/v1/queues/{queue.pk}/").json()["count_age_seconds"] == 0
    assert cli_counts()["example.net"] == 4
    assert client.get("/live.json").json()["totals"]["messages"] == 4


@pytest.mark.django_db
def test_above_the_live_limit_every_view_says_how_old_its_counts_are(client, settings):
    settings.MAILRELAY_LIVE_COUNTS_UP_TO = 0
    queue = make_queue("example.net")
    make_message("u@example.net", queue=queue)
    queues_recount(clock.now())
    make_message("v@example.net", queue=queue)  # after the recount: not in its count
    clock.advance(timedelta(seconds=12))
    client.force_login(make_user("viewer"))
    page = client.get("/queues/")
    assert page.context["totals"]["messages"] == 1
    assert 'id="counts-as-of">as of 12 s ago<' in page.content.decode()
    listed = api_client(make_user("operator", "olga")).get("/api/v1/queues/").json()
    assert listed["counts"]["exact"] is False and listed["counts"]["age_seconds"] == 12
    assert "message counts as of 12 s ago (the sweep's recount)" in run("queue", "list")


@pytest.mark.django_db
def test_the_dead_letter_queue_shows_resubmits_and_exports_its_messages(client):
    dead = make_queue("Dead-letter", delivery_type=DeliveryType.DEAD_LETTER)
    gone = make_message(
        "gone@example.net", queue=dead, rstate=RecipientState.FAILED, last_text="550 no user"
    )
    late = make_message("late@example.net", queue=dead, rstate=RecipientState.FAILED)
    operator = make_user("operator", "olga")
    client.force_login(operator)
    page = client.get(f"/queues/{dead.pk}/")
    text = page.content.decode()
    assert re.search(r'id="queue-depth">\s*2\s*<', text)
    assert gone.qid in text and late.qid in text  # the messages it holds, on its page
    assert "Nothing waiting." not in text
    listed = client.get(f"/messages/?queue={dead.pk}").context["rows"]
    assert {r["message"].pk for r in listed} == {gone.pk, late.pk}
    # Resubmit all, with a preview listing them; export; never a retry button.
    assert f'?action=resubmit&amp;queue={dead.pk}" data-offer="resubmit"' in text
    assert f'?action=export&amp;queue={dead.pk}" data-offer="export"' in text
    queues_page = client.get("/queues/").content.decode()
    row = queues_page[queues_page.index(f'data-queue-id="{dead.pk}"') :].split("</tr>")[0]
    assert 'data-action="retry"' not in row and 'data-offer="resubmit"' in row
    preview = client.get("/messages/by-filter/", {"action": "resubmit", "queue": dead.pk})
    assert [m["id"] for m in preview.context["sample"]] == [gone.pk, late.pk]
    assert cli_counts()["Dead-letter"] == 2
    api = api_client(operator)
    refused = api.post(f"/api/v1/queues/{dead.pk}/retry/")
    assert refused.status_code == 409 and "resubmit" in refused.json()["detail"]
    done = api.post(f"/api/v1/queues/{dead.pk}/resubmit/")
    assert done.status_code == 200, done.content
    assert set(Message.objects.values_list("state", flat=True)) == {MessageState.SUBMISSION}
    assert api_counts(api)["Dead-letter"] == 0
    assert (
        "has no messages waiting: it holds none"
        in (api.post(f"/api/v1/queues/{dead.pk}/resubmit/").json()["detail"])
    )


@pytest.mark.django_db
def test_the_poison_queue_offers_resubmit_remove_and_export_not_retry(client):
    poison = make_queue("Poison", delivery_type=DeliveryType.POISON)
    crashed = make_message("crash@example.net", queue=poison, rstate=RecipientState.DEFERRED)
    Message.objects.filter(pk=crashed.pk).update(suspended=True, crash_count=3)
    client.force_login(make_user("operator", "olga"))
    text = client.get(f"/queues/{poison.pk}/").content.decode()
    assert crashed.qid in text
    for offer in ("resubmit", "remove", "remove_ndr", "export"):
        assert f'data-offer="{offer}"' in text
    preview = client.get("/messages/by-filter/", {"action": "remove_ndr", "queue": poison.pk})
    assert preview.context["count"] == 1
    assert [m["id"] for m in preview.context["sample"]] == [crashed.pk]
    refused = api_client(make_user("operator", "otto")).post(f"/api/v1/queues/{poison.pk}/retry/")
    assert refused.status_code == 409 and "no next hop" in refused.json()["detail"]


@pytest.mark.django_db
def test_the_queue_list_shows_the_earliest_next_attempt_of_a_problem_message(client):
    queue = make_queue("soft.test")  # its link is Ready: no link retry time
    message = make_message("u@soft.test", queue=queue, rstate=RecipientState.DEFERRED)
    later = clock.now() + timedelta(minutes=15)
    Recipient.objects.filter(message=message).update(next_attempt_at=later)
    Message.objects.filter(pk=message.pk).update(problem=True)
    client.force_login(make_user("viewer"))
    row = next(r for r in client.get("/queues/").context["rows"] if r["queue"].pk == queue.pk)
    assert row["next_retry_at"] == later and row["next_retry"].startswith("in 1")
    api = api_client(make_user("operator", "olga"))
    shown = api.get(f"/api/v1/queues/{queue.pk}/").json()
    assert shown["next_attempt_at"].startswith(later.strftime("%Y-%m-%dT%H:%M:%S"))
    assert later.strftime("%Y-%m-%d %H:%M:%S") in run("queue", "list")
    # A link in Retry later than the recipient: not before the link's retry time.
    link_retry = clock.now() + timedelta(minutes=40)
    Link.objects.filter(pk=queue.link_id).update(state=LinkState.RETRY, next_retry_at=link_retry)
    shown = api.get(f"/api/v1/queues/{queue.pk}/").json()
    assert shown["next_attempt_at"].startswith(link_retry.strftime("%Y-%m-%dT%H:%M:%S"))


@pytest.mark.django_db
def test_retry_now_for_one_message_in_ui_api_and_cli(client):
    queue = make_queue("down.example")
    later = clock.now() + timedelta(minutes=15)
    Link.objects.filter(pk=queue.link_id).update(state=LinkState.RETRY, next_retry_at=later)
    made = [
        make_message(f"u{i}@down.example", queue=queue, rstate=RecipientState.DEFERRED)
        for i in range(3)
    ]
    Recipient.objects.update(next_attempt_at=later)
    operator = make_user("operator", "olga")

    def due(message: Message) -> bool:
        return Recipient.objects.get(message=message).next_attempt_at <= clock.now()

    answer = api_client(operator).post(f"/api/v1/messages/{made[0].pk}/retry/")
    assert answer.status_code == 200, answer.content
    assert due(made[0]) and not due(made[1])
    assert Link.objects.get(pk=queue.link_id).next_retry_at is None  # the link is tried now
    client.force_login(operator)
    client.post(f"/messages/{made[1].pk}/retry/")
    assert due(made[1]) and not due(made[2])
    assert "retry: " in run("message", "retry", made[2].qid)
    assert due(made[2])
    assert list(AuditEntry.objects.values_list("action", "via")) == [
        ("message_retry", "api"),
        ("message_retry", "ui"),
        ("message_retry", "cli"),
    ]
    again = api_client(operator).post(f"/api/v1/messages/{made[0].pk}/retry/")
    assert again.status_code == 409 and "due already" in again.json()["detail"]
    Message.objects.filter(pk=made[0].pk).update(suspended=True)
    held = api_client(operator).post(f"/api/v1/messages/{made[0].pk}/retry/")
    assert held.status_code == 409 and "suspended" in held.json()["detail"]


@pytest.mark.django_db
def test_removing_ticked_messages_asks_first_and_lists_them(client):
    queue = make_queue("example.net")
    first = make_message("a@example.net", queue=queue)
    second = make_message("b@example.net", queue=queue)
    client.force_login(make_user("operator", "olga"))
    for action in ("remove", "remove_ndr"):
        asked = client.post("/messages/selected/", {"action": action, "ids": [first.pk, second.pk]})
        assert asked.status_code == 200
        assert asked.context["count"] == 2
        assert [m["id"] for m in asked.context["sample"]] == [first.pk, second.pk]
        text = asked.content.decode()
        assert first.qid in text and 'name="confirmed" value="1"' in text
        assert set(Recipient.objects.values_list("state", flat=True)) == {RecipientState.QUEUED}
        assert not AuditEntry.objects.exists()
    done = client.post(
        "/messages/selected/", {"action": "remove", "ids": [first.pk], "confirmed": "1"}
    )
    assert done.status_code == 302
    assert Recipient.objects.get(message=first).state == RecipientState.FAILED
    assert Recipient.objects.get(message=second).state == RecipientState.QUEUED


# --- counts read while mail flows ---------------------------------------------------


@pytest.fixture
def relay(dns_settings, settings, smtp_port):
    settings.MAILRELAY_REMOTE_SMTP_PORT = smtp_port
    settings.MAILRELAY_SMTP_CONNECT_TIMEOUT = timedelta(seconds=2)
    settings.MAILRELAY_SMTP_CLIENT_TIMEOUT = timedelta(seconds=5)
    return dns_settings


def _accept(rcpt: str) -> None:
    env = IncomingEnvelope(
        mail_from="a@example.org",
        recipients=[IncomingRecipient(rcpt)],
        client_address="127.0.0.1",
        client_helo="client.test",
    )
    message_accept(env, b"From: a@example.org\r\nSubject: t\r\n\r\nhi\r\n")


@pytest.mark.django_db(transaction=True)
def test_counts_read_while_mail_is_accepted_and_delivered_match_the_database(
    relay, sink_factory, client
):
    relay.mx("example.net", [(10, "mx.example.net")])
    relay.a("mx.example.net", "127.0.0.2")
    relay.mx("held.example", [(10, "mx.held.example")])
    relay.a("mx.held.example", "127.0.0.3")
    sink = sink_factory("127.0.0.2")
    held = make_queue("held.example", suspended=True)  # its mail stays: its count only grows
    client.force_login(make_user("viewer"))
    sent = 20
    failures: list[BaseException] = []

    def traffic() -> None:
        try:
            for i in range(sent):
                _accept(f"u{i}@example.net")
                _accept(f"h{i}@held.example")
                if i % 4 == 3:
                    categorize_pending()
                    for link_id in _links_with_due_work():
                        deliver_link(link_id)
        except BaseException as exc:  # noqa: BLE001 - reported by the reader
            failures.append(exc)
        finally:
            connection.close()

    worker = threading.Thread(target=traffic)
    worker.start()
    reads = 0
    while worker.is_alive() or reads < 3:
        before = held_count(held)
        page = client.get("/queues/")
        after = held_count(held)
        rows = {r["queue"].name: r["queue"].message_count for r in page.context["rows"]}
        # The held queue's count is what the database held at one moment of the read.
        assert before <= rows.get("held.example", 0) <= after
        assert 0 <= rows.get("example.net", 0) <= sent
        # The header and the rows are one count.
        assert page.context["totals"]["messages"] == sum(
            n for name, n in rows.items() if name != "Dead-letter"
        )
        reads += 1
    worker.join()
    assert not failures, failures
    while categorize_pending():
        pass
    for link_id in _links_with_due_work():
        deliver_link(link_id)
    assert len(sink.messages) == sent
    truth = {q.name: held_count(q) for q in Queue.objects.all()}
    assert truth["held.example"] == sent and truth["example.net"] == 0
    page = client.get("/queues/")
    assert {r["queue"].name: r["queue"].message_count for r in page.context["rows"]} == truth
    assert api_counts(api_client(make_user("operator", "olga"))) == truth
    assert {name: n for name, n in cli_counts().items()} == truth
