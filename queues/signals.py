"""Signals of the queue store: the work it creates for the engine, and what the
engine did, for the read side.

``queues`` knows nothing of Celery, of the engine or of the read side: the
engine connects its doorbells to the first two (delivery.apps →
delivery.qmgr.tasks); tracking connects its recorders to the others
(tracking.apps), so the engine imports nothing of tracking.

Work signals are how every stage (ingress, categorizer, sweep, shaping,
pickup) and the operator surface say there is work; they are sent after the
commit of that work: ``transaction.on_commit(lambda:
categorizer_work.send(sender=None))`` inside a transaction.
Record signals are sent inside the transaction that wrote what they describe:
their receivers write in it too (tracking.record: in a savepoint of its own,
so a row that cannot be written never rolls back the delivery it describes).
"""

from django.dispatch import Signal

# Messages wait in Submission (new, resubmitted, or released by an operator).
categorizer_work = Signal()
# Recipients on link ``link_id`` became due (queue resumed, retry forced, ...).
# kwargs: link_id; countdown (seconds, optional): ring then, not now (raises
# when the broker cannot take it: the sender says what the sweep does instead).
link_work = Signal()

# --- what the engine did (sent in its transaction) -------------------------------

# The categorizer is about to route again recipients it may have routed
# before (their message categorized again: back to Submission, revived): a
# recipient's routing is its row (Recipient.routed_at, ...) and the new one
# replaces it. kwargs: ``recipient_ids``. (Tracking moves the previous
# routings into its own table: tracking.history.)
recipients_rerouting = Signal()
# The categorizer placed a batch. kwargs: ``placements`` (domain -> an object
# with ``recipient_ids`` and either ``route`` (queue_name, link_name) or
# ``error`` (permanent, enhanced, text)), ``now``, ``facts`` (the PLACED_FACTS
# of the recipients by id, when the categorizer loaded them; else None),
# ``placed`` (the ids of the routed recipients it placed: a row an expiry or
# an operator finished meanwhile is not; None: all).
recipients_placed = Signal()
# What ``recipients_placed`` carries of each recipient and its message, in this
# order (the categorizer loads them with the recipients it routes).
PLACED_FACTS = (
    "id",
    "address",
    "message_id",
    "message__qid",
    "message__mail_from",
    "message__message_id",
    "message__client_address",
    "message__auth_account",
    "message__size",
    "message__received_at",
    "message__next_attempt_at",
    "message__source",
    "message__event_id",
)
# A delivery round wrote its attempts. kwargs: ``attempts`` (queues.models.
# Attempt objects), ``rows`` (the round's recipients by id, with their new
# state), ``link``, ``now``, ``facts`` (qid, sender and Message-ID by message
# id, or None), ``owned`` (the ids of the recipients the round could still
# write; None: all).
attempts_recorded = Signal()
# The sweep expired ``recipients`` (queues.models.Recipient). kwargs:
# ``recipients``, ``now``, ``reason``.
recipients_expired = Signal()
# The sweep is about to delete finished messages (their rows and attempts),
# in the transaction that deletes them. kwargs: ``message_ids``. (Tracking
# moves their deliveries into its own table: tracking.history.)
messages_purging = Signal()
