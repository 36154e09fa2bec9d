"""What a delivery round reads from settings, once per process (``queues.config``).

The SMTP session's own limits (timeouts, connections, messages a connection)
are ``clientconfig.ClientConfig``, read once per process by ``deliver``; the
claims' lease is the store's (``queues.config.store_settings``).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

from queues.config import setting, settings_reader


@dataclass(frozen=True, slots=True)
class RoundSettings:
    round_bytes: int = setting("MAILRELAY_DELIVERY_ROUND_BYTES")
    round_wait: float = setting("MAILRELAY_DELIVERY_ROUND_WAIT", timedelta.total_seconds)
    shaping: str = setting("MAILRELAY_SHAPING")  # the policy file, or "": the built-in limits
    message_retry_interval: timedelta = setting("MAILRELAY_MESSAGE_RETRY_INTERVAL")
    tls_policy: str = setting("MAILRELAY_TLS_POLICY", str.strip)  # the file, or ""
    tls_default_level: str = setting("MAILRELAY_TLS_DEFAULT_LEVEL")
    tls_ca_file: str = setting("MAILRELAY_TLS_CA_FILE")  # "": the system's trust anchors
    mta_sts: bool = setting("MAILRELAY_MTA_STS")
    mta_sts_port: int = setting("MAILRELAY_MTA_STS_PORT")
    mta_sts_fetch_timeout: timedelta = setting("MAILRELAY_MTA_STS_FETCH_TIMEOUT")
    mta_sts_allow_private: bool = setting("MAILRELAY_MTA_STS_ALLOW_PRIVATE")
    smtp_auth: str = setting("MAILRELAY_SMTP_AUTH")  # a path, or the table (a _FILE secret)


round_settings = settings_reader(RoundSettings)
