"""The new pages in a real browser: the top bar's age alert, a queue's own page
refreshing its chart live, the explain block with its action, the Incidents page."""

from __future__ import annotations

from datetime import timedelta

import pytest
from playwright.sync_api import expect

from insight import alerts
from queues.lib import clock
from queues.models import LinkState, Queue, QueueSample, Recipient, RecipientState
from tests.support import browser as browser_support
from tests.support.browser import login, make_user, off_loop
from tests.support.operator_factories import make_link, make_message, make_queue

browser = browser_support.browser
page = browser_support.page
pytestmark = pytest.mark.django_db(transaction=True)


def _setup() -> tuple[Queue, int]:
    now = clock.now()
    make_user("olga", "operator")
    link = make_link(
        "contoso.com",
        hosts=[{"host": "contoso-com.mail.protection.outlook.com", "port": 25, "preference": 0}],
        state=LinkState.RETRY,
        failure_count=2,
        first_failure_at=now - timedelta(minutes=2),
        next_retry_at=now + timedelta(minutes=1),
        last_tls="TLSv1.3 verified (ca)",
    )
    q = make_queue("contoso.com", link=link)
    m = make_message(
        "u@contoso.com",
        queue=q,
        rstate=RecipientState.DEFERRED,
        last_text="Server busy, try again later",
        last_attempt_at=now - timedelta(minutes=1),
        first_failure_at=now - timedelta(minutes=2),
    )
    Recipient.objects.filter(message=m).update(next_attempt_at=link.next_retry_at)
    Queue.objects.filter(pk=q.pk).update(
        message_count=1, oldest_received_at=now - timedelta(minutes=90)
    )
    QueueSample.objects.create(sampled_at=now - timedelta(minutes=1), queue=q, seconds=60, depth=1)
    alerts.evaluate(now)
    return q, m.pk


def test_queue_page_explain_and_incidents_in_a_browser(page, live_server):
    page.add_init_script("window.mailrelayPollMs = 300;")
    q, message_id = off_loop(_setup)
    login(page, "olga")
    expect(page.locator("#topbar")).to_have_attribute("data-alert-level", "warning")

    # The queue list links to the queue's own page; its chart fills and refreshes.
    page.locator(f'a[href="/queues/{q.pk}/"]').click()
    expect(page.locator("h1")).to_contain_text("contoso.com")
    expect(page.locator("[data-q=tls]")).to_have_text("TLSv1.3 verified (ca)")
    expect(page.locator("[data-q=reason]")).to_have_text("link_retry")
    expect(page.locator("#queue-chart")).to_have_attribute("data-points", "1")
    off_loop(
        lambda: QueueSample.objects.create(
            sampled_at=clock.now(), queue_id=q.pk, seconds=60, depth=3
        )
    )
    expect(page.locator("#queue-chart")).to_have_attribute("data-points", "2")
    expect(page.locator("#queue-chart path[data-series=deferred]")).to_have_count(1)

    # The message page explains it and offers the way out.
    page.goto(f"/messages/{message_id}/")
    row = page.locator("#explain tr[data-reason=link_retry]")
    expect(row).to_contain_text("is in glitch retry")
    expect(row.locator("[data-schedule-kind=expires]")).to_have_count(1)
    row.locator("[data-explain-action=queue-retry]").click()
    expect(page.get_by_role("status")).to_contain_text("Retrying")

    # Incidents: the provider behind the MX.
    page.get_by_role("link", name="Incidents", exact=True).click()
    expect(page.locator('#incidents tr[data-provider="outlook.com"]')).to_contain_text(
        "contoso.com"
    )
