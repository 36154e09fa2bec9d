"""The operator surface's one declaration of its filters and its actions.

Filters are declared in ``queues.filters`` (``MESSAGE_FILTERS``,
``QUEUE_FILTERS``: one ``FilterParam`` per parameter, next to the query that
reads them); this module renders those rows for each edge: the Queue
Viewer's form fields, the REST API's OpenAPI parameters and the commands'
options, so a new filter is one row there and one clause in the query.

Actions are declared here, once each (``MESSAGE_ACTIONS``, ``QUEUE_ACTIONS``):
name, service, label, past tense, help, required role, target type. The UI,
the API and the commands dispatch from these tables; the bulk preview and the
bulk action both run the action's own selection
(``actions.messages_select`` / ``actions.queues_select``), so a preview
counts exactly the rows the action changes.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from django import forms
from django.db.models import QuerySet
from drf_spectacular.utils import OpenApiParameter

from queues.filters import EDGES, FilterParam
from queues.permissions import OPERATOR, has_role
from queues.services import actions
from queues.services.actions import MessageAction

# --- filters, rendered for each edge -----------------------------------------------


def for_edge(table: Iterable[FilterParam], edge: str) -> list[FilterParam]:
    return [spec for spec in table if edge in spec.edges]


def form_field(spec: FilterParam) -> forms.Field:
    """The Queue Viewer's field for one parameter (the form only renders; parsing
    is ``FilterParam.parse``, the same for every edge)."""
    label = spec.label or spec.name.replace("_", " ").capitalize()
    common: dict[str, Any] = {"required": False, "label": label}
    if spec.kind == "choices":
        return forms.ChoiceField(choices=[("", "any"), *spec.choices()], **common)
    if spec.kind == "int":
        return forms.IntegerField(min_value=1, **common)
    if spec.kind == "bool":
        return forms.BooleanField(**common)
    return forms.CharField(help_text=spec.hint, **common)


def filter_form(name: str, table: Iterable[FilterParam], id_prefix: str) -> type[forms.Form]:
    """A form class with one field per parameter of ``table`` shown in the UI."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        forms.Form.__init__(self, *args, **kwargs)
        for field_name, field in self.fields.items():
            field.widget.attrs.setdefault("id", f"{id_prefix}{field_name}")
            if field.help_text:
                field.widget.attrs.setdefault("placeholder", field.help_text)

    attrs: dict[str, Any] = {s.name: form_field(s) for s in for_edge(table, "form")}
    attrs["__init__"] = __init__
    attrs["__module__"] = "queues.ui.forms"
    return type(name, (forms.Form,), attrs)


_OPENAPI_TYPES: dict[str, type] = {"int": int, "bool": bool}


def openapi_parameters(table: Iterable[FilterParam]) -> list[OpenApiParameter]:
    return [
        OpenApiParameter(s.name, _OPENAPI_TYPES.get(s.kind, str), description=s.help)
        for s in for_edge(table, "api")
    ]


def add_cli_filters(parser: argparse.ArgumentParser | Any, table: Iterable[FilterParam]) -> None:
    """One option per parameter: ``--older-than`` for ``older_than``."""
    for s in for_edge(table, "cli"):
        if s.kind == "bool":
            parser.add_argument(s.flag, dest=s.name, action="store_true", help=s.help)
        else:
            parser.add_argument(s.flag, dest=s.name, help=s.help)


def cli_params(options: Mapping[str, Any], table: Iterable[FilterParam]) -> dict[str, str]:
    """The options given, as the string parameters ``from_params`` reads."""
    params = {}
    for s in for_edge(table, "cli"):
        value = options.get(s.name)
        if value in (None, "", False):
            continue
        params[s.name] = "1" if value is True else str(value)
    return params


# --- actions ---------------------------------------------------------------------


