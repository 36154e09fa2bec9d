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
from queues.lib import clock
from queues.permissions import OPERATOR, has_role
from queues.services import actions
from queues.services.actions import ActionInvalid, MessageAction, Preview

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


def add_action_options(parser: argparse.ArgumentParser | Any, action: OperatorAction) -> None:
    """``--dry-run`` and one option per option the action takes (``--until``,
    ``--to``; ``--set-recipient``/``--set-sender``, as ``--sender`` is a filter)."""
    parser.add_argument(
        "--dry-run",
        action="store_true",
        help="only say what it would do (changes, skips, failures, NDRs); change nothing",
    )
    for name in action.params:
        parser.add_argument(
            CLI_OPTION_FLAGS.get(name, f"--{name}"), dest=f"option_{name}", help=OPTION_HELP[name]
        )


def cli_options(options: Mapping[str, Any]) -> dict[str, Any]:
    """The action options given to a command (``add_action_options``)."""
    out = {}
    for name in OPTION_HELP:
        value = options.get(f"option_{name}")
        if value not in (None, ""):
            out[name] = value
    return out


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
    # The options it takes besides its target (OPTION_HELP), singly and in bulk.
    params: tuple[str, ...] = ()
    bulk_params: tuple[str, ...] | None = None  # default: params
    # The options it cannot do without (reroute: to); missing: ActionInvalid (HTTP 400).
    required: tuple[str, ...] = ()

    @property
    def bulk_action(self) -> str:
        return self.bulk or self.name

    @property
    def takes_ndr(self) -> bool:
        """The API's body and the command's ``--ndr`` may ask for an NDR."""
        return self.bulk_action == MessageAction.REMOVE

    def allowed(self, user: Any) -> bool:
        return has_role(user, self.role)

    @property
    def takes_in_bulk(self) -> tuple[str, ...]:
        return self.params if self.bulk_params is None else self.bulk_params

    def _options(
        self, ndr: bool | None, options: Mapping[str, Any], allowed: tuple[str, ...]
    ) -> dict[str, Any]:
        """The options given (None/"" are not given); ActionInvalid for one it does not take."""
        out: dict[str, Any] = {}
        for key, value in options.items():
            if value is None or value == "":
                continue
            if key not in allowed:
                how = " (in bulk)" if key in self.params else ""
                raise ActionInvalid(f"{key}: {self.name} takes no {key}{how}")
            out[key] = value
        if self.takes_ndr:
            out["ndr"] = self.ndr if ndr is None else ndr
        return out

    def require(self, options: Mapping[str, Any]) -> None:
        """ActionInvalid for an option the action cannot do without (reroute: to)."""
        for key in self.required:
            if not str(options.get(key) or "").strip():
                raise ActionInvalid(f"{key}: {self.name} needs {key}: {OPTION_HELP[key]}")

    def run(self, obj: Any, actor: Any, via: str, *, ndr: bool | None = None, **options) -> int:
        """The action on one message or queue (ActionConflict when it makes no sense)."""
        return self.service(obj, actor, via, **self._options(ndr, options, self.params))

    def select(self, queryset: QuerySet, **options: Any) -> QuerySet:
        """The rows of a selection this action changes (what the preview counts)."""
        if self.target == "message":
            return actions.messages_select(self.bulk_action, queryset)
        opts = self._options(None, options, self.takes_in_bulk)
        checked = actions.options_for("", clock.now(), **opts)
        return actions.queues_select(self.bulk_action, queryset, checked)

    def preview(self, queryset: QuerySet, **options: Any) -> int:
        return self.select(queryset, **options).count()

    def dry_run(
        self,
        queryset: QuerySet,
        *,
        ndr: bool | None = None,
        partial: bool = False,
        **options: Any,
    ) -> Preview:
        """What ``apply`` would do with these arguments: how many it changes and the
        consequences (recipients failing, NDRs and their senders, rows skipped in
        flight), from the action's own queries; nothing changes. A required option
        missing is ActionInvalid, unless ``partial`` (a form that asks for it next:
        the count is then what any value would change)."""
        opts = self._options(ndr, options, self.takes_in_bulk)
        if not partial:
            self.require(opts)
        if self.target == "message":
            return actions.messages_preview(self.bulk_action, queryset, **opts)
        return actions.queues_preview(self.bulk_action, queryset, **opts)

    def apply(
        self,
        queryset: QuerySet,
        actor: Any,
        via: str,
        *,
        ndr: bool | None = None,
        ids: Sequence[int] = (),
        filter: Mapping[str, Any] | None = None,
        **options: Any,
    ) -> int:
        """The action on every row of ``select(queryset)``; returns how many changed."""
        opts = self._options(ndr, options, self.takes_in_bulk)
        self.require(opts)
        if self.target == "message":
            return actions.messages_apply(
                self.bulk_action, queryset, actor, via, ids=ids, filter=filter, **opts
            )
        return actions.queues_apply(
            self.bulk_action, queryset, actor, via, ids=ids, filter=filter, **opts
        )


