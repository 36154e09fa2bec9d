"""The engine's settings checked at start-up (``delivery.apps``): a bad line
stops the relay, naming its setting.

Otherwise the first message to route or deliver would raise, and a bad
setting would send every message to the Poison queue instead of stopping
the relay. Workers run no system checks, so this runs in AppConfig.ready.
"""

from __future__ import annotations

from django.core.exceptions import ImproperlyConfigured

from delivery.route.routing import routing_setting_checks
from delivery.smtp.tls import validate_tls_settings


def validate_routing_settings() -> None:
    """Fail start-up on a bad routing, TLS policy or SMTP AUTH setting, naming it."""
    for name, check in routing_setting_checks() + validate_tls_settings():
        try:
            check()
        except ValueError as exc:
            raise ImproperlyConfigured(f"{name}: {exc}") from None
