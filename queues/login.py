"""Logins through the throttle (queues.throttle): the Queue Viewer's login page,
the admin's, and ``POST /api/v1/auth/token/`` (a user's API token for a
user name and password).

Each checks the lock before the password (a locked user name or address is
refused whatever the password), counts a failure, and answers a lockout with
a clear message: the form's error on the login pages (HTTP 429 on the
Queue Viewer's), ``429 {"detail": ...}`` with ``Retry-After`` in the API.
"""

from __future__ import annotations

from django.contrib.admin.forms import AdminAuthenticationForm
from django.contrib.auth import authenticate
from django.contrib.auth.forms import AuthenticationForm
from django.contrib.auth.views import LoginView
from django.core.exceptions import ValidationError
from drf_spectacular.utils import extend_schema, inline_serializer
from rest_framework import serializers, status
from rest_framework.authtoken.models import Token
from rest_framework.permissions import AllowAny
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from queues import throttle
from queues.access import client_address


class ThrottledLoginMixin:
    """An AuthenticationForm whose clean() goes through the throttle."""

    via = "ui"
    locked: throttle.LoginLocked | None = None

    def clean(self):
        username = self.cleaned_data.get("username") or ""
        address = client_address(self.request)
        try:
            throttle.check(username, address)
        except throttle.LoginLocked as locked:
            self.locked = locked
            raise ValidationError(locked.message, code="locked") from None
        try:
            cleaned = super().clean()
        except ValidationError as error:
            if error.code == "invalid_login":
                self.locked = throttle.failed(username, address, self.via)
                if self.locked:
                    raise ValidationError(self.locked.message, code="locked") from None
            raise
        throttle.succeeded(username)
        return cleaned


class ThrottledAuthenticationForm(ThrottledLoginMixin, AuthenticationForm):
    pass


class ThrottledAdminAuthenticationForm(ThrottledLoginMixin, AdminAuthenticationForm):
    pass


class ThrottledLoginView(LoginView):
    """The Queue Viewer's login page; a lockout answers 429 with its message."""

    form_class = ThrottledAuthenticationForm
    redirect_authenticated_user = True

    def form_invalid(self, form):
        response = super().form_invalid(form)
        if form.locked is not None:
            response.status_code = status.HTTP_429_TOO_MANY_REQUESTS
            response["Retry-After"] = str(form.locked.retry_after)
        return response


class TokenRequestSerializer(serializers.Serializer):
    username = serializers.CharField(max_length=150)
    password = serializers.CharField(max_length=4096, trim_whitespace=False)


class TokenView(APIView):
    """Your API token, for your user name and password (created on first use).

    Throttled as the login page is: after 5 failures for one user name or
    from one address within 15 minutes, 429 for a while, whatever the password.
    """

    authentication_classes: list = []
    permission_classes = [AllowAny]

    @extend_schema(
        request=TokenRequestSerializer,
        responses=inline_serializer("TokenResponse", {"token": serializers.CharField()}),
        auth=[],
    )
    def post(self, request: Request) -> Response:
        body = TokenRequestSerializer(data=request.data)
        if not body.is_valid():
            return Response({"detail": "give username and password"}, status=400)
        username = body.validated_data["username"]
        address = client_address(request)
        try:
            throttle.check(username, address)
        except throttle.LoginLocked as locked:
            return _locked(locked)
        user = authenticate(
            request._request, username=username, password=body.validated_data["password"]
        )
        if user is None or not user.is_active:
            locked = throttle.failed(username, address, "api")
            if locked:
                return _locked(locked)
            return Response({"detail": "wrong user name or password"}, status=401)
        throttle.succeeded(username)
        token, _ = Token.objects.get_or_create(user=user)
        return Response({"token": token.key})


def _locked(locked: throttle.LoginLocked) -> Response:
    return Response(
        {"detail": locked.message},
        status=status.HTTP_429_TOO_MANY_REQUESTS,
        headers={"Retry-After": str(locked.retry_after)},
    )
