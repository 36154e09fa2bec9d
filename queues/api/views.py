"""REST API v1: thin edges over queues.filters (reading) and
queues.services.actions (changing). Every action calls one service.

Filter parameters and their OpenAPI entries come from the filter declarations
(queues.filters.MESSAGE_FILTERS, QUEUE_FILTERS); the action endpoints, their
roles and the bulk actions from the action tables (queues.spec).

Errors are ``{"detail": "..."}``: 400 for a filter, cursor or body that
cannot be understood, 401 anonymous, 403 missing role, 404 unknown id,
409 an action that makes no sense in the current state (nothing changed).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from django.db import DataError
from django.http import FileResponse, StreamingHttpResponse
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import OpenApiParameter, extend_schema, inline_serializer
from rest_framework import serializers, status, viewsets
from rest_framework.decorators import action
from rest_framework.exceptions import APIException, PermissionDenied, ValidationError
from rest_framework.renderers import BaseRenderer, BrowsableAPIRenderer, JSONRenderer
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.utils.urls import replace_query_param
from rest_framework.views import APIView

from insight.deferrals import error_groups
from queues.api.serializers import (
    ActionOptionsSerializer,
    AuditEntrySerializer,
    BulkResultSerializer,
    BulkSerializer,
    ExportSerializer,
    LinkSerializer,
    MessageDetailSerializer,
    MessageListSerializer,
    QueueSerializer,
    RemoveSerializer,
)
from queues.filters import (
    MESSAGE_FILTERS,
    QUEUE_FILTERS,
    AuditFilter,
    MessageFilter,
    MessageStatus,
    QueueFilter,
    audit_page,
    links_page,
    messages_page,
    messages_prefetch,
    queues_page,
)
from queues.holdings import next_attempts
from queues.lib import clock
from queues.models import AuditEntry, Link, Message, Queue
from queues.paging import FilterError, FilterForbidden, Page, parse_limit
from queues.permissions import (
    OPERATOR,
    CanReadContent,
    IsViewer,
    RoleRequired,
    can_read_content,
)
from queues.services import actions
from queues.services.actions import ActionConflict, ActionInvalid, ActionTooLarge, Via
from queues.services.counts import current_counts, qshape, queue_history
from queues.spec import (
    MESSAGE_ACTIONS,
    QUEUE_ACTIONS,
    OperatorAction,
    actions_for,
    openapi_parameters,
)

API_MESSAGE_ACTIONS = actions_for(MESSAGE_ACTIONS, "api")
API_QUEUE_ACTIONS = actions_for(QUEUE_ACTIONS, "api")


class BadRequest(APIException):
    status_code = status.HTTP_400_BAD_REQUEST
    default_detail = "bad request"


class Conflict(APIException):
    status_code = status.HTTP_409_CONFLICT
    default_detail = "the action makes no sense in the current state"


class EmlRenderer(BaseRenderer):
    """Lets ``Accept: message/rfc822`` through content negotiation; errors stay JSON."""

    media_type = "message/rfc822"
    format = "eml"
    charset = None

    def render(self, data, accepted_media_type=None, renderer_context=None):
        return data if isinstance(data, bytes) else json.dumps(data).encode()


class ReplayRenderer(EmlRenderer):
    """``?format=replay``: the message with Exchange's replay envelope (X-Sender/X-Receiver)."""

    format = "replay"


class ZipRenderer(EmlRenderer):
    media_type = "application/zip"
    format = "zip"


def _flat_errors(detail: Any, prefix: str = "") -> list[str]:
    if isinstance(detail, Mapping):
        out = []
        for key, value in detail.items():
            name = "" if key == "non_field_errors" else f"{prefix}{key}: "
            out += _flat_errors(value, name)
        return out
    if isinstance(detail, list):
        return [m for item in detail for m in _flat_errors(item, prefix)]
    return [f"{prefix}{detail}"]


