"""Queue Viewer pages, at the site root (mailrelay/urls.py includes them)."""

from django.contrib.auth import views as auth_views
from django.urls import path

from queues.login import ThrottledLoginView
from queues.ui import accounts, queue_views, system, views

app_name = "ui"

urlpatterns = [
    # Through the login throttle (queues/throttle.py).
    path("accounts/login/", ThrottledLoginView.as_view(), name="login"),
    path("accounts/logout/", auth_views.LogoutView.as_view(next_page="ui:login"), name="logout"),
    path("", views.home, name="home"),
    path("queues/", queue_views.queue_list, name="queues"),
    path("queues/qshape/", queue_views.qshape_view, name="qshape"),
    path("queues/selected/", queue_views.queues_bulk, name="queues_bulk"),
    path("queues/by-filter/", queue_views.queues_confirm, name="queues_confirm"),
    path("queues/<int:pk>/<str:action>/", queue_views.queue_action, name="queue_action"),
    path("messages/", views.message_list, name="messages"),
    path("messages/selected/", views.messages_bulk, name="messages_bulk"),
    path("messages/by-filter/", views.messages_confirm, name="messages_confirm"),
    path("messages/<int:pk>/", views.message_detail, name="message"),
    path("messages/<int:pk>/export/", views.message_export_view, name="message_export"),
    path("messages/<int:pk>/<str:action>/", views.message_action, name="message_action"),
    path("deferrals/", views.deferrals, name="deferrals"),
    path("audit/", views.audit, name="audit"),
    path("smtp-accounts/", accounts.account_list, name="smtp_accounts"),
    path("smtp-accounts/<str:username>/", accounts.account_detail, name="smtp_account"),
    path(
        "smtp-accounts/<str:username>/delete/",
        accounts.account_delete,
        name="smtp_account_delete",
    ),
    path("backpressure/", system.backpressure_page, name="backpressure"),
    path("alerts/", system.alerts_page, name="alerts"),
    path("dkim/", system.dkim_page, name="dkim"),
    path("dkim/<str:domain>/<str:selector>/<str:action>/", system.dkim_action, name="dkim_action"),
    path("live.json", views.live, name="live"),
]
