"""Every answer of the API is JSON, its 404 and 405 too (an HTML page is no
answer for a script): unknown URLs, unknown actions, unknown objects and
methods a URL does not take."""

import pytest

from tests.support.operator_factories import api_client, make_message, make_queue, make_user

pytestmark = pytest.mark.django_db


def test_unknown_urls_and_actions_answer_a_json_404():
    client = api_client(make_user("operator"))
    queue = make_queue()
    message = make_message("u@example.net", queue=queue)
    for method, url in (
        (client.post, f"/api/v1/messages/{message.pk}/frobnicate/"),
        (client.get, f"/api/v1/messages/{message.pk}/frobnicate/"),
        (client.post, f"/api/v1/queues/{queue.pk}/frobnicate/"),
        (client.post, "/api/v1/messages/999999/retry/"),
        (client.get, "/api/v1/messages/999999/"),
        (client.get, "/api/v1/nothing-here/"),
        (client.post, "/api/v2/queues/"),
        (client.get, "/api/"),
    ):
        response = method(url)
        assert response.status_code == 404, (method, url)
        assert response["Content-Type"] == "application/json", (method, url)
        assert response.json()["detail"], url


def test_a_method_a_url_does_not_take_answers_a_json_405():
    client = api_client(make_user("admin"))
    for method, url in (
        (client.delete, "/api/v1/queues/"),
        (client.put, "/api/v1/tracking/"),
        (client.get, "/api/v1/auth/token/"),
        (client.post, "/api/v1/backpressure/"),
    ):
        response = method(url)
        assert response.status_code == 405, (method, url)
        assert response["Content-Type"] == "application/json", url
        assert "not allowed" in response.json()["detail"], url