class OperatorAPI:
    """Maps the services' exceptions to clear 4xx answers with one ``detail`` string."""

    _format_suffix: str | None = None

    def dispatch(self, request, *args, **kwargs):
        # The router's format-suffix routes (/queues.json) pass ``format``; the
        # handlers take no such argument (it was a 500), so it is kept here.
        self._format_suffix = kwargs.pop("format", None)
        return super().dispatch(request, *args, **kwargs)

    def get_format_suffix(self, **kwargs):
        return self._format_suffix

    def handle_exception(self, exc):
        if isinstance(exc, FilterForbidden):
            exc = PermissionDenied(str(exc))
        elif isinstance(exc, FilterError):
            exc = BadRequest(str(exc))
        elif isinstance(exc, DataError):
            # A value the parsers let through but PostgreSQL cannot use: still the
            # caller's input, so a 400, never a 500 (tests/test_api_fuzz.py).
            exc = BadRequest("a parameter's value is out of range for the database")
        elif isinstance(exc, ActionInvalid):
            exc = BadRequest(exc.message)
        elif isinstance(exc, ActionConflict):
            exc = Conflict(exc.message)
        elif isinstance(exc, ActionTooLarge):
            exc = BadRequest(str(exc))
        elif isinstance(exc, ValidationError) and not isinstance(exc.detail, str):
            exc = BadRequest("; ".join(_flat_errors(exc.detail)))
        return super().handle_exception(exc)


def _cursor_url(request: Request, cursor: str | None) -> str | None:
    if not cursor:
        return None
    return replace_query_param(request.build_absolute_uri(), "cursor", cursor)


def _page_response(request: Request, page: Page, data: list) -> Response:
    return Response(
        {
            "next": _cursor_url(request, page.next_cursor),
            "previous": _cursor_url(request, page.previous_cursor),
            "results": data,
        }
    )


def _filter_params(raw: Mapping[str, Any]) -> dict[str, str]:
    """A bulk body's ``filter`` object as query-parameter strings."""
    out = {}
    for key, value in raw.items():
        if isinstance(value, list | tuple):
            value = ",".join(str(v) for v in value)
        out[str(key)] = "" if value is None else str(value)
    return out


def _page_params(request: Request, default_limit: int, max_limit: int):
    q = request.query_params
    return (
        q.get("sort"),
        q.get("cursor") or None,
        parse_limit(q.get("limit"), default_limit, max_limit),
    )


CURSOR_PARAMS = [
    OpenApiParameter("cursor", str, description="from a previous page's next/previous"),
    OpenApiParameter("limit", int, description="rows per page"),
]
MESSAGE_FILTER_PARAMS = [
    *openapi_parameters(MESSAGE_FILTERS),
    OpenApiParameter("sort", str, description="received, size, id; - for descending (-received)"),
    *CURSOR_PARAMS,
]
QUEUE_FILTER_PARAMS = [
    *openapi_parameters(QUEUE_FILTERS),
    OpenApiParameter("sort", str, description="name, count, type, incoming, outgoing, id (-count)"),
    *CURSOR_PARAMS,
]


def _action_permissions(view_action: str | None, table: dict[str, OperatorAction]):
    """The role an action endpoint needs (bulk: an operator), else None."""
    if view_action in table:
        return [RoleRequired(table[view_action].role)]
    if view_action == "bulk":
        return [RoleRequired(OPERATOR)]
    return None


def _bulk_selection(data: dict, model, parse) -> tuple[Any, dict[str, Any]]:
    """A bulk body's selection (``ids`` or ``filter``) and how to record it."""
    if "ids" in data:
        return model.objects.filter(id__in=data["ids"]), {"ids": data["ids"]}
    params = _filter_params(data["filter"])
    return parse(params).queryset(), {"filter": params}


def _bulk(request: Request, table: dict[str, OperatorAction], model, parse) -> Response:
    """A bulk action on ``ids``, or on a ``filter``: without ``confirm: true`` the
    answer is the action's own count of what it would change, and nothing changes."""
    body = BulkSerializer(data=request.data)
    body.is_valid(raise_exception=True)
    data = body.validated_data
    spec = table.get(data["action"])
    if spec is None:
        raise BadRequest(f"action: one of {', '.join(table)}")
    qs, audit = _bulk_selection(data, model, parse)
    options = {k: data[k] for k in ("until", "to", "recipient", "sender") if data.get(k)}
    if data["dry_run"] or ("filter" in data and not data["confirm"]):
        preview = spec.dry_run(qs, ndr=data["ndr"], **options)
        result = _bulk_result(spec.name, preview.count, False)
        return Response({**result, "preview": preview.as_dict()})
    count = spec.apply(qs, request_actor(request), Via.API, ndr=data["ndr"], **audit, **options)
    return Response(_bulk_result(spec.name, count, True))


def _paginated(serializer):
    return inline_serializer(
        name=f"Paginated{serializer.__name__.removesuffix('Serializer')}",
        fields={
            "next": serializers.URLField(allow_null=True),
            "previous": serializers.URLField(allow_null=True),
            "results": serializer(many=True),
        },
    )


# --- queues ------------------------------------------------------------------------


