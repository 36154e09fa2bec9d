"""Template context: the alert state the top bar shows (amber/red)."""

from __future__ import annotations

from typing import Any

from django.db import DatabaseError
from django.http import HttpRequest


def alerts(request: HttpRequest) -> dict[str, Any]:
    user = getattr(request, "user", None)
    if user is None or not user.is_authenticated:
        return {}
    from insight.alerts import worst_level

    try:
        level, count = worst_level()
    except DatabaseError:  # a page must still render when the table is unreadable
        return {}
    return {"alert_level": level, "alert_count": count}
