"""The Queue Viewer's pages of the relay itself, through Django's test client:
back pressure and alerts (viewer), DKIM keys (admin). Each shows what its API
or command shows; tests/test_ui_browser.py opens them in Chromium."""

from __future__ import annotations

import html
import re
from datetime import timedelta

import pytest
from django.test import Client

from delivery.backpressure import store
from delivery.backpressure.engine import PressureState, Resource, TarpitConfig
from delivery.models import ResourcePressure
from insight.tasks import refresh
from queues import dkim
from queues.lib import clock
from queues.models import AuditEntry, DkimKey, Queue
from tests.support.operator_factories import make_queue, make_user
from tests.test_backpressure_monitor import RESOURCES, quiet_samplers


def save(node: str, **readings: float) -> None:
    """Two monitoring intervals of ``node`` at ``readings``, saved with their level changes."""
    samplers = quiet_samplers()
    for name, value in readings.items():
        samplers[Resource(name)].set(value)
    state = PressureState(RESOURCES, TarpitConfig(10, 5, 55))
    for _ in range(2):
        snapshot, transitions = state.observe({r: s.read() for r, s in samplers.items()})
        store.pressure_save(node, snapshot, transitions)


pytestmark = pytest.mark.django_db


def client_for(role: str | None, name: str | None = None) -> Client:
    client = Client()
    client.force_login(make_user(role, name or f"{role}-user"))
    return client


def test_the_back_pressure_page_shows_each_nodes_levels_history_and_readings():
    save("mx1:100", submission_queue=5)
    save("mx2:200")
    ResourcePressure.objects.filter(node="mx2:200").update(
        updated_at=clock.now() - timedelta(minutes=5)
    )
    page = client_for("viewer").get("/backpressure/")
    assert page.status_code == 200
    text = page.content.decode()
    nodes = re.findall(r'data-node="([^"]+)"', text)
    assert nodes == ["mx1:100", "mx2:200"]
    mx1, mx2 = text.split('data-node="mx2:200"')
    assert "data-stale" in mx2 and "data-stale" not in mx1
    row = re.search(r'<tr data-resource="submission_queue".*?</tr>', mx1, re.S)[0]
    assert 'data-level="medium"' in row
    assert re.search(r"data-reading>\s*5\s*<", row)
    assert "2 / 4 / 10" in row  # normal / medium / high
    assert re.findall(r'class="lv lv-(\w+)">', row) == ["medium", "medium"]  # the history
    assert "tarpit 15 s" in row
    assert len(re.findall(r"<tr data-resource=", mx1)) == len(Resource)
    changes = text.split('id="backpressure-changes"')[1]
    assert "submission queue rose from normal to medium on mx1:100" in html.unescape(changes)
    nav = text.split("</nav>")[0]
    assert 'href="/backpressure/"' in nav and 'href="/alerts/"' in nav


def test_the_back_pressure_page_says_when_no_node_reports():
    text = client_for("viewer").get("/backpressure/").content.decode()
    assert 'id="no-nodes"' in text


def test_the_alerts_page_lists_the_alerts_in_force_and_their_history(settings):
    settings.MAILRELAY_ALERT_OLDEST_AGE = timedelta(hours=1)
    slow = make_queue("slow.example")
    make_queue("fine.example")
    viewer = client_for("viewer")
    assert "No alert in force." in viewer.get("/alerts/").content.decode()
    Queue.objects.filter(pk=slow.pk).update(oldest_received_at=clock.now() - timedelta(hours=3))
    refresh()
    text = viewer.get("/alerts/").content.decode()
    rows = re.findall(r'<tr data-alert="([^"]+)" data-level="(\w+)">', text)
    assert rows == [(f"age:queue:{slow.pk}", "critical")]
    assert f'href="/queues/{slow.pk}/"' in text and "fine.example" not in text
    history = text.split('id="alert-history"')[1]
    assert "raised" in history
    assert 'href="/alerts/"' in text.split("</header>")[0]  # the top bar's alert links here
    Queue.objects.filter(pk=slow.pk).update(oldest_received_at=clock.now())
    refresh()
    text = viewer.get("/alerts/").content.decode()
    assert "No alert in force." in text and "cleared" in text.split('id="alert-history"')[1]


