"""``GET /api/v1/backpressure/``: every node's resources, as the CLI shows them."""

from __future__ import annotations

from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import extend_schema
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from delivery.backpressure import store
from delivery.backpressure.config import BackPressureConfig
from queues.permissions import IsViewer


class BackPressureView(APIView):
    """Each ingress node's back-pressure resources: reading, level, thresholds,
    history, and the action in force (tarpit delay or refusal)."""

    permission_classes = [IsViewer]  # like every other read of the API

    @extend_schema(responses={200: OpenApiTypes.OBJECT}, operation_id="backpressure_list")
    def get(self, request: Request) -> Response:
        interval = BackPressureConfig.from_settings().interval
        nodes = store.pressure_nodes(interval=interval)
        return Response({"nodes": [store.node_dict(node) for node in nodes]})
