"""What the tracking reads from settings, once per process (``queues.config``).

The event log reads its one setting itself (``tracking.eventlog.target``).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

from queues.config import setting, settings_reader


@dataclass(frozen=True, slots=True)
class TrackingSettings:
    retention: timedelta = setting("MAILRELAY_TRACKING_RETENTION")
    webhook_timeout: float = setting("MAILRELAY_WEBHOOK_TIMEOUT", timedelta.total_seconds)
    webhook_retry_for: timedelta = setting("MAILRELAY_WEBHOOK_RETRY_FOR")
    webhook_allow_private: bool = setting("MAILRELAY_WEBHOOK_ALLOW_PRIVATE")
    tls_ca_file: str = setting("MAILRELAY_TLS_CA_FILE")  # the webhooks' trust anchors too


tracking_settings = settings_reader(TrackingSettings)
