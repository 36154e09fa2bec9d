"""Back-pressure settings, read once when a monitor starts.

Every value comes from ``django.conf.settings`` (mailrelay/settings.py reads
the environment and holds Exchange's defaults; tests override a value with
the ``settings`` fixture before the config is built). This module only
converts and checks them: bad values stop start-up naming the setting.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta

from django.conf import settings
from django.core.exceptions import ImproperlyConfigured

from delivery.backpressure.engine import (
    PERCENT_RESOURCES,
    Resource,
    ResourceConfig,
    TarpitConfig,
)

# Resources without a history depth in Exchange (no MAILRELAY_BP_<RESOURCE>_HISTORY_DEPTH).
NO_HISTORY_DEPTH = frozenset(
    {Resource.DATABASE_DISK_SPACE, Resource.LOG_DISK_SPACE, Resource.PHYSICAL_MEMORY}
)


def _int(name: str) -> int:
    value = getattr(settings, name)
    if isinstance(value, bool) or not isinstance(value, int):
        raise ImproperlyConfigured(f"{name}: {value!r} is not an integer")
    if value < 0:
        raise ImproperlyConfigured(f"{name}: {value} is negative")
    return value


def _seconds(name: str) -> float:
    value = getattr(settings, name)
    if isinstance(value, timedelta):
        return value.total_seconds()
    if isinstance(value, int | float) and not isinstance(value, bool):
        return float(value)
    raise ImproperlyConfigured(f"{name}: {value!r} is not a duration")


def default_node_name() -> str:
    """``hostname:pid``, the node name when MAILRELAY_NODE_NAME is empty (a process = a node)."""
    return f"{socket.gethostname()}:{os.getpid()}"


def _resource_config(resource: Resource) -> ResourceConfig:
    prefix = resource.setting_prefix
    config = ResourceConfig(
        normal=_int(f"{prefix}_NORMAL"),
        medium=_int(f"{prefix}_MEDIUM"),
        high=_int(f"{prefix}_HIGH"),
        history_depth=None if resource in NO_HISTORY_DEPTH else _int(f"{prefix}_HISTORY_DEPTH"),
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


def _tarpit() -> TarpitConfig:
    tarpit = TarpitConfig(
        start=_seconds("MAILRELAY_BP_TARPIT_START"),
        step=_seconds("MAILRELAY_BP_TARPIT_STEP"),
        max=_seconds("MAILRELAY_BP_TARPIT_MAX"),
    )
    if min(tarpit.start, tarpit.step, tarpit.max) < 0 or tarpit.start > tarpit.max:
        raise ImproperlyConfigured(
            "MAILRELAY_BP_TARPIT_START/_STEP/_MAX: not negative, and START at most MAX"
        )
    return tarpit


@dataclass(frozen=True)
class BackPressureConfig:
    enabled: bool
    interval: float  # seconds
    resources: Mapping[Resource, ResourceConfig]
    tarpit: TarpitConfig
    database_path: str = ""  # "" = PostgreSQL's data directory when local, else SQLite's folder
    log_path: str = ""  # "" = the WAL directory when local
    node: str = ""  # "" = default_node_name()

    @classmethod
    def from_settings(cls) -> BackPressureConfig:
        interval = _seconds("MAILRELAY_BP_MONITORING_INTERVAL")
        if interval <= 0:
            raise ImproperlyConfigured("MAILRELAY_BP_MONITORING_INTERVAL must be positive")
        return cls(
            enabled=bool(settings.MAILRELAY_BP_ENABLED),
            interval=interval,
            resources={resource: _resource_config(resource) for resource in Resource},
            tarpit=_tarpit(),
            database_path=str(settings.MAILRELAY_BP_DATABASE_PATH or ""),
            log_path=str(settings.MAILRELAY_BP_LOG_PATH or ""),
            node=str(settings.MAILRELAY_NODE_NAME or "") or default_node_name(),
        )
