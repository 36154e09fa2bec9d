"""The operator actions' shared parts: names, options, the audit, the bells."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from django.contrib.auth.models import AbstractBaseUser
from django.db import models, transaction

from queues.lib import clock
from queues.models import (
    AuditEntry,
    RecipientState,
)
from queues.services.until import parse_until
from queues.signals import categorizer_work, link_work

# A removed recipient's status. RFC 3463 X.7.0 ("other or undefined security
# or policy status"): the removal is an administrative decision of this
# relay, and the X.7 class says so without blaming the address (X.1), the
# mailbox (X.2), the destination system (X.3), the network (X.4) or the
# content (X.6). Permanent (5): the message will not be tried again.
REMOVED_ENHANCED = "5.7.0"

CHUNK = 1000  # ids per statement in bulk actions
# What a removal fails: every recipient not final and not in flight.
REMOVABLE_RECIPIENT_STATES = (
    RecipientState.SUBMITTED,
    RecipientState.QUEUED,
    RecipientState.DEFERRED,
)
MAX_EXPORT = 1000  # messages in one bulk export
# A zip export reads each body in pieces of this size (SUBSTRING on the server),
# so it holds one piece at a time, however large the messages.
EXPORT_PIECE = 1024 * 1024
# A zip export stays in memory up to this size, then goes to a temporary file.
EXPORT_SPOOL = 1024 * 1024
# A piece goes into the zip in slices of this size: the compressor's output for
# one call stays small.
ZIP_WRITE = 64 * 1024

Actor = AbstractBaseUser | str


class Via(models.TextChoices):
    UI = "ui", "Queue Viewer"
    API = "api", "REST API"
    CLI = "cli", "command line"
    SYSTEM = "system", "the relay itself"  # timed ends (queues.services.timed), actor "system"


# The services' action names. Labels, past tenses, help and roles are the
# operator surface's, declared once in queues.spec.
class MessageAction(models.TextChoices):
    SUSPEND = "suspend"
    RESUME = "resume"
    RESUBMIT = "resubmit"
    RETRY = "retry"
    REMOVE = "remove"


class QueueAction(models.TextChoices):
    RETRY = "retry"
    RESUBMIT = "resubmit"
    SUSPEND = "suspend"
    RESUME = "resume"
    REROUTE = "reroute"
    UNROUTE = "unroute"


@dataclass(frozen=True)
class Options:
    """What an action takes besides its target: ``until`` (suspend, reroute: a
    time, None for no end), ``to`` (reroute: the next hop) and ``by`` (the actor's
    name, kept on the row as ``suspended_by`` / ``reroute_by``)."""

    until: datetime | None = None
    to: str = ""
    by: str = ""


NO_OPTIONS = Options()


def options_for(actor: Actor, now: datetime, until: Any = None, to: str = "") -> Options:
    """The options as the edges pass them (``until`` as text), checked: ActionInvalid."""
    return Options(
        until=parse_until(until, now), to=" ".join((to or "").split()), by=actor_name(actor)
    )


# --- audit ------------------------------------------------------------------------


def actor_name(actor: Actor) -> str:
    if isinstance(actor, str):
        return actor
    return actor.get_username()


def _audit(
    actor: Actor,
    via: str,
    action: str,
    target_type: str,
    *,
    ids: Sequence[int] = (),
    filter: Mapping[str, Any] | None = None,
    count: int = 0,
    detail: str = "",
    changed: Sequence[int] | None = None,
) -> AuditEntry:
    """The audit entry (``ids``: what the operator named). ``changed``: the rows the
    action really changed, when it knows them; the message tracking log records
    the action on those (tracking.record.on_audit), not on what was only named."""
    entry = AuditEntry(
        created_at=clock.now(),
        actor=None if isinstance(actor, str) else actor,
        actor_name=actor_name(actor)[:150],
        via=Via(via).value,
        action=action,
        target_type=target_type,
        target_ids=list(ids),
        filter=dict(filter or {}),
        count=count,
        detail=detail,
    )
    if changed is not None:
        entry.changed_ids = list(changed)  # read by the post_save hook
    entry.save()
    return entry


def _after_commit_categorizer() -> None:
    transaction.on_commit(lambda: categorizer_work.send(sender=None))


def _after_commit_links(link_ids: Iterable[int]) -> None:
    for link_id in sorted(set(link_ids)):
        transaction.on_commit(lambda link_id=link_id: link_work.send(sender=None, link_id=link_id))


def _chunks(ids: Sequence[int], size: int = CHUNK) -> Iterable[list[int]]:
    for start in range(0, len(ids), size):
        yield list(ids[start : start + size])
