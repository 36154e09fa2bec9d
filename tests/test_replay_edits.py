"""Dead-letter replay with envelope edits: a dead letter resubmitted to a
corrected recipient or sender, the stored bytes untouched, audited with what
the envelope was and what it became; delivered to a real SMTP sink.
"""

from __future__ import annotations

import io

import pytest
from django.core.management import call_command
from django.core.management.base import CommandError

from queues.lib import clock
from queues.models import (
    AuditEntry,
    DeliveryType,
    Message,
    MessageState,
    Recipient,
    RecipientState,
)
from queues.services.actions import ActionConflict, ActionInvalid, Via, message_resubmit
from tests.support.operator_factories import api_client, make_message, make_queue, make_user
from tests.support.pipeline import drain

pytestmark = pytest.mark.django_db


@pytest.fixture
def relay(settings, smtp_port, sink_factory):
    settings.MAILRELAY_TRANSPORTS = (
        f"example.net=[127.0.0.2]:{smtp_port},example.com=[127.0.0.2]:{smtp_port}"
    )
    return sink_factory("127.0.0.2")


@pytest.fixture
def dead():
    return make_queue("Dead-letter", delivery_type=DeliveryType.DEAD_LETTER)


def _dead_letter(dead, *rcpts: str, sender: str = "a@example.org") -> Message:
    message = make_message(
        *rcpts,
        queue=dead,
        rstate=RecipientState.FAILED,
        last_text="550 5.1.1 no such user",
        sender=sender,
    )
    assert message.state == MessageState.DONE
    return message


@pytest.fixture
def olga():
    return make_user("operator", "olga")


def test_a_dead_letter_goes_to_the_corrected_recipient_with_its_bytes_untouched(relay, dead, olga):
    message = _dead_letter(dead, "jonh@example.net")
    stored = bytes(Message.objects.get(pk=message.pk).data)
    assert message_resubmit(message, olga, Via.UI, recipient="john@example.com") == 1
    rcpt = Recipient.objects.get(message=message)
    assert (rcpt.address, rcpt.domain, rcpt.state) == (
        "john@example.com",
        "example.com",
        RecipientState.SUBMITTED,
    )
    message.refresh_from_db()
    assert message.state == MessageState.SUBMISSION and message.expires_at > clock.now()
    entry = AuditEntry.objects.get()
    assert (entry.action, entry.actor_name, entry.target_ids) == (
        "message_resubmit",
        "olga",
        [message.pk],
    )
    assert entry.detail.splitlines() == [
        "before: done, recipients failed; after: submission, recipients submitted",
        "recipient: jonh@example.net → john@example.com",
    ]
    drain()
    (got,) = relay.messages
    assert (got.mail_from, got.rcpt_tos) == ("a@example.org", ["john@example.com"])
    assert got.data == stored
    assert bytes(Message.objects.get(pk=message.pk).data) == stored


def test_a_corrected_sender_and_the_null_sender(relay, dead, olga):
    message = _dead_letter(dead, "u@example.net", sender="bad@@example.org")
    message_resubmit(message, olga, Via.API, sender="<good@example.org>")
    drain()
    assert relay.messages[-1].mail_from == "good@example.org"
    assert "sender: <bad@@example.org> → <good@example.org>" in AuditEntry.objects.get().detail
    other = _dead_letter(dead, "v@example.net")
    message_resubmit(other, olga, Via.API, sender="<>")
    assert Message.objects.get(pk=other.pk).mail_from == ""


def test_with_several_dead_recipients_the_one_to_correct_is_named(relay, dead, olga):
    message = _dead_letter(dead, "a@example.net", "bx@example.net")
    with pytest.raises(ActionConflict, match="has 2 dead recipients"):
        message_resubmit(message, olga, Via.CLI, recipient="b@example.net")
    with pytest.raises(ActionConflict, match="no dead recipient c@example.net"):
        message_resubmit(message, olga, Via.CLI, recipient="c@example.net=b@example.net")
    message_resubmit(message, olga, Via.CLI, recipient="BX@example.net=b@example.net")
    assert sorted(Recipient.objects.filter(message=message).values_list("address", flat=True)) == [
        "a@example.net",
        "b@example.net",
    ]
    drain()
    assert sorted(relay.messages[0].rcpt_tos) == ["a@example.net", "b@example.net"]


def test_edits_are_checked_as_smtp_checks_addresses_and_change_nothing_when_refused(
    relay, dead, olga
):
    message = _dead_letter(dead, "u@example.net")
    for recipient, reason in (
        ("not an address", "is not an address"),
        ("<>", "<> is not a recipient"),
        ("user", "has no domain"),
        ("a%b@example.net", "sender-specified routing"),
        ("jörg@example.net", "not ASCII"),
    ):
        with pytest.raises(ActionInvalid, match=reason):
            message_resubmit(message, olga, Via.CLI, recipient=recipient)
    assert Recipient.objects.get(message=message).address == "u@example.net"
    assert Message.objects.get(pk=message.pk).state == MessageState.DONE
    live = make_message("w@example.net", queue=make_queue("example.net"))
    with pytest.raises(ActionConflict, match="is not a dead letter"):
        message_resubmit(live, olga, Via.CLI, recipient="x@example.net")
    assert not AuditEntry.objects.exists()


def test_every_edge_takes_the_edits(relay, dead, olga, client):
    api = api_client(olga)
    one = _dead_letter(dead, "one@example.net")
    response = api.post(
        f"/api/v1/messages/{one.pk}/resubmit/",
        {"recipient": "uno@example.net", "sender": "s@example.org"},
        format="json",
    )
    assert response.status_code == 200
    assert Message.objects.get(pk=one.pk).mail_from == "s@example.org"
    bulk = {"action": "resubmit", "ids": [one.pk], "recipient": "x@example.net"}
    response = api.post("/api/v1/messages/bulk/", bulk, format="json")
    assert (response.status_code, response.json()) == (
        400,
        {"detail": "recipient: resubmit takes no recipient (in bulk)"},
    )
    two = _dead_letter(dead, "two@example.net")
    bad = api.post(f"/api/v1/messages/{two.pk}/resubmit/", {"recipient": "x y"}, format="json")
    assert bad.status_code == 400 and bad.json()["detail"].startswith("recipient: 'x y'")
    call_command(
        "message", "resubmit", two.qid, "--set-recipient", "dos@example.net", stdout=io.StringIO()
    )
    assert Recipient.objects.get(message=two).address == "dos@example.net"
    three = _dead_letter(dead, "three@example.net")
    with pytest.raises(CommandError, match="resubmit takes no recipient"):
        call_command(
            "message",
            "resubmit",
            "--domain",
            "example.net",
            "--set-recipient",
            "x@example.net",
            "--yes",
            stdout=io.StringIO(),
        )
    client.force_login(olga)
    page = client.get(f"/messages/{three.pk}/").content.decode()
    assert 'id="resubmit-edits"' in page
    client.post(f"/messages/{three.pk}/resubmit/", {"recipient": "tres@example.net"})
    assert Recipient.objects.get(message=three).address == "tres@example.net"
    assert AuditEntry.objects.filter(action="message_resubmit").count() == 3
