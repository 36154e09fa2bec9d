"""The engine's settings checked at start-up (``delivery.apps``): a bad line
stops the relay, naming its setting.

Otherwise the first message to route or deliver would raise, and a bad
setting would send every message to the Poison queue instead of stopping
the relay. Workers run no system checks, so this runs in AppConfig.ready.
"""

from __future__ import annotations

from django.conf import settings
from django.core.exceptions import ImproperlyConfigured

from delivery.route.routing import routing_setting_checks
from delivery.smtp.client import load_auth, load_policy
from delivery.smtp.tls import LEVELS


def validate_routing_settings() -> None:
    """Fail start-up on a bad routing, TLS policy or SMTP AUTH setting, naming it."""
    for name, check in routing_setting_checks() + validate_tls_settings():
        try:
            check()
        except ValueError as exc:
            raise ImproperlyConfigured(f"{name}: {exc}") from None


def validate_tls_settings() -> list[tuple[str, object]]:
    """(setting, check) pairs of the outbound TLS policy and the next hops' AUTH
    (``delivery.smtp.tls``, read by ``delivery.smtp.client``): each check
    raises ValueError naming the bad line."""

    def policy() -> object:
        try:
            return load_policy()
        except OSError as exc:
            raise ValueError(f"cannot read {settings.MAILRELAY_TLS_POLICY!r}: {exc}") from None

    def default() -> object:
        if settings.MAILRELAY_TLS_DEFAULT_LEVEL not in LEVELS:
            raise ValueError(f"must be one of {', '.join(LEVELS)}")
        return None

    return [
        ("MAILRELAY_TLS_POLICY", policy),
        ("MAILRELAY_TLS_DEFAULT_LEVEL", default),
        ("MAILRELAY_SMTP_AUTH", load_auth),
    ]
