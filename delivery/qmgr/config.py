"""What the queue manager reads from settings, once per process (``queues.config``).

The claims' lease and the message expiration are the store's
(``queues.config.store_settings``).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

from queues.config import setting, settings_reader


@dataclass(frozen=True, slots=True)
class QmgrSettings:
    categorizer_batch: int = setting("MAILRELAY_CATEGORIZER_BATCH")
    categorizer_batch_wait: float = setting(
        "MAILRELAY_CATEGORIZER_BATCH_WAIT", timedelta.total_seconds
    )
    categorizer_retry_interval: timedelta = setting("MAILRELAY_CATEGORIZER_RETRY_INTERVAL")
    completed_retention: timedelta = setting("MAILRELAY_COMPLETED_RETENTION")
    dead_letter_retention: timedelta = setting("MAILRELAY_DEAD_LETTER_RETENTION")
    delay_notification_timeout: timedelta = setting("MAILRELAY_DELAY_NOTIFICATION_TIMEOUT")
    max_idle_time_before_resubmit: timedelta = setting("MAILRELAY_MAX_IDLE_TIME_BEFORE_RESUBMIT")


qmgr_settings = settings_reader(QmgrSettings)
