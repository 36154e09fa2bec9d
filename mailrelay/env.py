"""Tiny helpers that read settings from the environment and fail loudly.

Every helper raises ``ImproperlyConfigured`` naming the variable when a
value cannot be parsed, so a typo stops start-up instead of running with a
silently wrong configuration.
"""

from __future__ import annotations

import ipaddress
import os
from datetime import timedelta

from django.core.exceptions import ImproperlyConfigured

from queues.lib import parse_duration, parse_size  # noqa: F401 - re-exported


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


def env_size(name: str, default: str) -> int:
    value = env_str(name, default)
    try:
        return parse_size(value)
    except ValueError as exc:
        raise ImproperlyConfigured(f"{name}: {exc}") from None


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
