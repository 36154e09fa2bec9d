"""Unit conversions shared by the delivery layer.

Duration settings are ``timedelta`` objects (``mailrelay.env.env_duration``),
but callers and tests may pass plain numbers of seconds; asyncio and
dnspython want a float. One helper, so every subsystem converts alike.
"""

from __future__ import annotations

from datetime import timedelta


def seconds(value: timedelta | float | int) -> float:
    """``value`` as float seconds: a ``timedelta`` or a number of seconds."""
    return value.total_seconds() if isinstance(value, timedelta) else float(value)