@dataclass(frozen=True)
class OperatorAction:
    """One operator action, as every edge names, labels, authorises and runs it."""

    name: str  # the UI's, the API's and the command's name for it
    target: str  # "message" or "queue"
    service: Callable[..., int]  # the single-target service: (target, actor, via, **options)
    label: str  # button and confirmation page
    past: str  # the flash message after it
    help: str  # the command's help and the API's description
    role: str = OPERATOR  # the least role that may run it
    bulk: str = ""  # the bulk service's action (MessageAction/QueueAction); default: name
    ndr: bool = False  # remove: with a non-delivery report
    edges: frozenset[str] = EDGES

    @property
    def bulk_action(self) -> str:
        return self.bulk or self.name

    @property
    def takes_ndr(self) -> bool:
        """The API's body and the command's ``--ndr`` may ask for an NDR."""
        return self.bulk_action == MessageAction.REMOVE

    def allowed(self, user: Any) -> bool:
        return has_role(user, self.role)

    def _options(self, ndr: bool | None) -> dict[str, Any]:
        if not self.takes_ndr:
            return {}
        return {"ndr": self.ndr if ndr is None else ndr}

    def run(self, obj: Any, actor: Any, via: str, *, ndr: bool | None = None) -> int:
        """The action on one message or queue (ActionConflict when it makes no sense)."""
        return self.service(obj, actor, via, **self._options(ndr))

    def select(self, queryset: QuerySet) -> QuerySet:
        """The rows of a selection this action changes (what the preview counts)."""
        if self.target == "message":
            return actions.messages_select(self.bulk_action, queryset)
        return actions.queues_select(self.bulk_action, queryset)

    def preview(self, queryset: QuerySet) -> int:
        return self.select(queryset).count()

    def apply(
        self,
        queryset: QuerySet,
        actor: Any,
        via: str,
        *,
        ndr: bool | None = None,
        ids: Sequence[int] = (),
        filter: Mapping[str, Any] | None = None,
    ) -> int:
        """The action on every row of ``select(queryset)``; returns how many changed."""
        if self.target == "message":
            return actions.messages_apply(
                self.bulk_action,
                queryset,
                actor,
                via,
                ids=ids,
                filter=filter,
                **self._options(ndr),
            )
        return actions.queues_apply(self.bulk_action, queryset, actor, via, ids=ids, filter=filter)


_UI_ONLY = frozenset({"form"})

MESSAGE_ACTIONS: dict[str, OperatorAction] = {
    a.name: a
    for a in (
        OperatorAction(
            "suspend",
            "message",
            actions.message_suspend,
            "Suspend",
            "Suspended",
            "hold messages: no recipient is tried until resumed",
        ),
        OperatorAction(
            "resume",
            "message",
            actions.message_resume,
            "Resume",
            "Resumed",
            "release held messages (one parked in Poison goes back to the categorizer)",
        ),
        OperatorAction(
            "resubmit",
            "message",
            actions.message_resubmit,
            "Resubmit",
            "Resubmitted",
            "send messages back to the categorizer (dead letters too, with a fresh expiry)",
        ),
        OperatorAction(
            "remove",
            "message",
            actions.message_remove,
            "Remove without NDR",
            "Removed (no NDR)",
            "fail every recipient not yet final (with ndr: send a non-delivery report)",
        ),
        OperatorAction(
            "remove_ndr",
            "message",
            actions.message_remove,
            "Remove with NDR",
            "Removed with NDR",
            "fail every recipient not yet final and send a non-delivery report",
            bulk=MessageAction.REMOVE,
            ndr=True,
            edges=_UI_ONLY,  # the API and the command say remove with ndr
        ),
    )
}

QUEUE_ACTIONS: dict[str, OperatorAction] = {
    a.name: a
    for a in (
        OperatorAction(
            "retry",
            "queue",
            actions.queue_retry,
            "Retry now",
            "Retrying",
            "try now: clear the link's retry time, make the waiting messages due now",
        ),
        OperatorAction(
            "resubmit",
            "queue",
            actions.queue_resubmit,
            "Resubmit",
            "Resubmitted",
            "send the waiting messages back to the categorizer",
        ),
        OperatorAction(
            "suspend",
            "queue",
            actions.queue_suspend,
            "Suspend",
            "Suspended",
            "stop delivering from the queue",
        ),
        OperatorAction(
            "resume",
            "queue",
            actions.queue_resume,
            "Resume",
            "Resumed",
            "deliver from the queue again",
        ),
    )
}


def actions_for(table: Mapping[str, OperatorAction], edge: str) -> dict[str, OperatorAction]:
    return {name: a for name, a in table.items() if edge in a.edges}


__all__ = [
    "MESSAGE_ACTIONS",
    "QUEUE_ACTIONS",
    "OperatorAction",
    "actions_for",
    "add_cli_filters",
    "cli_params",
    "filter_form",
    "for_edge",
    "form_field",
    "openapi_parameters",
]
