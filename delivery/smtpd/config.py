"""What the inbound server reads from settings, once, when it starts; its TLS certificate.

``InboundConfig.from_settings`` is the only place the ingress reads
``django.conf.settings``: sessions and the DATA handler read the frozen
config they were given, so no message costs a settings lookup.
"""

from __future__ import annotations

import logging
import os
import resource
import ssl
from dataclasses import dataclass

from django.conf import settings
from django.core.exceptions import ImproperlyConfigured

from delivery.smtpd import policy

log = logging.getLogger(__name__)

# Listener kinds: the relay port, submission with STARTTLS (587), implicit TLS (465).
SMTP_LISTENER = "smtp"
SUBMISSION = "submission"
SUBMISSIONS = "submissions"


def parse_listen(text: str) -> tuple[str, int]:
    """``127.0.0.1:2525`` → ("127.0.0.1", 2525); ``[::1]:25``; ``*:25`` or ``:25`` = all."""
    text = text.strip()
    if text.startswith("["):
        host, sep, port = text[1:].partition("]:")
    else:
        host, sep, port = text.rpartition(":")
        if ":" in host:
            raise ValueError(f"{text!r}: write an IPv6 address as [addr]:port")
    if not sep or not port.isdigit() or int(port) > 65535:
        raise ValueError(f"{text!r} is not host:port (e.g. 127.0.0.1:2525 or [::1]:2525)")
    return ("" if host in ("", "*") else host), int(port)


def format_address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


FILE_LIMIT_SPARE = 256  # descriptors besides client sockets: listeners, database, logs, spool


def raise_file_limit(connections: int) -> tuple[int, int]:
    """Raise the soft RLIMIT_NOFILE towards the hard limit so ``connections`` fit.

    Returns (soft, needed). A soft limit below ``needed`` (a low hard limit)
    only means EMFILE past it: asyncio then pauses accepting for a second and
    resumes, and the sessions already open go on.
    """
    needed = connections + FILE_LIMIT_SPARE
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = needed if hard == resource.RLIM_INFINITY else min(needed, hard)
    if soft != resource.RLIM_INFINITY and soft < target:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        soft = target
    return soft, needed


@dataclass(frozen=True)
class InboundConfig:
    """What the server reads from settings, once, when it starts."""

    hostname: str
    accepted_domains: frozenset[str]
    relay_networks: tuple[policy.IPNetwork, ...]
    max_message_size: int
    max_recipients: int
    timeout: float
    # The certificate for STARTTLS and implicit TLS, re-read when its files change.
    tls: TlsCertificate | None = None
    # Limits (issue #9; Postfix's anvil and smtpd_* limits are the reference). 0 = no limit.
    max_connections: int = 1000
    max_connections_per_client: int = 50  # relay networks are exempt
    max_session_time: float = 3600.0
    junk_command_limit: int = 100
    min_data_rate: int = 500  # bytes/second during DATA
    # AUTH failures within AUTH_FAILURE_WINDOW (authlimit, shared in the cache); 0 = no limit
    max_auth_failures: int = 5  # per client address
    max_auth_failures_per_user: int = 10  # per username, from any address
    processes: int = 1  # runsmtp processes: each one's share of the limits when the cache is down
    # The message header (Postfix's header_size_limit, per field; a count of fields). 0 = none.
    max_header_fields: int = 1000
    max_header_size: int = 102400

    @classmethod
    def from_settings(cls) -> InboundConfig:
        return cls(
            hostname=settings.MAILRELAY_HOSTNAME,
            accepted_domains=frozenset(
                policy.domain_key(d) for d in settings.MAILRELAY_ACCEPTED_DOMAINS
            ),
            relay_networks=tuple(settings.MAILRELAY_RELAY_NETWORKS),
            max_message_size=settings.MAILRELAY_MAX_MESSAGE_SIZE,
            max_recipients=settings.MAILRELAY_MAX_RECIPIENTS,
            timeout=settings.MAILRELAY_SMTP_SERVER_TIMEOUT.total_seconds(),
            tls=tls_certificate(settings.MAILRELAY_TLS_CERT_FILE, settings.MAILRELAY_TLS_KEY_FILE),
            max_connections=settings.MAILRELAY_SMTP_MAX_CONNECTIONS,
            max_connections_per_client=settings.MAILRELAY_SMTP_MAX_CONNECTIONS_PER_CLIENT,
            max_session_time=settings.MAILRELAY_SMTP_MAX_SESSION_TIME.total_seconds(),
            junk_command_limit=settings.MAILRELAY_SMTP_JUNK_COMMAND_LIMIT,
            min_data_rate=settings.MAILRELAY_SMTP_MIN_DATA_RATE,
            max_auth_failures=settings.MAILRELAY_AUTH_MAX_FAILURES,
            max_auth_failures_per_user=settings.MAILRELAY_AUTH_MAX_FAILURES_PER_USER,
            max_header_fields=settings.MAILRELAY_SMTP_MAX_HEADER_FIELDS,
            max_header_size=settings.MAILRELAY_SMTP_MAX_HEADER_SIZE,
        )


