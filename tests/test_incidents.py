"""Incidents: two customer domains behind one provider's MX hosts are one incident;
/deferrals/ and /api/v1/errors/ read the refreshed summary at scale."""

from __future__ import annotations

from datetime import timedelta

import pytest

from insight import deferrals
from insight.incidents import incidents, registered_domain
from queues import clock
from queues.models import RecipientState
from queues.services.counts import error_groups
from tests.support.operator_factories import (
    api_client,
    make_link,
    make_message,
    make_queue,
    make_user,
)

pytestmark = pytest.mark.django_db


def _behind(domain: str, mx: str):
    link = make_link(domain, hosts=[{"host": mx, "port": 25, "preference": 0, "literal": False}])
    return make_queue(domain, link=link)


def _deferred(queue, rcpt: str, text: str, sender: str, minutes_ago: int = 5):
    now = clock.now()
    return make_message(
        rcpt,
        sender=sender,
        queue=queue,
        rstate=RecipientState.DEFERRED,
        last_text=text,
        last_code=451,
        last_enhanced="4.7.500",
        first_failure_at=now - timedelta(minutes=minutes_ago + 30),
        last_attempt_at=now - timedelta(minutes=minutes_ago),
    )


def test_registered_domain():
    assert registered_domain("contoso-com.mail.protection.outlook.com") == "outlook.com"
    assert registered_domain("mx1.example.co.uk.") == "example.co.uk"
    assert registered_domain("[192.0.2.1]") == "192.0.2.1"


def test_two_domains_behind_one_provider_are_one_incident():
    a = _behind("contoso.com", "contoso-com.mail.protection.outlook.com")
    b = _behind("fabrikam.com", "fabrikam-com.mail.protection.outlook.com")
    other = _behind("example.org", "mx.example.org")
    err = "Server busy. Please try again later. [BN8NAM11FT012.eop-nam11.prod]"
    _deferred(a, "u1@contoso.com", err.replace("012", "345"), "s1@x.example")
    _deferred(a, "u2@contoso.com", err, "s2@x.example", minutes_ago=45)
    _deferred(b, "u3@fabrikam.com", err.replace("012", "999"), "s1@x.example")
    _deferred(other, "u4@example.org", "greylisted", "s3@x.example")
    found = incidents(clock.now())
    top = found.by_provider[0]
    assert top.provider == "outlook.com"
    assert top.recipients == 3 and top.senders == 3  # distinct per queue, summed
    assert sorted(q["name"] for q in top.queues) == ["contoso.com", "fabrikam.com"]
    assert top.codes == ["451 4.7.500"]
    assert sum(top.trend) == 3 and top.trend[-1] == 2
    assert top.first_seen is not None and top.last_seen > top.first_seen
    assert [i.provider for i in found.by_provider] == ["outlook.com", "example.org"]
    body = api_client(make_user("viewer")).get("/api/v1/incidents/").json()
    assert body["incidents"][0]["provider"] == "outlook.com"
    assert body["incidents"][0]["recipients"] == 3
    assert body["as_of"] is None and body["deferred"] == 4


def test_the_pages_and_the_stored_summary_at_scale(settings, client):
    q = _behind("contoso.com", "contoso-com.mail.protection.outlook.com")
    _deferred(q, "u1@contoso.com", "try again in 30 seconds", "s@x.example")
    client.force_login(make_user("viewer"))
    page = client.get("/incidents/").content.decode()
    assert 'data-provider="outlook.com"' in page and "contoso.com" in page
    # At scale the summary is read instead of grouping live: a refresh stores it...
    settings.MAILRELAY_INSIGHT_LIVE_LIMIT = 1
    state = deferrals.refresh(clock.now())
    assert state.deferred == 1
    _deferred(q, "u2@contoso.com", "try again in 60 seconds", "s@x.example")
    # ...so a new deferral shows only after the next refresh, and the answer says when.
    assert [g.recipients for g in error_groups()] == [1]
    body = api_client(make_user("viewer", "v2")).get("/api/v1/errors/").json()
    assert body[0]["recipients"] == 1
    assert api_client(make_user("viewer", "v3")).get("/api/v1/incidents/").json()["as_of"]
    deferrals.refresh(clock.now())
    assert [g.recipients for g in error_groups()] == [2]
    assert [g.recipients for g in error_groups(q.pk)] == [2]
    assert "As of" in client.get("/incidents/").content.decode()
    # Below the limit, live again.
    settings.MAILRELAY_INSIGHT_LIVE_LIMIT = 100
    _deferred(q, "u3@contoso.com", "try again in 9 seconds", "s@x.example")
    assert [g.recipients for g in error_groups()] == [3]
