"""MAILRELAY_DELIVERY_ROUND_WAIT and MAILRELAY_CATEGORIZER_BATCH_WAIT: a link's
delivery task lets the next round gather what arrives while the last one was
not full, and a categorize task its next batch (issue #14: a round or a batch
costs the same statements for 3 messages or 40, so fewer, larger ones cost
less per message). The first never waits, nor a round after one of at least
as many recipients as the link may open connections, nor a batch after a
full one.

Real PostgreSQL, a real sink on loopback and the loopback DNS server; only
the waits themselves are observed (``deliver._round_wait``,
``tasks._batch_wait``), and what arrives during one is accepted and
categorized for real.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta

import pytest

from delivery.qmgr import tasks
from delivery.qmgr.tasks import categorize_pending
from delivery.smtp import deliver
from queues.accept import IncomingEnvelope, IncomingRecipient, message_accept
from queues.models import Link, Message, MessageState

pytestmark = pytest.mark.django_db

BODY = b"From: a@example.org\r\nTo: x\r\nSubject: round wait\r\n\r\nbody\r\n"


@pytest.fixture
def relay(dns_settings, settings, smtp_port, sink_factory):
    settings.MAILRELAY_REMOTE_SMTP_PORT = smtp_port
    settings.MAILRELAY_SMTP_CONNECT_TIMEOUT = timedelta(seconds=2)
    settings.MAILRELAY_SMTP_CLIENT_TIMEOUT = timedelta(seconds=5)
    dns_settings.a("example.net", "127.0.0.2")
    return sink_factory("127.0.0.2")


def submit(n: int, tag: str) -> None:
    for i in range(n):
        message_accept(
            IncomingEnvelope(
                mail_from="a@example.org",
                recipients=[IncomingRecipient(f"{tag}{i}@example.net")],
                client_address="127.0.0.1",
                client_helo="client.test",
            ),
            BODY,
        )


def arrive(n: int, tag: str) -> None:
    """``n`` messages accepted and categorized: due on the link."""
    submit(n, tag)
    while categorize_pending():
        pass


Install = Callable[[Callable[[], None] | None], list[float]]


def recorder(monkeypatch, owner: object, name: str) -> Install:
    """Replace ``owner.name`` (a wait) with one that records its waits; ``during``
    runs in the first one (mail arriving meanwhile)."""

    def install(during: Callable[[], None] | None = None) -> list[float]:
        seen: list[float] = []

        def sleep(seconds: float) -> None:
            seen.append(seconds)
            if during is not None and len(seen) == 1:
                during()

        monkeypatch.setattr(owner, name, sleep)
        return seen

    return install


@pytest.fixture
def waits(monkeypatch) -> Install:
    """The delivery task's waits between rounds."""
    return recorder(monkeypatch, deliver, "_round_wait")


def link_id() -> int:
    return Link.objects.get().pk


def test_what_arrives_during_the_wait_goes_in_the_same_task_s_next_round(relay, waits):
    arrive(3, "first")
    seen = waits(lambda: arrive(4, "later"))
    assert deliver.deliver_link(link_id()) == 7
    # Waited after the round of 3 (the default, 50 ms) and after the round of 4;
    # the round after that found nothing and the task ended.
    assert seen == [0.05, 0.05]
    assert len(relay.messages) == 7
    assert set(Message.objects.values_list("state", flat=True)) == {MessageState.DONE}


def test_no_wait_before_the_first_round_or_after_one_of_as_many_as_connections(
    relay, waits, settings
):
    settings.MAILRELAY_MAX_CONNECTIONS_PER_DESTINATION = 2
    settings.MAILRELAY_MAX_MESSAGES_PER_CONNECTION = 2  # a full round: 4 recipients
    arrive(8, "full")
    seen = waits()
    assert deliver.deliver_link(link_id()) == 8  # rounds of 4 and 4, then none due
    assert seen == []
    arrive(6, "busy")
    assert deliver.deliver_link(link_id()) == 6  # 4, then 2: as many as connections
    assert seen == []
    arrive(5, "odd")
    assert deliver.deliver_link(link_id()) == 5  # 4, then 1 (fewer), a wait
    assert seen == [0.05]
    assert len(relay.messages) == 19


def test_zero_turns_the_wait_off(relay, waits, settings):
    settings.MAILRELAY_DELIVERY_ROUND_WAIT = timedelta(0)
    arrive(2, "now")
    seen = waits()
    assert deliver.deliver_link(link_id()) == 2
    assert seen == []


# ------------------------------------------------ MAILRELAY_CATEGORIZER_BATCH_WAIT


@pytest.fixture
def batch_waits(monkeypatch) -> Install:
    """The categorize task's waits between batches."""
    return recorder(monkeypatch, tasks, "_batch_wait")


def test_the_categorizer_gathers_what_arrives_during_its_wait(relay, batch_waits):
    submit(3, "first")
    seen = batch_waits(lambda: submit(4, "later"))
    assert tasks.categorize() == 7  # one task: the batch of 3, a wait, the batch of 4
    assert seen == [0.05, 0.05]  # after each batch that was not full; then none due
    assert Message.objects.filter(state=MessageState.QUEUED).count() == 7


def test_the_categorizer_does_not_wait_after_a_full_batch(relay, batch_waits, settings):
    settings.MAILRELAY_CATEGORIZER_BATCH = 2
    submit(4, "full")
    seen = batch_waits()
    assert tasks.categorize() == 4  # batches of 2 and 2 (full), then none due
    assert seen == []
    settings.MAILRELAY_CATEGORIZER_BATCH_WAIT = timedelta(0)
    submit(1, "off")
    assert tasks.categorize() == 1
    assert seen == []