def test_dkim_keys_are_for_admins_only():
    for role in (None, "viewer", "operator"):
        client = client_for(role)
        assert client.get("/dkim/").status_code == 403
        assert client.post("/dkim/", {"domain": "example.com", "selector": "s1"}).status_code == 403
        assert 'href="/dkim/"' not in client.get("/alerts/").content.decode()
    assert not DkimKey.objects.exists()
    assert Client().get("/dkim/").status_code == 302  # to the login page


def test_an_admin_generates_a_key_sees_its_record_and_disables_it(settings):
    settings.MAILRELAY_DKIM_KEYS_DIR = ""
    admin = client_for("admin", "ada")
    assert 'href="/dkim/"' in admin.get("/alerts/").content.decode()
    made = admin.post("/dkim/", {"domain": "Example.COM", "selector": "s1", "algorithm": "rsa"})
    assert made.status_code == 200
    key = DkimKey.objects.get()
    assert (key.domain, key.selector, key.algorithm, key.enabled) == (
        "example.com",
        "s1",
        "rsa-sha256",
        True,
    )
    text = made.content.decode()
    shown = html.unescape(re.search(r'id="generated".*?data-zone-line>(.*?)</pre>', text, re.S)[1])
    assert shown.startswith('s1._domainkey.example.com. IN TXT "v=DKIM1; k=rsa; p=')
    assert "".join(re.findall(r'"([^"]*)"', shown)) == dkim.dns_record(key.private_key)
    assert key.private_key.splitlines()[1] not in text  # the private key is never shown
    assert 'data-key="s1._domainkey.example.com" data-state="signing"' in text
    assert dkim.load_keys("")["example.com"].selector == "s1"  # the relay signs with it
    again = admin.post("/dkim/", {"domain": "example.com", "selector": "s1"})
    assert again.status_code == 400 and "exists" in html.unescape(again.content.decode())
    bad = admin.post("/dkim/", {"domain": "not a domain", "selector": "s2"})
    assert bad.status_code == 400 and DkimKey.objects.count() == 1
    done = admin.post("/dkim/example.com/s1/disable/", follow=True)
    assert "s1._domainkey.example.com disabled." in done.content.decode()
    assert 'data-key="s1._domainkey.example.com" data-state="disabled"' in done.content.decode()
    assert not DkimKey.objects.get().enabled and "example.com" not in dkim.load_keys("")
    assert admin.post("/dkim/example.com/s1/frobnicate/").status_code == 404
    assert list(
        AuditEntry.objects.filter(target_type="dkim_key")
        .order_by("id")
        .values_list("action", "via", "actor_name")
    ) == [("dkim_generate", "ui", "ada"), ("dkim_disable", "ui", "ada")]


def test_a_key_file_is_listed_with_its_record_and_cannot_be_disabled_here(settings, tmp_path):
    settings.MAILRELAY_DKIM_KEYS_DIR = str(tmp_path)
    private = dkim.generate_private_key(dkim.ED25519_SHA256)
    (tmp_path / dkim.key_file_name("example.org", "e1")).write_bytes(private)
    admin = client_for("admin")
    text = admin.get("/dkim/").content.decode()
    assert 'data-key="e1._domainkey.example.org" data-state="signing"' in text
    assert html.escape(dkim.dns_record(private)) in text
    refused = admin.post("/dkim/example.org/e1/disable/", follow=True).content.decode()
    assert "remove the file to retire it" in refused
    assert (tmp_path / dkim.key_file_name("example.org", "e1")).exists()


def test_the_command_disables_and_enables_a_database_key(settings):
    import io

    from django.core.management import CommandError, call_command

    settings.MAILRELAY_DKIM_KEYS_DIR = ""
    call_command("dkim", "generate", "example.net", "--selector", "s1", stdout=io.StringIO())
    out = io.StringIO()
    call_command("dkim", "disable", "example.net", "--selector", "s1", stdout=out)
    assert out.getvalue().strip() == "s1._domainkey.example.net disabled"
    assert "example.net" not in dkim.load_keys("")
    call_command("dkim", "enable", "example.net", "--selector", "s1", stdout=out)
    assert dkim.load_keys("")["example.net"].selector == "s1"
    with pytest.raises(CommandError, match="no key s9._domainkey.example.net"):
        call_command("dkim", "disable", "example.net", "--selector", "s9")
    assert list(
        AuditEntry.objects.filter(target_type="dkim_key")
        .order_by("id")
        .values_list("action", "via")
    ) == [("dkim_generate", "cli"), ("dkim_disable", "cli"), ("dkim_enable", "cli")]