def tls_context(cert_file: str, key_file: str) -> ssl.SSLContext | None:
    """A server context for these files, or None when no certificate is configured."""
    if not cert_file and not key_file:
        return None
    if not (cert_file and key_file):
        raise ImproperlyConfigured(
            "MAILRELAY_TLS_CERT_FILE and MAILRELAY_TLS_KEY_FILE must be set together"
        )
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.load_cert_chain(cert_file, key_file)
    return context


def tls_certificate(cert_file: str, key_file: str) -> TlsCertificate | None:
    """The server's certificate, or None when none is configured (no STARTTLS, no AUTH)."""
    if not cert_file and not key_file:
        return None
    return TlsCertificate(cert_file, key_file)


class TlsCertificate:
    """The certificate and key files, re-read when they change (renewals need no restart).

    ``current()`` runs once per new connection: two ``stat`` calls, and a new
    SSLContext only when a file's mtime, size or inode changed. A renewal
    caught half-written (the key not matching the certificate yet) keeps the
    previous context until the files load together.
    """

    def __init__(self, cert_file: str, key_file: str) -> None:
        self.cert_file = cert_file
        self.key_file = key_file
        self.loads = 0  # contexts built: 1 at start, +1 per renewal picked up
        self._stamp: tuple[tuple[int, int, int], ...] | None = None
        self._failed_stamp: tuple[tuple[int, int, int], ...] | None = None
        context = tls_context(cert_file, key_file)  # fails at start on bad files
        assert context is not None
        self._context = context
        self._stamp = self._stat()
        self.loads = 1

    def _stat(self) -> tuple[tuple[int, int, int], ...]:
        stats = (os.stat(self.cert_file), os.stat(self.key_file))
        return tuple((st.st_mtime_ns, st.st_size, st.st_ino) for st in stats)

    def current(self) -> ssl.SSLContext:
        """The context for a new connection, rebuilt if the files changed since."""
        try:
            stamp = self._stat()
        except OSError as exc:
            log.warning("TLS certificate files: %s; keeping the loaded certificate", exc)
            return self._context
        if stamp == self._stamp or stamp == self._failed_stamp:
            return self._context
        try:
            context = tls_context(self.cert_file, self.key_file)
        except (OSError, ssl.SSLError, ValueError) as exc:
            self._failed_stamp = stamp  # not retried until the files change again
            log.warning("TLS certificate files changed but do not load (%s); keeping the old", exc)
            return self._context
        assert context is not None
        self._context, self._stamp, self.loads = context, stamp, self.loads + 1
        log.info("TLS certificate re-read from %s", self.cert_file)
        return context

    def listener_context(self) -> ssl.SSLContext:
        """The context of an implicit-TLS listener (asyncio fixes it at listen time).

        Its SNI callback, which OpenSSL calls on every ClientHello (with None
        when the client sends no name), switches the connection to
        ``current()``: so a renewal is picked up by the next handshake.
        """
        context = tls_context(self.cert_file, self.key_file)
        assert context is not None

        def switch(ssl_object: ssl.SSLObject, _name: str | None, _ctx: ssl.SSLContext) -> None:
            ssl_object.context = self.current()

        context.sni_callback = switch  # type: ignore[assignment]
        return context
