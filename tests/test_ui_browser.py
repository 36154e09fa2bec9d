"""The Queue Viewer in a real browser (Playwright driving Debian's Chromium).

An operator logs in, finds a message by filter, suspends its queue and sees
delivery stop, resumes it and sees the message delivered at the sink,
exports a message and compares the bytes, removes a message with an NDR and
finds the NDR at the sender's sink; a viewer sees no actions and gets 403.

The engine runs in-process (tests/support/pipeline.drain) against the
loopback DNS server and real SMTP sinks; the web app is pytest-django's
live server. Set MAILRELAY_SCREENSHOTS=/some/dir to keep a 1280×800
screenshot of every page the test visits.
"""

from __future__ import annotations

import os
import re
from datetime import timedelta
from pathlib import Path

import pytest
from playwright.sync_api import expect

from delivery.qmgr.tasks import categorize_pending
from queues.accept import IncomingEnvelope, IncomingRecipient, message_accept
from queues.lib import clock
from queues.models import Message, MessageState, Queue, Recipient, RecipientState
from queues.services.counts import queues_recount
from tests.support import browser as browser_support
from tests.support.browser import login, make_user, off_loop
from tests.support.pipeline import drain

# The fixtures of tests/support/browser.py, used by name below.
browser = browser_support.browser
page = browser_support.page
pytestmark = pytest.mark.django_db(transaction=True)

SHOTS = os.environ.get("MAILRELAY_SCREENSHOTS", "")


def shot(page, name: str) -> None:
    if SHOTS:
        Path(SHOTS).mkdir(parents=True, exist_ok=True)
        page.screenshot(path=str(Path(SHOTS) / f"{name}.png"))


def accept(sender: str, rcpt: str, subject: str, text: str = "Hello.\r\n") -> Message:
    data = f"From: {sender}\r\nTo: {rcpt}\r\nSubject: {subject}\r\n\r\n{text}".encode()
    env = IncomingEnvelope(
        mail_from=sender,
        recipients=[IncomingRecipient(rcpt)],
        client_address="127.0.0.1",
        client_helo="client.test",
    )
    return message_accept(env, data)


def engine_round() -> None:
    """What the workers and the sweep would do: route, deliver what is due, recount."""
    off_loop(drain)
    queues_recount(clock.now())


@pytest.fixture
def relay(dns_settings, settings, smtp_port, sink_factory):
    settings.MAILRELAY_REMOTE_SMTP_PORT = smtp_port
    settings.MAILRELAY_SMTP_CONNECT_TIMEOUT = timedelta(seconds=2)
    settings.MAILRELAY_SMTP_CLIENT_TIMEOUT = timedelta(seconds=5)
    dns_settings.a("example.net", "127.0.0.2")  # the recipients' MX
    dns_settings.a("example.org", "127.0.0.3")  # the senders' MX: NDRs arrive here
    dns_settings.a("stuck.example", "127.0.0.4")  # nothing listens: stays deferred
    return {"recipients": sink_factory("127.0.0.2"), "senders": sink_factory("127.0.0.3")}


@pytest.fixture
def fast_polling(page):
    page.add_init_script("window.mailrelayPollMs = 300;")
    return page


