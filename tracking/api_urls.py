"""API routes of tracking and webhooks (mounted under /api/v1/ by mailrelay/urls.py)."""

from django.urls import include, path
from rest_framework.routers import SimpleRouter

from tracking.api import TrackingView, WebhookEndpointViewSet

router = SimpleRouter()
router.register("webhooks", WebhookEndpointViewSet, basename="webhook")

urlpatterns = [
    path("tracking/", TrackingView.as_view(), name="tracking"),
    path("", include(router.urls)),
]
