"""REST API of operator insight: explain, incidents, alerts (viewer role)."""

from __future__ import annotations

from django.shortcuts import get_object_or_404
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import extend_schema
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from insight import alerts
from insight.explain import explain_message
from insight.incidents import incidents
from queues.lib import clock
from queues.models import Message
from queues.permissions import IsViewer


def message_for(ref: str) -> Message:
    """A message by numeric id or by queue id (as the messages API takes them)."""
    qs = Message.objects.defer("data")
    if ref.isascii() and ref.isdigit() and len(ref) <= 18:
        return get_object_or_404(qs, pk=int(ref))
    return get_object_or_404(qs, qid=ref.upper()[:20])


class ExplainView(APIView):
    """Why each recipient of a message not yet final is waiting: reasons (codes and
    words), the retry rule, the last reply, the projected schedule and the actions."""

    permission_classes = [IsViewer]

    @extend_schema(responses={200: OpenApiTypes.OBJECT}, operation_id="message_explain")
    def get(self, request: Request, ref: str) -> Response:
        return Response(explain_message(message_for(ref), clock.now()).as_dict())


class IncidentsView(APIView):
    """Deferrals across queues, grouped by provider behind the MX and normalised
    error, and by error alone: first and last seen, queues, recipients, senders,
    and the last hour's trend (10-minute slices, oldest first)."""

    permission_classes = [IsViewer]

    @extend_schema(responses={200: OpenApiTypes.OBJECT}, operation_id="incidents")
    def get(self, request: Request) -> Response:
        found = incidents(clock.now())
        return Response(
            {
                "as_of": found.as_of.isoformat() if found.as_of else None,
                "deferred": found.deferred,
                "incidents": [i.as_dict() for i in found.by_provider],
                "errors": [i.as_dict() for i in found.by_error],
            }
        )


class AlertsView(APIView):
    """The alerts in force: queues whose oldest waiting message is older than
    MAILRELAY_ALERT_OLDEST_AGE (or the queue's own threshold), as the periodic task
    (beat, insight.tasks.refresh) last evaluated them. A read: it writes nothing."""

    permission_classes = [IsViewer]

    @extend_schema(responses={200: OpenApiTypes.OBJECT}, operation_id="alerts")
    def get(self, request: Request) -> Response:
        return Response({"alerts": [alerts.as_dict(a) for a in alerts.active()]})