class QueueViewSet(OperatorAPI, viewsets.GenericViewSet):
    """Delivery queues (one per next-hop domain and delivery type) and their actions."""

    queryset = Queue.objects.select_related("link")
    serializer_class = QueueSerializer
    permission_classes = [IsViewer]

    def get_permissions(self):
        return _action_permissions(self.action, API_QUEUE_ACTIONS) or [IsViewer()]

    @extend_schema(parameters=QUEUE_FILTER_PARAMS, responses=_paginated(QueueSerializer))
    def list(self, request: Request) -> Response:
        sort, cursor, limit = _page_params(request, 100, 1000)
        now = clock.now()
        counts = current_counts(now)  # before the rows are read: their counts are this one
        page = queues_page(QueueFilter.from_params(request.query_params), sort, cursor, limit)
        context = {"counts": counts, "next_attempts": next_attempts(page.items)}
        response = _page_response(
            request, page, QueueSerializer(page.items, many=True, context=context).data
        )
        response.data["counts"] = counts.as_dict(now)
        return response

    def retrieve(self, request: Request, pk=None) -> Response:
        counts = current_counts(clock.now())
        return Response(QueueSerializer(self.get_object(), context={"counts": counts}).data)

    @extend_schema(request=BulkSerializer, responses=BulkResultSerializer)
    @action(detail=False, methods=["post"])
    def bulk(self, request: Request) -> Response:
        """A queue action on ``ids``, or on a ``filter`` (needs ``confirm: true``)."""
        return _bulk(request, API_QUEUE_ACTIONS, Queue, QueueFilter.from_params)

    @extend_schema(
        responses=inline_serializer(
            "QueueHistory",
            {
                "at": serializers.DateTimeField(),
                "depth": serializers.IntegerField(),
                "incoming_per_minute": serializers.FloatField(),
                "delivered_per_minute": serializers.FloatField(),
                "failed_per_minute": serializers.FloatField(),
            },
            many=True,
        )
    )
    @action(detail=True, methods=["get"])
    def history(self, request: Request, pk=None) -> Response:
        """Depth and delivery rate of this queue over the last hour."""
        queue = self.get_object()
        return Response([vars(p) for p in queue_history(queue.pk, clock.now())])

    @extend_schema(responses=OpenApiTypes.OBJECT)
    @action(detail=False, methods=["get"], url_path="history")
    def total_history(self, request: Request) -> Response:
        """Depth and delivery rate of all queues together over the last hour."""
        return Response([vars(p) for p in queue_history(None, clock.now())])


def _bulk_result(action_name: str, count: int, confirmed: bool) -> dict:
    if confirmed:
        detail = f"{action_name}: {count} changed"
    else:
        detail = f"{action_name} would touch {count}; send the same request with confirm: true"
    return {"action": action_name, "count": count, "confirmed": confirmed, "detail": detail}


def request_actor(request: Request):
    return request.user


# --- links ------------------------------------------------------------------------


class LinkViewSet(OperatorAPI, viewsets.GenericViewSet):
    """Next hops shared by queues: connection state and retry time."""

    queryset = Link.objects.all()
    serializer_class = LinkSerializer
    permission_classes = [IsViewer]

    @extend_schema(parameters=CURSOR_PARAMS, responses=_paginated(LinkSerializer))
    def list(self, request: Request) -> Response:
        _, cursor, limit = _page_params(request, 100, 1000)
        page = links_page(cursor, limit)
        return _page_response(request, page, LinkSerializer(page.items, many=True).data)

    def retrieve(self, request: Request, pk=None) -> Response:
        return Response(self.get_serializer(self.get_object()).data)


# --- messages ------------------------------------------------------------------------


