"""REST API: ``GET /api/v1/tracking/`` (viewer) and the webhook endpoints (admin)."""

from __future__ import annotations

from drf_spectacular.utils import OpenApiParameter, extend_schema
from rest_framework import serializers, status, viewsets
from rest_framework.decorators import action
from rest_framework.exceptions import PermissionDenied, ValidationError
from rest_framework.pagination import CursorPagination
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.utils.urls import replace_query_param
from rest_framework.views import APIView

from queues.permissions import IsAdmin, IsViewer, can_read_content
from tracking import endpoints as services
from tracking.eventlog import as_dict
from tracking.models import WebhookAttempt, WebhookDelivery, WebhookEndpoint
from tracking.search import PARAMETERS, SearchError, parse_limit, parse_query, search

VIA_API = "api"


def row_json(row, *, content: bool) -> dict:
    """A tracking row for the API; viewers get no Message-ID (README "URLs and roles")."""
    data = {"id": row.id, **as_dict(row)}
    data.pop("v")
    if not content:
        data.pop("message_id")
    return data


class TrackingView(APIView):
    permission_classes = [IsViewer]

    @extend_schema(
        parameters=[
            OpenApiParameter(name, str, description=f"tracking search: {name}")
            for name in (*PARAMETERS, "limit", "cursor")
        ],
        responses={200: dict},
        description="Tracking rows, newest first (docs/tracking.md).",
    )
    def get(self, request: Request) -> Response:
        content = can_read_content(request.user)
        if request.query_params.get("message_id") and not content:
            raise PermissionDenied("searching by Message-ID needs the operator role")
        try:
            query = parse_query(request.query_params)
            page = search(
                query,
                parse_limit(request.query_params.get("limit")),
                request.query_params.get("cursor") or None,
            )
        except SearchError as exc:
            raise ValidationError({"detail": str(exc)}) from None
        url = request.build_absolute_uri()
        return Response(
            {
                "results": [row_json(r, content=content) for r in page.rows],
                "next": replace_query_param(url, "cursor", page.next_cursor)
                if page.next_cursor
                else None,
            }
        )


class EndpointSerializer(serializers.ModelSerializer):
    """The secret is write-only: answered in clear only by the creation and by
    ``rotate-secret``; otherwise ``secret_hint`` (its last four characters)."""

    secret = serializers.CharField(
        required=False, allow_blank=True, max_length=200, write_only=True
    )
    secret_hint = serializers.SerializerMethodField()
    warnings = serializers.SerializerMethodField()

    class Meta:
        model = WebhookEndpoint
        fields = [
            "id",
            "name",
            "url",
            "events",
            "secret",
            "secret_hint",
            "warnings",
            "enabled",
            "created_at",
            "updated_at",
        ]
        read_only_fields = ["id", "created_at", "updated_at"]

    def get_secret_hint(self, endpoint: WebhookEndpoint) -> str:
        return services.secret_hint(endpoint.secret)

    def get_warnings(self, endpoint: WebhookEndpoint) -> list[str]:
        return services.warnings(endpoint)

    def validate_secret(self, value):
        try:
            return services.clean_secret(value)
        except services.EndpointError as exc:
            raise serializers.ValidationError(str(exc)) from None

    def validate_events(self, value):
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise serializers.ValidationError("a list of event names")
        try:
            return services.clean_events(value)
        except services.EndpointError as exc:
            raise serializers.ValidationError(str(exc)) from None

    def validate_url(self, value):
        try:
            return services.clean_url(value)
        except services.EndpointError as exc:
            raise serializers.ValidationError(str(exc)) from None


class AttemptSerializer(serializers.ModelSerializer):
    event_id = serializers.UUIDField(source="delivery.event_id")
    event = serializers.CharField(source="delivery.event")

    class Meta:
        model = WebhookAttempt
        fields = ["id", "at", "event_id", "event", "status", "error", "duration_ms"]


class DeliverySerializer(serializers.ModelSerializer):
    class Meta:
        model = WebhookDelivery
        fields = [
            "id",
            "event_id",
            "event",
            "state",
            "created_at",
            "attempts",
            "next_attempt_at",
            "last_status",
            "last_error",
            "finished_at",
        ]


class EndpointPages(CursorPagination):
    """The API's list shape (docs/api.md "Lists and pagination"): keyset pages
    ``{"next", "previous", "results"}`` by name, ``limit`` 100 (at most 1000)."""

    ordering = "name"  # unique
    page_size = 100
    page_size_query_param = "limit"
    max_page_size = 1000


class WebhookEndpointViewSet(viewsets.ModelViewSet):
    """Webhook endpoints (admin): URL, the events wanted, the secret."""

    permission_classes = [IsAdmin]
    pagination_class = EndpointPages
    serializer_class = EndpointSerializer
    queryset = WebhookEndpoint.objects.all()

    def perform_create(self, serializer):
        data = serializer.validated_data
        try:
            serializer.instance = services.create(
                self.request.user,
                VIA_API,
                name=data["name"],
                url=data["url"],
                events=data["events"],
                secret=data.get("secret", ""),
                enabled=data.get("enabled", True),
            )
        except services.EndpointError as exc:
            raise ValidationError({"detail": str(exc)}) from None

    def create(self, request: Request, *args, **kwargs) -> Response:
        response = super().create(request, *args, **kwargs)
        # Shown this once; GET answers only its hint.
        response.data["secret"] = response.data.serializer.instance.secret
        response["Cache-Control"] = "no-store"
        return response

    def perform_update(self, serializer):
        data = dict(serializer.validated_data)
        data.pop("name", None)
        serializer.instance = services.update(
            self.request.user, VIA_API, serializer.instance, **data
        )

    def perform_destroy(self, instance):
        services.delete(self.request.user, VIA_API, instance)

    @extend_schema(request=None, responses={200: dict})
    @action(detail=True, methods=["post"], url_path="rotate-secret")
    def rotate_secret(self, request: Request, pk: str | None = None) -> Response:
        """A new random secret, answered this once (``{"secret": …}``)."""
        endpoint = self.get_object()
        secret = services.rotate_secret(request.user, VIA_API, endpoint)
        return Response(
            {"id": endpoint.pk, "secret": secret, "secret_hint": services.secret_hint(secret)},
            headers={"Cache-Control": "no-store"},
        )

    @extend_schema(responses={200: dict})
    @action(detail=True, methods=["get"])
    def deliveries(self, request: Request, pk: str | None = None) -> Response:
        """Recent deliveries, failures and attempts of this endpoint."""
        endpoint = self.get_object()
        recent = services.recent(endpoint)
        return Response(
            {
                "pending": recent["pending"],
                "failed": recent["failed"],
                "deliveries": DeliverySerializer(recent["deliveries"], many=True).data,
                "failures": DeliverySerializer(recent["failures"], many=True).data,
                "attempts": AttemptSerializer(recent["attempts"], many=True).data,
            },
            status=status.HTTP_200_OK,
        )
