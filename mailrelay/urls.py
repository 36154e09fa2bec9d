from django.contrib import admin
from django.http import HttpRequest, HttpResponse
from django.urls import include, path

from delivery.backpressure.api import BackPressureView
from delivery.metrics import metrics_view


def healthz(request: HttpRequest) -> HttpResponse:
    return HttpResponse("ok\n", content_type="text/plain")


urlpatterns = [
    path("admin/", admin.site.urls),
    path("healthz", healthz),
    path("metrics", metrics_view),
    path("api/v1/backpressure/", BackPressureView.as_view(), name="backpressure"),
    path("api/", include("queues.api.urls")),
    path("", include("queues.ui.urls")),
]