class MessageViewSet(OperatorAPI, viewsets.GenericViewSet):
    """Messages in the store: list with filters, detail, actions, export."""

    serializer_class = MessageDetailSerializer
    permission_classes = [IsViewer]
    lookup_value_regex = "[0-9A-Za-z]+"

    def get_queryset(self):
        qs = Message.objects.all()
        if not can_read_content(self.request.user) or self.action != "retrieve":
            qs = qs.defer("data")
        return qs

    def get_object(self):
        # /messages/<id>/ or /messages/<qid>/
        value = str(self.kwargs.get(self.lookup_field, ""))
        if not value.isdigit():
            self.lookup_field = self.lookup_url_kwarg = "qid"
            self.kwargs["qid"] = value.upper()
        return super().get_object()

    def get_permissions(self):
        by_action = _action_permissions(self.action, API_MESSAGE_ACTIONS)
        if by_action:
            return by_action
        if self.action in ("export", "bulk_export"):
            return [CanReadContent()]
        return [IsViewer()]

    def get_serializer_context(self):
        context = super().get_serializer_context()
        context["content"] = can_read_content(self.request.user)
        return context

    @extend_schema(parameters=MESSAGE_FILTER_PARAMS, responses=_paginated(MessageListSerializer))
    def list(self, request: Request) -> Response:
        sort, cursor, limit = _page_params(request, 50, 500)
        # A viewer may not filter by what it cannot see (Message-ID): 403.
        f = MessageFilter.from_params(request.query_params, content=can_read_content(request.user))
        page = messages_page(f, sort, cursor, limit)
        for message, rcpts in zip(page.items, messages_prefetch(page.items).values(), strict=True):
            message._recipients = rcpts
        data = MessageListSerializer(
            page.items, many=True, context=self.get_serializer_context()
        ).data
        return _page_response(request, page, data)

    def retrieve(self, request: Request, pk=None) -> Response:
        return Response(self.get_serializer(self.get_object()).data)

    @extend_schema(
        responses={(200, "message/rfc822"): OpenApiTypes.BINARY},
        parameters=[
            OpenApiParameter(
                "form",
                str,
                enum=["received", "sent"],
                description="received (default): as stored; sent: as it leaves, with its "
                "DKIM-Signature",
            )
        ],
    )
    @action(
        detail=True,
        methods=["get"],
        renderer_classes=[JSONRenderer, EmlRenderer, ReplayRenderer],
    )
    def export(self, request: Request, pk=None) -> StreamingHttpResponse:
        """The message exactly as stored (with our Received header), as ``<qid>.eml``;
        ``?format=replay`` adds the X-Sender/X-Receiver envelope for the replay folder;
        ``?form=sent`` gives it as it leaves for the next hop (its DKIM-Signature first).
        Streamed from the database in pieces (the queryset defers the body)."""
        message = self.get_object()
        fmt = "replay" if request.query_params.get("format") == "replay" else "eml"
        form = "sent" if request.query_params.get("form") == "sent" else "received"
        actor = request_actor(request)
        pieces = actions.message_export_pieces(message, fmt, actor=actor, via=Via.API, form=form)
        response = StreamingHttpResponse(pieces, content_type="message/rfc822")
        if (size := actions.message_export_size(message, fmt, form)) is not None:
            response["Content-Length"] = str(size)
        name = f"{message.qid}.sent.eml" if form == "sent" else f"{message.qid}.eml"
        response["Content-Disposition"] = f'attachment; filename="{name}"'
        return response

    @extend_schema(request=BulkSerializer, responses=BulkResultSerializer)
    @action(detail=False, methods=["post"])
    def bulk(self, request: Request) -> Response:
        """A message action on ``ids``, or on a ``filter`` (needs ``confirm: true``:
        without it the answer is how many messages it would change, and nothing changes)."""
        return _bulk(request, API_MESSAGE_ACTIONS, Message, MessageFilter.from_params)

    @extend_schema(
        request=ExportSerializer, responses={(200, "application/zip"): OpenApiTypes.BINARY}
    )
    @action(
        detail=False,
        methods=["post"],
        url_path="bulk-export",
        renderer_classes=[JSONRenderer, ZipRenderer],
    )
    def bulk_export(self, request: Request) -> FileResponse:
        """Selected messages (``ids`` or ``filter``) as a zip of ``<qid>.eml`` files."""
        body = ExportSerializer(data=request.data)
        body.is_valid(raise_exception=True)
        data = body.validated_data
        if "ids" in data:
            qs, audit = Message.objects.filter(id__in=data["ids"]), {"ids": data["ids"]}
        else:
            params = _filter_params(data["filter"])
            qs, audit = MessageFilter.from_params(params).queryset(), {"filter": params}
        # Built in a temporary file, streamed from it; FileResponse closes it when done.
        out = actions.messages_export_zip_file(qs, request_actor(request), Via.API, **audit)
        stamp = clock.now().strftime("%Y%m%dT%H%M%SZ")
        return FileResponse(
            out,
            as_attachment=True,
            filename=f"messages-{stamp}.zip",
            content_type="application/zip",
        )


# --- one POST endpoint per action of the tables -------------------------------------


