"""Incidents: two customer domains behind one provider's MX hosts are one incident;
/deferrals/ and /api/v1/errors/ read the refreshed summary at scale."""

from __future__ import annotations

from datetime import timedelta

import pytest

from insight import deferrals
from insight.deferrals import error_groups
from insight.incidents import incidents, registered_domain
from queues.lib import clock
from queues.models import RecipientState
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


def test_the_stored_summary_is_bounded_and_incidents_are_read_from_it(
    settings, client, django_assert_max_num_queries
):
    """Per queue its largest groups plus one "other errors" row; incidents stored
    aggregated, so a read at scale is a couple of indexed queries."""
    from insight.models import DeferralGroup, IncidentSummary

    settings.MAILRELAY_INSIGHT_LIVE_LIMIT = 1
    a = _behind("contoso.com", "contoso-com.mail.protection.outlook.com")
    b = _behind("fabrikam.com", "fabrikam-com.mail.protection.outlook.com")
    # 23 distinct errors in contoso.com (one recipient each), one error three times.
    for i in range(23):
        _deferred(a, f"u{i}@contoso.com", f"policy rule {chr(97 + i)} hit (id 1{i})", "s@x")
    for i in range(3):
        _deferred(a, f"v{i}@contoso.com", f"greylisted, see https://g.example/{i}f3a9c", "s@x")
    _deferred(b, "w@fabrikam.com", "greylisted, see https://g.example/77ab0", "t@x")
    live = incidents(clock.now())
    deferrals.refresh(clock.now())
    rows = DeferralGroup.objects.filter(queue=a)
    assert rows.count() == 21  # 20 largest + other
    other = rows.get(other=True)
    assert (other.text, other.recipients) == ("(other errors)", 26 - 3 - 19)
    assert rows.order_by("other", "-recipients")[0].text == "greylisted, see https:#"
    assert sum(r.recipients for r in DeferralGroup.objects.all()) == 27
    # Incidents come from every group (not the bounded rows), stored aggregated.
    assert IncidentSummary.objects.filter(by_error=False).count() == 24
    with django_assert_max_num_queries(3):  # the refresh state, then one query per kind
        found = incidents(clock.now())
    assert found.as_of is not None and found.deferred == 27
    top = found.by_provider[0]
    assert (top.provider, top.error, top.recipients) == (
        "outlook.com",
        "greylisted, see https:#",
        4,
    )
    assert [q["name"] for q in top.queues] == ["contoso.com", "fabrikam.com"]
    assert top.queue_count == 2
    assert [i.as_dict() for i in found.by_provider] == [i.as_dict() for i in live.by_provider]
    assert [i.as_dict() for i in found.by_error] == [i.as_dict() for i in live.by_error]
    # The errors API and the deferrals page: the "other" row links to the queue's retries.
    body = api_client(make_user("viewer")).get(f"/api/v1/errors/?queue={a.pk}").json()
    assert len(body) == 21
    merged = [g for g in body if g["other"]]
    assert len(merged) == 1 and "error_group" not in merged[0]["messages"]
    client.force_login(make_user("viewer", "v2"))
    page = client.get(f"/deferrals/?queue={a.pk}").content.decode()
    assert "(other errors)" in page and f"queue={a.pk}&amp;status=retry" in page


def test_sql_and_python_normalise_alike():
    """What the summary groups on (SQL, then Python) is what error_group filters on."""
    from django.db import connection

    from queues.filters import ERROR_TOKEN_SQL, error_normalize

    texts = [
        "greylisted, see https://grey.example/5d41402abc4b2a76b9719d911017c592",
        "Grüße5 from mx٣ (٣٣ tries)",
        "too many connections from 192.0.2.7",
        "a²b 1 x_9=y/z-3+q",
        "tab\t1  two",
    ]
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT regexp_replace(t, %s, '#', 'g') FROM unnest(%s::text[]) WITH ORDINALITY "
            "AS u(t, n) ORDER BY n",
            [ERROR_TOKEN_SQL, texts],
        )
        in_sql = [error_normalize(row[0]) for row in cursor.fetchall()]
    assert in_sql == [error_normalize(t) for t in texts]
    assert in_sql[1] == "Grüß# from mx٣ (٣٣ tries)"
    # Every text is found by the filter of its own group.
    q = _behind("contoso.com", "mx.contoso.com")
    for i, t in enumerate(texts):
        _deferred(q, f"u{i}@contoso.com", t, "s@x")
    api = api_client(make_user("viewer"))
    for norm in in_sql:
        found = api.get("/api/v1/messages/", {"error_group": norm}).json()
        rows = found["results"] if isinstance(found, dict) else found
        assert len(rows) >= 1, norm
