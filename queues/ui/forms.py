"""Forms of the Queue Viewer: they render the filter bars; queues.filters parses them.

The fields come from the filter declarations (``queues.filters.MESSAGE_FILTERS``
and ``QUEUE_FILTERS``, rendered by ``queues.spec.filter_form``): the same
names, meanings and parsing as the API's query parameters and the commands'
options. These forms only render; ``from_params`` parses.
"""

from __future__ import annotations

from queues.filters import MESSAGE_FILTERS, QUEUE_FILTERS
from queues.spec import filter_form

# The parameters of queues.filters.MessageFilter (same names), widget ids f-<name>.
MessageFilterForm = filter_form("MessageFilterForm", MESSAGE_FILTERS, "f-")
# The parameters of queues.filters.QueueFilter (same names), widget ids qf-<name>.
QueueFilterForm = filter_form("QueueFilterForm", QUEUE_FILTERS, "qf-")