def test_an_operator_steers_the_queues_and_a_viewer_may_only_look(
    relay, page, fast_polling, browser, live_server
):
    sink, senders = relay["recipients"], relay["senders"]
    make_user("olga", "operator")
    make_user("victor", "viewer")
    report = accept("carol@example.org", "bob@example.net", "Quarterly report")
    accept("dave@example.org", "erin@example.net", "Lunch?")
    stuck = accept("alice@example.org", "frank@stuck.example", "Never arrives")
    off_loop(categorize_pending)
    queues_recount(clock.now())

    # Log in, find the message by filter.
    login(page, "olga")
    expect(page.locator("#queues")).to_contain_text("example.net")
    shot(page, "queues")
    page.get_by_role("link", name="Messages", exact=True).click()
    page.locator("#f-sender").fill("carol")
    page.get_by_role("button", name="Filter").click()
    rows = page.locator("#messages tbody tr")
    expect(rows).to_have_count(1)
    expect(rows.first).to_contain_text(report.qid)
    expect(rows.first).to_contain_text("Quarterly report")
    shot(page, "messages-filtered")

    # Suspend its queue: delivery stops.
    page.get_by_role("link", name="Queues", exact=True).click()
    row = page.locator('tr[data-queue-name="example.net"]')
    row.get_by_role("button", name="Suspend").click()
    expect(page.get_by_role("status")).to_contain_text("Suspended queue example.net")
    expect(row.locator("[data-live=status]")).to_have_text("Suspended")
    engine_round()
    assert not sink.messages
    assert Recipient.objects.get(message=report).state == RecipientState.QUEUED

    # Resume it: the message is delivered at the sink, and the page sees it by itself.
    row.get_by_role("button", name="Resume").click()
    expect(row.locator("[data-live=status]")).not_to_have_text("Suspended")
    page.goto(f"/messages/{report.pk}/")
    status = page.locator("#message-status")
    expect(status).to_have_text("Ready")
    engine_round()
    assert sink.wait_for(2)
    delivered = next(m for m in sink.messages if m.rcpt_tos == ["bob@example.net"])
    assert delivered.data == bytes(Message.objects.get(pk=report.pk).data)
    expect(status).to_have_text("Delivered")  # live update, no reload
    shot(page, "message-detail")

    # Export a message: exactly the stored bytes.
    with page.expect_download() as download_info:
        page.get_by_role("link", name="Export .eml").click()
    download = download_info.value
    assert download.suggested_filename == f"{report.qid}.eml"
    assert Path(download.path()).read_bytes() == bytes(Message.objects.get(pk=report.pk).data)

    # The stuck message waits after a failure; remove it with an NDR.
    engine_round()
    page.get_by_role("link", name="Deferrals", exact=True).click()
    expect(page.locator("[data-deferral-queue]")).to_contain_text("stuck.example")
    shot(page, "deferrals")
    page.goto(f"/messages/{stuck.pk}/")
    page.once("dialog", lambda dialog: dialog.accept())
    page.get_by_role("button", name="Remove with NDR").click()
    expect(page.get_by_role("status")).to_contain_text(f"Removed with NDR message {stuck.qid}")
    expect(page.locator("#message-status")).to_have_text("Failed")
    engine_round()
    assert senders.wait_for(1)
    ndr = senders.messages[0]
    assert ndr.mail_from == "<>" and ndr.rcpt_tos == ["alice@example.org"]  # the null sender
    assert b"multipart/report" in ndr.data and b"frank@stuck.example" in ndr.data
    assert Message.objects.get(pk=stuck.pk).state == MessageState.DONE

    # The audit log shows what the operator did.
    page.get_by_role("link", name="Audit log").click()
    audit = page.locator("#audit")
    for action in ("queue_suspend", "queue_resume", "message_export", "message_remove"):
        expect(audit).to_contain_text(action)
    shot(page, "audit")
    page.goto("/queues/qshape/")
    shot(page, "qshape")

    # A viewer sees no buttons and gets 403 when posting anyway.
    viewer_context = browser.new_context(
        viewport={"width": 1280, "height": 800}, base_url=live_server.url
    )
    try:
        viewer = viewer_context.new_page()
        login(viewer, "victor")
        expect(viewer.locator("#queues")).to_contain_text("example.net")
        expect(viewer.get_by_role("button", name="Suspend")).to_have_count(0)
        shot(viewer, "queues-viewer")
        token = next(c["value"] for c in viewer_context.cookies() if c["name"] == "csrftoken")
        queue = Queue.objects.get(name="example.net")
        response = viewer.request.post(
            f"/queues/{queue.pk}/suspend/", headers={"X-CSRFToken": token}, max_redirects=0
        )
        assert response.status == 403
        assert "operator role" in response.text()
        assert viewer.request.get(f"/messages/{report.pk}/export/").status == 403
        assert not Queue.objects.get(pk=queue.pk).suspended
    finally:
        viewer_context.close()


def test_a_filter_action_counts_first_and_acts_after_the_confirmation(relay, page):
    make_user("olga", "operator")
    for i in range(3):
        accept(f"news{i}@bulk.example", f"u{i}@example.net", f"Offer {i}")
    accept("friend@example.org", "me@example.net", "Personal")
    off_loop(categorize_pending)

    login(page, "olga")
    page.goto("/messages/?sender=bulk.example")
    expect(page.locator("#messages tbody tr")).to_have_count(3)
    page.locator("#filter-action").select_option("suspend")
    page.get_by_role("button", name="Review…").click()
    expect(page.locator("#confirm-count")).to_have_text("3")
    shot(page, "confirm")
    assert not Message.objects.filter(suspended=True).exists()
    page.get_by_role("button", name=re.compile(r"^Suspend 3 messages")).click()
    expect(page.get_by_role("status")).to_contain_text("3 matching messages changed")
    expect(page.locator("#messages [data-live=status]")).to_have_text(["Suspended"] * 3)
    assert Message.objects.filter(suspended=True).count() == 3


