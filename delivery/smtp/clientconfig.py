"""The SMTP client's configuration: its timeouts and limits, read from settings
once per process (``deliver.client_config``), and what a round adds to it (the
TLS requirement and AUTH account of each target, shaping's source address)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from delivery.smtp.tls import Credentials, TlsRequirement
from delivery.smtp.types import Peer
from queues.lib import seconds

# RFC 5321 §4.5.3.2: the client waits up to 10 minutes for the reply to the
# final dot, longer than for any command.
MIN_DATA_TIMEOUT = 600.0


@dataclass(frozen=True)
class ClientConfig:
    helo_name: str
    connect_timeout: float = 30.0
    # Every command reply (greeting, EHLO, MAIL, RCPT, DATA, RSET).
    command_timeout: float = 300.0
    # Sending the message body and waiting for the reply to the final dot.
    data_timeout: float = MIN_DATA_TIMEOUT
    max_messages_per_connection: int = 20
    max_connections: int = 20
    # Per target: the TLS requirement (None: "may" everywhere) and the AUTH
    # credentials (None: no AUTH); see delivery.smtp.client.RoundTls.
    tls_for: Callable[[Peer], TlsRequirement] | None = None
    auth_for: Callable[[Peer], Credentials | None] | None = None
    # Source addresses to bind (at most one IPv4, one IPv6; delivery.shaping):
    # the one of the target's family is used, none of it: the system's choice.
    source_address: tuple[str, ...] = ()
    # AUTH credentials over TLS whose certificate was not verified (MITM-able):
    # refused unless the operator allows it (MAILRELAY_SMTP_AUTH_ALLOW_UNVERIFIED_TLS).
    auth_over_unverified_tls: bool = False

    @classmethod
    def from_settings(cls) -> ClientConfig:
        from django.conf import settings

        command = seconds(settings.MAILRELAY_SMTP_CLIENT_TIMEOUT)
        data = settings.MAILRELAY_SMTP_DATA_TIMEOUT
        return cls(
            helo_name=settings.MAILRELAY_HOSTNAME,
            connect_timeout=seconds(settings.MAILRELAY_SMTP_CONNECT_TIMEOUT),
            command_timeout=command,
            data_timeout=seconds(data) if data is not None else max(command, MIN_DATA_TIMEOUT),
            max_messages_per_connection=int(settings.MAILRELAY_MAX_MESSAGES_PER_CONNECTION),
            max_connections=int(settings.MAILRELAY_MAX_CONNECTIONS_PER_DESTINATION),
            auth_over_unverified_tls=settings.MAILRELAY_SMTP_AUTH_ALLOW_UNVERIFIED_TLS,
        )