_UI_ONLY = frozenset({"form"})

# The command-line flags of the options that would clash with a filter's.
CLI_OPTION_FLAGS = {"recipient": "--set-recipient", "sender": "--set-sender"}

# The options an action may take, with their help for every edge.
OPTION_HELP: dict[str, str] = {
    "until": "when it ends by itself: a duration (90s, 2h, 1d) or a time "
    "(2026-05-01T08:00:00Z); empty: until undone by hand",
    "to": "the next hop to send the mail to instead: [10.0.0.9]:25, [host]:port or a "
    "smart host name (looked up for MX)",
    "recipient": "dead letters: the corrected recipient (new@example.net, or "
    "old@example.net=new@example.net when it has several)",
    "sender": "dead letters: the corrected envelope sender (<> for the null sender)",
}

MESSAGE_ACTIONS: dict[str, OperatorAction] = {
    a.name: a
    for a in (
        OperatorAction(
            "suspend",
            "message",
            actions.message_suspend,
            "Suspend",
            "Suspended",
            "hold messages: no recipient is tried until resumed (or until the time given)",
            params=("until",),
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
            "send messages back to the categorizer (dead letters too, with a fresh expiry; "
            "a dead letter may get a corrected recipient or sender)",
            params=("recipient", "sender"),
            bulk_params=(),
        ),
        OperatorAction(
            "retry",
            "message",
            actions.message_retry,
            "Retry now",
            "Retrying",
            "try now (Postfix's postqueue -i): waiting recipients due now, their links' "
            "retry time cleared; those in Unreachable are routed again now",
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
            "stop delivering from the queue (until resumed, or until the time given)",
            params=("until",),
        ),
        OperatorAction(
            "resume",
            "queue",
            actions.queue_resume,
            "Resume",
            "Resumed",
            "deliver from the queue again",
        ),
        OperatorAction(
            "reroute",
            "queue",
            actions.queue_reroute,
            "Re-route",
            "Re-routed",
            "send the queue's mail to another next hop (until unrouted, or until the time "
            "given); its waiting messages are due there now",
            params=("to", "until"),
            required=("to",),
        ),
        OperatorAction(
            "unroute",
            "queue",
            actions.queue_unroute,
            "End re-route",
            "Re-route ended for",
            "end a re-route: the queue goes back to the next hop routing gave it",
        ),
    )
}


def actions_for(table: Mapping[str, OperatorAction], edge: str) -> dict[str, OperatorAction]:
    return {name: a for name, a in table.items() if edge in a.edges}


__all__ = [
    "MESSAGE_ACTIONS",
    "OPTION_HELP",
    "QUEUE_ACTIONS",
    "OperatorAction",
    "actions_for",
    "add_action_options",
    "add_cli_filters",
    "cli_options",
    "cli_params",
    "filter_form",
    "for_edge",
    "form_field",
    "openapi_parameters",
]
