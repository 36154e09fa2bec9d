"""The OpenAPI schema and its docs page: for logged-in users (any role), or for
everyone with ``MAILRELAY_API_DOCS_PUBLIC=true``. The docs page sends an
anonymous browser to the login page; the schema answers 401 as the API does."""

from __future__ import annotations

from django.conf import settings
from django.contrib.auth.views import redirect_to_login
from drf_spectacular.views import SpectacularAPIView, SpectacularSwaggerView
from rest_framework.permissions import BasePermission


class DocsAccess(BasePermission):
    message = "the API schema needs a login (or MAILRELAY_API_DOCS_PUBLIC=true)"

    def has_permission(self, request, view) -> bool:
        return settings.MAILRELAY_API_DOCS_PUBLIC or bool(request.user.is_authenticated)


class SchemaView(SpectacularAPIView):
    permission_classes = [DocsAccess]


class DocsView(SpectacularSwaggerView):
    permission_classes = [DocsAccess]

    def permission_denied(self, request, message=None, code=None):
        if not request.user.is_authenticated:
            raise _ToLogin()
        super().permission_denied(request, message, code)

    def handle_exception(self, exc):
        if isinstance(exc, _ToLogin):
            return redirect_to_login(self.request.get_full_path())
        return super().handle_exception(exc)


class _ToLogin(Exception):
    pass
