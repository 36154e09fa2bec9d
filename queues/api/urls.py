"""REST API v1 routes, the OpenAPI 3 schema and its docs page (mounted at /api/)."""

from django.urls import include, path
from drf_spectacular.views import SpectacularAPIView, SpectacularSwaggerView
from rest_framework.routers import DefaultRouter

from queues.api.views import (
    AuditViewSet,
    ErrorGroupsView,
    LinkViewSet,
    MessageViewSet,
    QShapeView,
    QueueViewSet,
)

router = DefaultRouter()
router.register("queues", QueueViewSet, basename="queue")
router.register("links", LinkViewSet, basename="link")
router.register("messages", MessageViewSet, basename="message")
router.register("audit", AuditViewSet, basename="audit")

urlpatterns = [
    path("v1/qshape/", QShapeView.as_view(), name="qshape"),
    path("v1/errors/", ErrorGroupsView.as_view(), name="error-groups"),
    path("v1/", include(router.urls)),
    path("schema/", SpectacularAPIView.as_view(), name="schema"),
    path("docs/", SpectacularSwaggerView.as_view(url_name="schema"), name="api-docs"),
]
