"""Back-pressure settings, read once when a monitor starts.

Each value comes from ``django.conf.settings`` when mailrelay/settings.py
defines it (so tests override it with the ``settings`` fixture), else from
the environment through the ``mailrelay.env`` helpers, with Exchange's
defaults. Bad values stop start-up naming the setting.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

from django.conf import settings
from django.core.exceptions import ImproperlyConfigured

from delivery.backpressure.engine import (
    PERCENT_RESOURCES,
    Resource,
    ResourceConfig,
    TarpitConfig,
)
from mailrelay.env import env_bool, env_duration, env_int, env_str

# Exchange's defaults: (normal, medium, high, history depth); 0 = the formula.
DEFAULTS: dict[Resource, tuple[int, int, int, int | None]] = {
    Resource.DATABASE_DISK_SPACE: (0, 0, 0, None),
    Resource.LOG_DISK_SPACE: (0, 0, 0, None),
    Resource.VERSION_BUCKETS: (80, 120, 200, 10),
    Resource.BATCH_POINTS: (1000, 2000, 4000, 300),
    Resource.PRIVATE_BYTES: (0, 0, 0, 30),
    Resource.PHYSICAL_MEMORY: (0, 0, 94, None),
    Resource.SUBMISSION_QUEUE: (2000, 4000, 10000, 300),
}
DEFAULT_INTERVAL = "2s"
DEFAULT_TARPIT = ("10s", "5s", "55s")


def _setting(name: str, from_env: Callable[[], Any]) -> Any:
    if hasattr(settings, name):
        return getattr(settings, name)
    return from_env()


def _int(name: str, default: int) -> int:
    value = _setting(name, lambda: env_int(name, default))
    if isinstance(value, bool) or not isinstance(value, int):
        raise ImproperlyConfigured(f"{name}: {value!r} is not an integer")
    if value < 0:
        raise ImproperlyConfigured(f"{name}: {value} is negative")
    return value


def _seconds(name: str, default: str) -> float:
    value = _setting(name, lambda: env_duration(name, default))
    if isinstance(value, timedelta):
        return value.total_seconds()
    if isinstance(value, int | float) and not isinstance(value, bool):
        return float(value)
    raise ImproperlyConfigured(f"{name}: {value!r} is not a duration")


def node_name() -> str:
    """``MAILRELAY_NODE_NAME``, else ``hostname:pid`` (one ingress process = one node)."""
    name = _setting("MAILRELAY_NODE_NAME", lambda: env_str("MAILRELAY_NODE_NAME", ""))
    return str(name) if name else f"{socket.gethostname()}:{os.getpid()}"


def _resource_config(resource: Resource) -> ResourceConfig:
    prefix = resource.setting_prefix
    normal, medium, high, depth = DEFAULTS[resource]
    config = ResourceConfig(
        normal=_int(f"{prefix}_NORMAL", normal),
        medium=_int(f"{prefix}_MEDIUM", medium),
        high=_int(f"{prefix}_HIGH", high),
        history_depth=_int(f"{prefix}_HISTORY_DEPTH", depth) if depth is not None else None,
    )
    if config.history_depth == 0:
        raise ImproperlyConfigured(f"{prefix}_HISTORY_DEPTH must be at least 1")
    if resource in PERCENT_RESOURCES:
        for level in ("normal", "medium", "high"):
            if getattr(config, level) > 100:
                raise ImproperlyConfigured(f"{prefix}_{level.upper()}: a percentage, 0..100")
    # Set thresholds must rise; 0 (a formula) is checked when it is resolved.
    given = [v for v in (config.normal, config.medium, config.high) if v]
    if resource not in PERCENT_RESOURCES:
        given = [config.normal, config.medium, config.high]
    if given != sorted(given):
        raise ImproperlyConfigured(
            f"{prefix}_NORMAL/_MEDIUM/_HIGH must not decrease "
            f"(got {config.normal}/{config.medium}/{config.high})"
        )
    return config


@dataclass(frozen=True)
class BackPressureConfig:
    enabled: bool = True
    interval: float = 2.0  # seconds
    resources: dict[Resource, ResourceConfig] = field(
        default_factory=lambda: {
            r: ResourceConfig(n, m, h, d) for r, (n, m, h, d) in DEFAULTS.items()
        }
    )
    tarpit: TarpitConfig = field(default_factory=TarpitConfig)
    database_path: str = ""  # "" = PostgreSQL's data directory when local, else SQLite's folder
    log_path: str = ""  # "" = the WAL directory when local
    node: str = ""

    @classmethod
    def from_settings(cls) -> BackPressureConfig:
        interval = _seconds("MAILRELAY_BP_MONITORING_INTERVAL", DEFAULT_INTERVAL)
        if interval <= 0:
            raise ImproperlyConfigured("MAILRELAY_BP_MONITORING_INTERVAL must be positive")
        start, step, maximum = DEFAULT_TARPIT
        tarpit = TarpitConfig(
            start=_seconds("MAILRELAY_BP_TARPIT_START", start),
            step=_seconds("MAILRELAY_BP_TARPIT_STEP", step),
            max=_seconds("MAILRELAY_BP_TARPIT_MAX", maximum),
        )
        if min(tarpit.start, tarpit.step, tarpit.max) < 0 or tarpit.start > tarpit.max:
            raise ImproperlyConfigured(
                "MAILRELAY_BP_TARPIT_START/_STEP/_MAX: not negative, and START at most MAX"
            )
        return cls(
            enabled=bool(
                _setting("MAILRELAY_BP_ENABLED", lambda: env_bool("MAILRELAY_BP_ENABLED", True))
            ),
            interval=interval,
            resources={resource: _resource_config(resource) for resource in Resource},
            tarpit=tarpit,
            database_path=str(
                _setting(
                    "MAILRELAY_BP_DATABASE_PATH", lambda: env_str("MAILRELAY_BP_DATABASE_PATH")
                )
                or ""
            ),
            log_path=str(
                _setting("MAILRELAY_BP_LOG_PATH", lambda: env_str("MAILRELAY_BP_LOG_PATH")) or ""
            ),
            node=node_name(),
        )
