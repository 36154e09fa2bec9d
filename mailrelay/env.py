"""Tiny helpers that read settings from the environment and fail loudly.

Every helper raises ``ImproperlyConfigured`` naming the variable when a
value cannot be parsed, so a typo stops start-up instead of running with a
silently wrong configuration.
"""

from __future__ import annotations

import ipaddress
import os
import re
from datetime import timedelta

from django.core.exceptions import ImproperlyConfigured

_SIZE_UNITS = {
    "": 1,
    "B": 1,
    "K": 1024,
    "KB": 1024,
    "M": 1024**2,
    "MB": 1024**2,
    "G": 1024**3,
    "GB": 1024**3,
}
_DURATION_PART = re.compile(r"(\d+(?:\.\d+)?)([wdhms])")
_DURATION_UNITS = {"w": 604800, "d": 86400, "h": 3600, "m": 60, "s": 1}
# Exchange's TimeSpan notation: [d.]hh:mm:ss
_TIMESPAN = re.compile(r"^(?:(\d+)\.)?(\d{1,2}):(\d{2}):(\d{2})$")


def _raw(name: str) -> str | None:
    value = os.environ.get(name)
    if value is None:
        path = os.environ.get(f"{name}_FILE")
        if path:
            with open(path) as fh:
                value = fh.read().strip()
    return value


def env_str(name: str, default: str = "") -> str:
    value = _raw(name)
    return default if value is None else value


def env_int(name: str, default: int) -> int:
    value = _raw(name)
    if value is None or value.strip() == "":
        return default
    try:
        return int(value)
    except ValueError:
        raise ImproperlyConfigured(f"{name}: {value!r} is not an integer") from None


def env_bool(name: str, default: bool) -> bool:
    value = _raw(name)
    if value is None or value.strip() == "":
        return default
    lowered = value.strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off"):
        return False
    raise ImproperlyConfigured(f"{name}: {value!r} is not a boolean (use true or false)")


def env_list(name: str, default: str = "") -> list[str]:
    value = env_str(name, default)
    return [item.strip() for item in value.split(",") if item.strip()]


def parse_size(text: str) -> int:
    """``35MB`` → 36700160; a bare number is bytes. Units are binary (K=1024)."""
    match = re.fullmatch(r"\s*(\d+)\s*([A-Za-z]*)\s*", text)
    if not match or match.group(2).upper() not in _SIZE_UNITS:
        raise ValueError(f"{text!r} is not a size (e.g. 35MB, 512K, 1048576)")
    return int(match.group(1)) * _SIZE_UNITS[match.group(2).upper()]


def env_size(name: str, default: str) -> int:
    value = env_str(name, default)
    try:
        return parse_size(value)
    except ValueError as exc:
        raise ImproperlyConfigured(f"{name}: {exc}") from None


def parse_duration(text: str) -> timedelta:
    """Parse ``90s``, ``15m``, ``2h``, ``2d``, ``1h30m``, or Exchange's ``d.hh:mm:ss``."""
    text = text.strip()
    span = _TIMESPAN.match(text)
    if span:
        days, hours, minutes, seconds = (int(g or 0) for g in span.groups())
        if minutes > 59 or seconds > 59:
            raise ValueError(f"{text!r} is not a duration")
        return timedelta(days=days, hours=hours, minutes=minutes, seconds=seconds)
    if not text:
        raise ValueError("empty duration")
    pos = 0
    total = 0.0
    for match in _DURATION_PART.finditer(text):
        if match.start() != pos:
            break
        total += float(match.group(1)) * _DURATION_UNITS[match.group(2)]
        pos = match.end()
    if pos != len(text):
        raise ValueError(f"{text!r} is not a duration (e.g. 90s, 15m, 2h, 2d, 1h30m, 1.00:00:00)")
    return timedelta(seconds=total)


def env_duration(name: str, default: str) -> timedelta:
    value = env_str(name, default)
    try:
        return parse_duration(value)
    except ValueError as exc:
        raise ImproperlyConfigured(f"{name}: {exc}") from None


def env_networks(name: str, default: str) -> list[ipaddress.IPv4Network | ipaddress.IPv6Network]:
    networks = []
    for item in env_list(name, default):
        try:
            networks.append(ipaddress.ip_network(item, strict=False))
        except ValueError:
            raise ImproperlyConfigured(f"{name}: {item!r} is not a network (CIDR)") from None
    return networks
