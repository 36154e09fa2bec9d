"""The operator actions' refusals, shared by ``queues.services.actions`` and the
modules it delegates to (``reroute``, ``timed``, ``envelope_edits``)."""

from __future__ import annotations


class ActionConflict(Exception):
    """The action makes no sense in the current state; nothing was changed (HTTP 409)."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class ActionInvalid(ActionConflict):
    """An option of the action cannot be used (a bad next hop, a past time, a bad
    address); nothing was changed (HTTP 400). A subclass of ActionConflict, so
    every edge that refuses a conflict refuses this too."""


class ActionTooLarge(Exception):
    """A selection larger than the action allows (HTTP 400)."""
