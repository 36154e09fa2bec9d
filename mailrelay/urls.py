"""Every URL and the role it needs: README "URLs and roles" (tests/test_url_roles.py
walks every pattern here and checks it against that table)."""

from django.contrib import admin
from django.http import HttpRequest, HttpResponse
from django.urls import include, path

from delivery.backpressure.api import BackPressureView
from delivery.metrics import metrics_view
from queues.login import TokenView


def healthz(request: HttpRequest) -> HttpResponse:
    return HttpResponse("ok\n", content_type="text/plain")


urlpatterns = [
    path("admin/", admin.site.urls),
    path("healthz", healthz),
    path("metrics", metrics_view),
    path("api/v1/auth/token/", TokenView.as_view(), name="api-token"),
    path("api/v1/backpressure/", BackPressureView.as_view(), name="backpressure"),
    # Before the queue store's own: explain, incidents, alerts, a queue's page.
    path("", include("insight.urls")),
    # Message tracking and webhooks (tracking/): /api/v1/tracking/, /tracking/, /webhooks/.
    path("api/v1/", include("tracking.api_urls")),
    path("", include("tracking.ui_urls")),
    path("api/", include("queues.api.urls")),
    path("", include("queues.ui.urls")),
]
