"""What insight reads from settings, once per process (``queues.config``).

What it explains of the engine's settings (the lease, the delay notice) it
reads from the engine's and the store's own frozen values.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from types import MappingProxyType

from queues.config import setting, settings_reader


@dataclass(frozen=True, slots=True)
class InsightSettings:
    alert_oldest_age: timedelta = setting("MAILRELAY_ALERT_OLDEST_AGE")
    # MAILRELAY_ALERT_OLDEST_AGE_QUEUES: by queue name (lower case)
    alert_oldest_age_queues: MappingProxyType[str, timedelta] = setting(
        "MAILRELAY_ALERT_OLDEST_AGE_QUEUES", lambda value: MappingProxyType(dict(value))
    )
    refresh_interval: timedelta = setting("MAILRELAY_INSIGHT_REFRESH_INTERVAL")
    live_limit: int = setting("MAILRELAY_INSIGHT_LIVE_LIMIT")
    glitch_retry_count: int = setting("MAILRELAY_QUEUE_GLITCH_RETRY_COUNT")
    transient_failure_retry_count: int = setting("MAILRELAY_TRANSIENT_FAILURE_RETRY_COUNT")


insight_settings = settings_reader(InsightSettings)
