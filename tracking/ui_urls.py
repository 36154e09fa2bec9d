"""Queue Viewer pages of tracking and webhooks (mounted at the site root)."""

from django.urls import path

from tracking import ui

app_name = "tracking"

urlpatterns = [
    path("tracking/", ui.tracking_search, name="search"),
    path("webhooks/", ui.webhook_list, name="webhooks"),
    path("webhooks/<int:pk>/", ui.webhook_detail, name="webhook"),
    path("webhooks/<int:pk>/delete/", ui.webhook_delete, name="webhook_delete"),
    path(
        "webhooks/<int:pk>/rotate-secret/",
        ui.webhook_rotate_secret,
        name="webhook_rotate_secret",
    ),
]
