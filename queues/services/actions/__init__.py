"""Operator actions on queues and messages: the one implementation the Queue
Viewer, the REST API and the management commands all call.

Every action
- runs in one transaction, under row locks on what it changes (so a
  categorizer or a delivery that holds the same rows is never overtaken:
  they claim with SKIP LOCKED and pass over what we hold);
- refuses what makes no sense in the current state with ``ActionConflict``
  (HTTP 409) and then changes nothing;
- writes one ``AuditEntry`` in that same transaction;
- rings the engine's doorbells (``queues.signals``) after commit when it made
  work.

Bulk forms (``messages_apply``, ``queues_apply``) act on every message or
queue of a selection for which the action makes sense and skip the others;
they return how many they changed. ``messages_select`` / ``queues_select``
are the query that says which: the bulk form changes exactly its rows and
the preview (``queues.spec.OperatorAction.preview``) counts it.
"""

from __future__ import annotations

from queues.services.action_errors import ActionConflict, ActionInvalid, ActionTooLarge
from queues.services.actions.common import (
    CHUNK,
    EXPORT_PIECE,
    EXPORT_SPOOL,
    MAX_EXPORT,
    NO_OPTIONS,
    REMOVABLE_RECIPIENT_STATES,
    REMOVED_ENHANCED,
    ZIP_WRITE,
    Actor,
    MessageAction,
    Options,
    QueueAction,
    Via,
    _audit,
    actor_name,
    options_for,
)
from queues.services.actions.cores import (
    resume_messages,
)
from queues.services.actions.export import (
    EXPORT_FORMS,
    message_export,
    message_export_pieces,
    message_export_size,
    messages_export_zip,
    messages_export_zip_file,
)
from queues.services.actions.on_messages import (
    message_remove,
    message_resubmit,
    message_resume,
    message_retry,
    message_suspend,
)
from queues.services.actions.on_queues import (
    AUDIT_ROWS,
    PARKING_QUEUES,
    QUEUE_SELECTIONS,
    REROUTE_TO_MISSING,
    SAMPLE_QUEUES,
    QueueCore,
    queue_core,
    queue_reroute,
    queue_resubmit,
    queue_resume,
    queue_retry,
    queue_state,
    queue_suspend,
    queue_unroute,
    queues_apply,
    queues_select,
    timed_notes,
)
from queues.services.actions.selection import (
    MESSAGE_SELECTIONS,
    Preview,
    messages_apply,
    messages_preview,
    messages_select,
    queues_preview,
)

__all__ = [
    "AUDIT_ROWS",
    "ActionConflict",
    "ActionInvalid",
    "ActionTooLarge",
    "Actor",
    "CHUNK",
    "EXPORT_FORMS",
    "EXPORT_PIECE",
    "EXPORT_SPOOL",
    "MAX_EXPORT",
    "MESSAGE_SELECTIONS",
    "MessageAction",
    "NO_OPTIONS",
    "Options",
    "PARKING_QUEUES",
    "Preview",
    "QUEUE_SELECTIONS",
    "QueueAction",
    "QueueCore",
    "REMOVABLE_RECIPIENT_STATES",
    "REMOVED_ENHANCED",
    "REROUTE_TO_MISSING",
    "SAMPLE_QUEUES",
    "Via",
    "ZIP_WRITE",
    "_audit",
    "actor_name",
    "message_export",
    "message_export_pieces",
    "message_export_size",
    "message_remove",
    "message_resubmit",
    "message_resume",
    "message_retry",
    "message_suspend",
    "messages_apply",
    "messages_export_zip",
    "messages_export_zip_file",
    "messages_preview",
    "messages_select",
    "options_for",
    "queue_core",
    "queue_reroute",
    "queue_resubmit",
    "queue_resume",
    "queue_retry",
    "queue_state",
    "queue_suspend",
    "queue_unroute",
    "queues_apply",
    "queues_preview",
    "queues_select",
    "resume_messages",
    "timed_notes",
]