def test_ticked_remove_asks_first_and_a_dead_letter_queue_shows_its_messages(page, live_server):
    """Issue #23: "Selected: Remove…" shows what it would do and to which messages
    before it acts; the Dead-letter queue's page lists what it holds."""

    def setup() -> tuple[Message, Message, int, Message]:
        from queues.models import DeliveryType

        make_user("olga", "operator")
        queue = Queue.objects.create(name="example.net", created_at=clock.now())
        dead = Queue.objects.create(
            name="Dead-letter", delivery_type=DeliveryType.DEAD_LETTER, created_at=clock.now()
        )
        keep = accept("alice@example.org", "keep@example.net", "keep")
        drop = accept("alice@example.org", "drop@example.net", "drop")
        gone = accept("alice@example.org", "gone@example.net", "gone")
        Recipient.objects.filter(message__in=[keep, drop]).update(
            queue=queue, state=RecipientState.QUEUED
        )
        Recipient.objects.filter(message=gone).update(
            queue=dead, state=RecipientState.FAILED, final_at=clock.now()
        )
        Message.objects.filter(pk__in=[keep.pk, drop.pk]).update(state=MessageState.QUEUED)
        Message.objects.filter(pk=gone.pk).update(state=MessageState.DONE)
        return keep, drop, dead.pk, gone

    keep, drop, dead_id, gone = off_loop(setup)
    login(page, "olga")
    page.goto("/messages/")
    page.locator(f'tr[data-message-id="{drop.pk}"] input[name=ids]').check()
    page.get_by_role("button", name="Remove without NDR").first.click()
    expect(page.locator("#confirm-sample")).to_contain_text(drop.qid)
    expect(page.locator("#confirm-count")).to_have_text("1")
    assert off_loop(lambda: Recipient.objects.get(message=drop).state) == RecipientState.QUEUED
    page.locator("#confirm-button").click()
    expect(page.get_by_role("status")).to_contain_text("1 of 1 selected messages changed")
    states = off_loop(lambda: {m.pk: Recipient.objects.get(message=m).state for m in (keep, drop)})
    assert states == {keep.pk: RecipientState.QUEUED, drop.pk: RecipientState.FAILED}

    page.goto(f"/queues/{dead_id}/")
    expect(page.locator("#queue-depth")).to_have_text("1")
    expect(page.locator("#queue-messages")).to_contain_text(gone.qid)
    expect(page.locator('#queue-offers [data-offer="resubmit"]')).to_have_count(1)


def test_the_relays_own_pages_back_pressure_alerts_and_dkim_keys(page, settings):
    """Reached from the navigation: back pressure and alerts for every role, DKIM
    keys for admins (generate one, read its record, disable it)."""
    from insight.tasks import refresh
    from tests.test_system_pages import save

    settings.MAILRELAY_DKIM_KEYS_DIR = ""
    settings.MAILRELAY_ALERT_OLDEST_AGE = timedelta(hours=1)
    save("mx1:100", submission_queue=5)
    queue = Queue.objects.create(
        name="slow.example", delivery_type="dns_mx", created_at=clock.now()
    )
    Queue.objects.filter(pk=queue.pk).update(oldest_received_at=clock.now() - timedelta(hours=2))
    refresh()
    make_user("ada", "admin")
    login(page, "ada")
    nav = page.locator("header nav")
    nav.get_by_role("link", name="Back pressure").click()
    row = page.locator('[data-node="mx1:100"] tr[data-resource="submission_queue"]')
    expect(row).to_have_attribute("data-level", "medium")
    expect(row.locator("[data-reading]")).to_have_text("5")
    expect(row.locator("[data-action]")).to_have_text("tarpit 15 s")
    shot(page, "backpressure")
    nav.get_by_role("link", name=re.compile(r"^Alerts")).click()
    expect(page.locator(f'tr[data-alert="age:queue:{queue.pk}"]')).to_contain_text("slow.example")
    shot(page, "alerts")
    nav.get_by_role("link", name="DKIM keys").click()
    expect(page.locator("#dkim-keys")).to_contain_text("No DKIM keys")
    page.get_by_label("Domain").fill("example.org")
    page.get_by_label("Selector").fill("s1")
    page.get_by_label("Algorithm").select_option("ed25519")
    page.get_by_role("button", name="Generate").click()
    expect(page.locator("#generated [data-zone-line]")).to_contain_text(
        's1._domainkey.example.org. IN TXT "v=DKIM1; k=ed25519; p='
    )
    key = page.locator('tr[data-key="s1._domainkey.example.org"]')
    expect(key).to_have_attribute("data-state", "signing")
    shot(page, "dkim")
    key.get_by_role("button", name="Disable").click()
    expect(page.locator('tr[data-key="s1._domainkey.example.org"]')).to_have_attribute(
        "data-state", "disabled"
    )
    expect(page.get_by_role("status")).to_contain_text("s1._domainkey.example.org disabled.")