def _action_endpoint(spec: OperatorAction, serializer) -> Any:
    """``POST /<target>s/{id}/<name>/``: the action on one row, answering the row."""

    def endpoint(self, request: Request, pk=None) -> Response:
        target = self.get_object()
        ndr = None
        options: dict[str, Any] = {}
        if spec.takes_ndr:
            body = RemoveSerializer(data=request.data)
            body.is_valid(raise_exception=True)
            ndr = body.validated_data["ndr"]
        elif spec.params:
            body = ActionOptionsSerializer(data=request.data)
            body.is_valid(raise_exception=True)
            options = dict(body.validated_data)
        spec.run(target, request_actor(request), Via.API, ndr=ndr, **options)
        return Response(self.get_serializer(target).data)

    endpoint.__name__ = spec.name
    endpoint.__doc__ = spec.help[0].upper() + spec.help[1:] + "."
    body = RemoveSerializer if spec.takes_ndr else ActionOptionsSerializer if spec.params else None
    schema = extend_schema(request=body, responses=serializer)
    return schema(action(detail=True, methods=["post"])(endpoint))


for _spec in API_QUEUE_ACTIONS.values():
    setattr(QueueViewSet, _spec.name, _action_endpoint(_spec, QueueSerializer))
for _spec in API_MESSAGE_ACTIONS.values():
    setattr(MessageViewSet, _spec.name, _action_endpoint(_spec, MessageDetailSerializer))


# --- audit ---------------------------------------------------------------------------


class AuditViewSet(OperatorAPI, viewsets.GenericViewSet):
    """What operators did: who, what, on which ids or filter, how many, when."""

    queryset = AuditEntry.objects.all()
    serializer_class = AuditEntrySerializer
    permission_classes = [IsViewer]

    @extend_schema(
        parameters=[
            OpenApiParameter("action", str, description="e.g. queue_suspend, message_remove"),
            OpenApiParameter("actor", str),
            OpenApiParameter("target_type", str, description="queue or message"),
            OpenApiParameter("via", str, description="ui, api, cli or system"),
            OpenApiParameter("since", str, description="2h, 1d or ISO time"),
            *CURSOR_PARAMS,
        ],
        responses=_paginated(AuditEntrySerializer),
    )
    def list(self, request: Request) -> Response:
        _, cursor, limit = _page_params(request, 50, 500)
        page = audit_page(AuditFilter.from_params(request.query_params), cursor, limit)
        return _page_response(request, page, AuditEntrySerializer(page.items, many=True).data)

    def retrieve(self, request: Request, pk=None) -> Response:
        return Response(self.get_serializer(self.get_object()).data)


# --- summaries -------------------------------------------------------------------------


class QShapeView(OperatorAPI, APIView):
    """Waiting recipients per destination and age (minutes), like Postfix's qshape."""

    permission_classes = [IsViewer]
    renderer_classes = [JSONRenderer, BrowsableAPIRenderer]

    @extend_schema(
        parameters=[
            OpenApiParameter("by", str, description="queue (default) or domain"),
            OpenApiParameter("top", int, description="only the N largest rows"),
        ],
        responses=OpenApiTypes.OBJECT,
    )
    def get(self, request: Request) -> Response:
        by = request.query_params.get("by", "queue")
        if by not in ("queue", "domain"):
            raise BadRequest("by: queue or domain")
        top = (
            parse_limit(request.query_params.get("top"), 0, 100000)
            if request.query_params.get("top")
            else None
        )
        shape = qshape(clock.now(), by=by, top=top)
        return Response(
            {
                "buckets": shape.buckets,
                "total": vars(shape.total),
                "rows": [vars(r) for r in shape.rows],
            }
        )


class ErrorGroupsView(OperatorAPI, APIView):
    """Deferrals grouped by error: per queue, the distinct normalised last errors."""

    permission_classes = [IsViewer]

    @extend_schema(
        parameters=[OpenApiParameter("queue", int, description="only this queue")],
        responses=OpenApiTypes.OBJECT,
    )
    def get(self, request: Request) -> Response:
        raw = request.query_params.get("queue")
        queue_id = None
        if raw:
            if not (raw.isascii() and raw.isdigit()) or len(raw) > 18:
                raise BadRequest("queue: a queue id")
            queue_id = int(raw)
        base = request.build_absolute_uri("/api/v1/messages/")
        out = []
        for g in error_groups(queue_id):
            url = replace_query_param(base, "queue", g.queue_id)
            url = replace_query_param(url, "status", MessageStatus.RETRY)
            out.append(
                {
                    "queue": {"id": g.queue_id, "name": g.queue_name},
                    "code": g.code,
                    "enhanced": g.enhanced,
                    "text": g.text,
                    "recipients": g.recipients,
                    "other": g.other,  # several errors merged: the link is the queue's
                    "messages": url if g.other else replace_query_param(url, "error_group", g.text),
                }
            )
        return Response(out)
