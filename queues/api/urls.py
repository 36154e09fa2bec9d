"""REST API v1 routes, the OpenAPI 3 schema and its docs page (mounted at /api/)."""

from django.urls import include, path
from rest_framework.routers import DefaultRouter

from queues.api.accounts import SmtpAccountDetailView, SmtpAccountListView
from queues.api.docs import DocsView, SchemaView
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
    path("v1/smtp-accounts/", SmtpAccountListView.as_view(), name="smtp-accounts"),
    path(
        "v1/smtp-accounts/<str:username>/",
        SmtpAccountDetailView.as_view(),
        name="smtp-account",
    ),
    path("v1/", include(router.urls)),
    # Behind a login unless MAILRELAY_API_DOCS_PUBLIC (queues/api/docs.py).
    path("schema/", SchemaView.as_view(), name="schema"),
    path("docs/", DocsView.as_view(url_name="schema"), name="api-docs"),
]
