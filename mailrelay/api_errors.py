"""Every answer under ``/api/`` is JSON, its 404 and 405 too.

Django REST framework answers JSON for what its views raise; a URL that no
view takes (an unknown action, a typo, another version) was answered by
Django's HTML 404 page. This middleware turns such a non-JSON 404/405 under
``/api/`` into DRF's shape: ``{"detail": "..."}``.
"""

from __future__ import annotations

from collections.abc import Callable

from django.http import HttpRequest, HttpResponse, JsonResponse

API_PREFIX = "/api/"


class JsonApiErrors:
    def __init__(self, get_response: Callable[[HttpRequest], HttpResponse]) -> None:
        self.get_response = get_response

    def __call__(self, request: HttpRequest) -> HttpResponse:
        response = self.get_response(request)
        if (
            response.status_code not in (404, 405)
            or not request.path.startswith(API_PREFIX)
            or response.get("Content-Type", "").startswith("application/json")
        ):
            return response
        if response.status_code == 404:
            return JsonResponse({"detail": "Not found."}, status=404)
        answer = JsonResponse({"detail": f'Method "{request.method}" not allowed.'}, status=405)
        if response.has_header("Allow"):
            answer["Allow"] = response["Allow"]
        return answer
