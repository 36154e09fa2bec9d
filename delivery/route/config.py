"""What the router reads from settings, once per process (``queues.config``)."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

from queues.config import setting, settings_reader


@dataclass(frozen=True, slots=True)
class RouteSettings:
    remote_smtp_port: int = setting("MAILRELAY_REMOTE_SMTP_PORT")  # unless a hop names one
    transports: str = setting("MAILRELAY_TRANSPORTS")  # as written (routing parses it)
    smart_host: str = setting("MAILRELAY_SMART_HOST")  # as written
    dns_nameservers: tuple[str, ...] = setting("MAILRELAY_DNS_NAMESERVERS", tuple)
    dns_timeout: timedelta = setting("MAILRELAY_DNS_TIMEOUT")


route_settings = settings_reader(RouteSettings)
