"""SMTP accounts over the API (admin role): /api/v1/smtp-accounts/.

GET lists (or shows one), POST creates, PATCH changes (``password``,
``enabled``, ``allowed_senders``, ``max_messages_per_hour``), DELETE removes.
A password is accepted, never returned: answers carry ``account_summary``.
"""

from __future__ import annotations

from typing import Any

from django.db import transaction
from drf_spectacular.utils import extend_schema, inline_serializer
from rest_framework import serializers, status
from rest_framework.exceptions import NotFound, ParseError
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from queues.api.views import BadRequest, OperatorAPI
from queues.permissions import IsAdmin
from queues.services import accounts

_CHANGEABLE = {"password", "enabled", "allowed_senders", "max_messages_per_hour"}


class SmtpAccountSerializer(serializers.Serializer):
    """What an account looks like in answers (never its password or hash)."""

    username = serializers.CharField()
    enabled = serializers.BooleanField()
    allowed_senders = serializers.ListField(child=serializers.CharField())
    max_messages_per_hour = serializers.IntegerField(allow_null=True)
    created_at = serializers.DateTimeField(allow_null=True)
    last_login_at = serializers.DateTimeField(allow_null=True)


class SmtpAccountChangeSerializer(serializers.Serializer):
    """A PATCH body: any of these (the password is written, never read back)."""

    password = serializers.CharField(write_only=True, required=False)
    enabled = serializers.BooleanField(required=False)
    allowed_senders = serializers.ListField(child=serializers.CharField(), required=False)
    max_messages_per_hour = serializers.IntegerField(allow_null=True, required=False)


class SmtpAccountCreateSerializer(SmtpAccountChangeSerializer):
    username = serializers.CharField()
    password = serializers.CharField(write_only=True)


_LIST = inline_serializer("SmtpAccountList", {"results": SmtpAccountSerializer(many=True)})


def _data(request: Request) -> dict[str, Any]:
    data = request.data
    if not isinstance(data, dict):
        raise ParseError("the body is a JSON object")
    return data


def _bool(value: Any, name: str) -> bool:
    if isinstance(value, bool):
        return value
    raise BadRequest(f"{name}: true or false")


class SmtpAccountListView(OperatorAPI, APIView):
    permission_classes = [IsAdmin]

    @extend_schema(operation_id="smtp_accounts_list", responses=_LIST)
    def get(self, request: Request) -> Response:
        return Response(
            {"results": [accounts.account_summary(a) for a in accounts.list_accounts()]}
        )

    @extend_schema(
        operation_id="smtp_accounts_create",
        request=SmtpAccountCreateSerializer,
        responses={201: SmtpAccountSerializer},
    )
    def post(self, request: Request) -> Response:
        data = _data(request)
        unknown = set(data) - _CHANGEABLE - {"username"}
        if unknown:
            raise BadRequest(f"unknown fields: {', '.join(sorted(unknown))}")
        try:
            account = accounts.create_account(
                str(data.get("username") or ""),
                str(data.get("password") or ""),
                allowed_senders=data.get("allowed_senders") or [],
                max_messages_per_hour=data.get("max_messages_per_hour"),
                enabled=_bool(data.get("enabled", True), "enabled"),
            )
        except accounts.AccountError as exc:
            raise BadRequest(str(exc)) from None
        accounts.audit(request.user, "api", "add", account.username)
        return Response(accounts.account_summary(account), status=status.HTTP_201_CREATED)


class SmtpAccountDetailView(OperatorAPI, APIView):
    permission_classes = [IsAdmin]

    def _get(self, username: str):
        try:
            return accounts.get_account(username)
        except accounts.AccountError as exc:
            raise NotFound(str(exc)) from None

    @extend_schema(operation_id="smtp_accounts_retrieve", responses=SmtpAccountSerializer)
    def get(self, request: Request, username: str) -> Response:
        return Response(accounts.account_summary(self._get(username)))

    @extend_schema(
        operation_id="smtp_accounts_partial_update",
        request=SmtpAccountChangeSerializer,
        responses=SmtpAccountSerializer,
    )
    def patch(self, request: Request, username: str) -> Response:
        self._get(username)
        data = _data(request)
        unknown = set(data) - _CHANGEABLE
        if unknown:
            raise BadRequest(f"unknown fields: {', '.join(sorted(unknown))}")
        # All or nothing, with its audit entry: a refused field leaves the password too.
        try:
            with transaction.atomic():
                if "password" in data:
                    accounts.set_password(username, str(data["password"] or ""))
                account = accounts.update_account(
                    username,
                    allowed_senders=data.get("allowed_senders"),
                    max_messages_per_hour=data.get("max_messages_per_hour", False),
                    enabled=_bool(data["enabled"], "enabled") if "enabled" in data else None,
                )
                changed = ", ".join(sorted(data))  # the names only: never a password
                accounts.audit(request.user, "api", "change", username, changed)
        except accounts.AccountError as exc:
            raise BadRequest(str(exc)) from None
        return Response(accounts.account_summary(account))

    @extend_schema(operation_id="smtp_accounts_destroy", responses={204: None})
    def delete(self, request: Request, username: str) -> Response:
        self._get(username).delete()
        accounts.audit(request.user, "api", "delete", username)
        return Response(status=status.HTTP_204_NO_CONTENT)
