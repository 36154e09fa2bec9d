"""REST API: authentication, roles, the audit log and the OpenAPI schema."""

import re

import pytest
from django.core.management import call_command

from queues.models import AuditEntry, Message
from queues.permissions import user_role
from tests.support.operator_factories import api_client, make_message, make_queue, make_user

pytestmark = pytest.mark.django_db

READS = [
    "/api/v1/queues/",
    "/api/v1/links/",
    "/api/v1/messages/",
    "/api/v1/audit/",
    "/api/v1/qshape/",
    "/api/v1/errors/",
    "/api/v1/queues/history/",
]


@pytest.mark.parametrize("url", READS)
def test_an_anonymous_request_is_a_401(url):
    response = api_client(None).get(url)
    assert response.status_code == 401
    assert response.json() == {"detail": "Authentication credentials were not provided."}
    assert response["WWW-Authenticate"] == "Token"


def test_an_anonymous_action_is_a_401_and_changes_nothing():
    queue = make_queue()
    assert api_client(None).post(f"/api/v1/queues/{queue.pk}/suspend/").status_code == 401
    assert not AuditEntry.objects.exists()


def test_a_bad_token_is_a_401():
    client = api_client(None)
    client.credentials(HTTP_AUTHORIZATION="Token not-a-token")
    assert client.get("/api/v1/queues/").status_code == 401


@pytest.mark.parametrize("url", READS)
def test_a_user_without_a_role_is_a_403(url):
    response = api_client(make_user(None, "nobody")).get(url)
    assert response.status_code == 403
    assert "no Queue Viewer role" in response.json()["detail"]


@pytest.mark.parametrize("url", READS)
def test_a_viewer_reads_everything(url):
    assert api_client(make_user("viewer")).get(url).status_code == 200


def test_a_viewers_actions_are_403_and_change_nothing():
    viewer = api_client(make_user("viewer"))
    message = make_message("u@example.net", queue=make_queue())
    for verb in ("suspend", "resume", "resubmit", "remove"):
        assert viewer.post(f"/api/v1/messages/{message.pk}/{verb}/").status_code == 403
    assert viewer.get(f"/api/v1/messages/{message.pk}/export/").status_code == 403
    body = {"action": "suspend", "ids": [message.pk]}
    assert viewer.post("/api/v1/messages/bulk/", body, format="json").status_code == 403
    assert (
        viewer.post(
            "/api/v1/messages/bulk-export/", {"ids": [message.pk]}, format="json"
        ).status_code
        == 403
    )
    assert not Message.objects.get(pk=message.pk).suspended
    assert not AuditEntry.objects.exists()


def test_admins_are_superusers_or_members_of_the_admin_group():
    assert user_role(make_user("superuser", "root")) == "admin"
    assert user_role(make_user("admin", "ada")) == "admin"
    assert user_role(make_user("operator", "olga")) == "operator"
    assert user_role(make_user(None, "nobody")) is None
    admin = api_client(make_user("admin", "adam"))
    message = make_message("u@example.net", queue=make_queue())
    assert admin.post(f"/api/v1/messages/{message.pk}/suspend/").status_code == 200


def test_the_roles_exist_after_migrating():
    from django.contrib.auth.models import Group

    assert set(Group.objects.values_list("name", flat=True)) >= {"viewer", "operator", "admin"}


def test_session_authentication_works_for_the_browser():
    from django.test import Client

    user = make_user("viewer", "vera")
    client = Client()
    client.force_login(user)
    assert client.get("/api/v1/queues/").status_code == 200


def test_drf_create_token_makes_a_token_that_authenticates(capsys):
    make_user("operator", "olga")
    call_command("drf_create_token", "olga")
    key = capsys.readouterr().out.split()[2]
    from rest_framework.test import APIClient

    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Token {key}")
    assert client.get("/api/v1/queues/").status_code == 200


def test_the_audit_log_lists_newest_first_and_filters():
    operator = api_client(make_user("operator", "olga"))
    queue = make_queue()
    operator.post(f"/api/v1/queues/{queue.pk}/suspend/")
    operator.post(f"/api/v1/queues/{queue.pk}/resume/")
    rows = operator.get("/api/v1/audit/").json()["results"]
    assert [(r["action"], r["actor"], r["via"], r["target_ids"]) for r in rows] == [
        ("queue_resume", "olga", "api", [queue.pk]),
        ("queue_suspend", "olga", "api", [queue.pk]),
    ]
    filtered = operator.get("/api/v1/audit/?action=queue_suspend").json()["results"]
    assert [r["action"] for r in filtered] == ["queue_suspend"]
    entry = operator.get(f"/api/v1/audit/{rows[0]['id']}/").json()
    assert entry["count"] == 0 and entry["created_at"]


def test_the_openapi_schema_and_its_docs_page_are_served():
    client = api_client(make_user("viewer"))
    schema = client.get("/api/schema/", HTTP_ACCEPT="application/vnd.oai.openapi+json")
    assert schema.status_code == 200
    paths = schema.json()["paths"]
    for path in [
        "/api/v1/queues/",
        "/api/v1/queues/{id}/retry/",
        "/api/v1/messages/{id}/remove/",
        "/api/v1/messages/{id}/export/",
        "/api/v1/messages/bulk/",
        "/api/v1/audit/",
        "/api/v1/qshape/",
    ]:
        assert path in paths
    docs = client.get("/api/docs/")
    assert docs.status_code == 200 and b"swagger" in docs.content.lower()
    # Served from our own static files (docs/api.md): the page works offline.
    sources = re.findall(r'(?:src|href)="([^"]+)"', docs.content.decode())
    assert any("/static/drf_spectacular_sidecar/swagger-ui-dist/" in u for u in sources)
    assert not [u for u in sources if "//" in u], sources
