"""Operator insight's URLs: the API under /api/v1/, the pages at the site root
(mailrelay/urls.py includes both before the queue store's own)."""

from django.urls import path

from insight import api, views

app_name = "insight"

urlpatterns = [
    path("api/v1/messages/<str:ref>/explain/", api.ExplainView.as_view(), name="api_explain"),
    path("api/v1/incidents/", api.IncidentsView.as_view(), name="api_incidents"),
    path("api/v1/alerts/", api.AlertsView.as_view(), name="api_alerts"),
    path("incidents/", views.incidents_page, name="incidents"),
    path("queues/<int:pk>/", views.queue_page, name="queue"),
    path("queues/<int:pk>/live.json", views.queue_live, name="queue_live"),
]
