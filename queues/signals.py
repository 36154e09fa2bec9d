"""Signals the queue store sends when it creates work for the engine.

``queues`` knows nothing of Celery or of the delivery engine; the engine
connects its doorbells to these (delivery.apps). Send them after commit:
``transaction.on_commit(lambda: categorizer_work.send(sender=None))``.
"""

from django.dispatch import Signal

# Messages wait in Submission (new, resubmitted, or released by an operator).
categorizer_work = Signal()
# Recipients on link ``link_id`` became due (queue resumed, retry forced, ...).
link_work = Signal()  # kwargs: link_id
