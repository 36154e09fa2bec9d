"""Which database errors are an outage (the server is away: reconnect and try
again) and which are about the statement or its data (trying again gives the
same error: handle it as a failure of that work)."""

from __future__ import annotations

import logging

from django.db import InterfaceError, OperationalError, connection

log = logging.getLogger(__name__)

# SQLSTATE classes that say the statement or its data is wrong, never that the
# server is away: 22 data exception, 23 integrity constraint violation, 42
# syntax error or access rule violation, 54 program limit exceeded (an index
# row or a statement too large: psycopg files it under OperationalError).
NOT_AN_OUTAGE = frozenset({"22", "23", "42", "54"})


def sqlstate(exc: BaseException) -> str | None:
    """The SQLSTATE of a database error (Django's wraps the driver's), if any."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        state = getattr(current, "sqlstate", None) or getattr(current, "pgcode", None)
        if state:
            return str(state)
        current = current.__cause__  # Django raises its error from the driver's
    return None


def is_outage(exc: BaseException) -> bool:
    """True when ``exc`` means the database is unreachable or went away (a lost
    or refused connection, a server shutting down): worth a new connection and
    another try. A data error (too long a value, an index row over its limit, a
    constraint) is not, whatever class the driver gives it."""
    if isinstance(exc, InterfaceError):
        return True
    if not isinstance(exc, OperationalError):
        return False
    state = sqlstate(exc)
    return state is None or state[:2] not in NOT_AN_OUTAGE


def drop_connection() -> None:
    """Close this thread's database connection after an error: the next query
    opens a fresh one (the server may have restarted, or the connection is in
    an unknown state after a failed COMMIT)."""
    try:
        connection.close()
    except Exception:  # noqa: BLE001 - closing a broken connection may fail too
        log.debug("closing a broken database connection failed", exc_info=True)
