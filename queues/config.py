"""Each part's settings, read once per process into a frozen value.

A part (the store here; the queue manager, the round, the router, the
tracking and insight each in their own ``config`` module) names the settings
it reads in a frozen dataclass, one ``setting(...)`` field each, and gets
them through ``settings_reader``. Its code then asks
``store_settings().hostname``: after the first call, the answer is the cached
value, found by ``functools.cache``'s C wrapper, so a message's path runs no
settings lookup and no Python function to find its settings
(``tests/test_message_path.py`` checks both).

Settings change in a running process only in tests (``override_settings``, the
``settings`` fixture): Django sends ``setting_changed`` then, and every cached
value is forgotten, to be read again at its next use.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from datetime import timedelta
from typing import Any, TypeVar

from django.conf import settings
from django.core.signals import setting_changed

T = TypeVar("T")

_READERS: list[Any] = []


def once_per_process(read: Callable[[], T]) -> functools._lru_cache_wrapper[T]:
    """``read`` (a function of no arguments that reads settings into a frozen
    value) run at its first call, its value returned from then on; read again
    after a setting changes. A reader that raises (a setting it cannot parse)
    caches nothing: the next call raises again."""
    cached = functools.cache(read)
    _READERS.append(cached)
    return cached


def forget_all(**_kwargs: object) -> None:
    """Forget every value read (``setting_changed``'s receiver)."""
    for cached in _READERS:
        cached.cache_clear()


setting_changed.connect(forget_all, dispatch_uid="mailrelay-config-forget-all")


def setting(name: str, convert: Callable[[Any], Any] | None = None) -> Any:
    """A field of a part's settings: the setting ``name``, through ``convert``."""
    return field(metadata={"setting": name, "convert": convert})


def read_settings(cls: type[T]) -> T:
    """A part's settings class (its fields made with ``setting``) filled from
    ``django.conf.settings``: run only by the part's ``settings_reader``."""
    values = {}
    for each in fields(cls):  # type: ignore[arg-type]
        value = getattr(settings, each.metadata["setting"])
        convert = each.metadata["convert"]
        values[each.name] = value if convert is None else convert(value)
    return cls(**values)


def settings_reader(cls: type[T]) -> functools._lru_cache_wrapper[T]:
    """The function that gives a part its settings: read at its first call,
    then the same frozen value until a setting changes."""
    return once_per_process(functools.partial(read_settings, cls))


@dataclass(frozen=True, slots=True)
class StoreSettings:
    """What the store reads: the accept (cleanup, DKIM), the claims, the poison
    rule, the reports (DSN) and the counts the operator's views read."""

    # Received's "by", a missing Message-ID's domain, the reports' reporting MTA
    hostname: str = setting("MAILRELAY_HOSTNAME")
    message_expiration: timedelta = setting("MAILRELAY_MESSAGE_EXPIRATION_TIMEOUT")
    dkim_keys_dir: str = setting("MAILRELAY_DKIM_KEYS_DIR")
    dkim_key_refresh: float = setting("MAILRELAY_DKIM_KEY_REFRESH", timedelta.total_seconds)
    dkim_signing_domain: str = setting("MAILRELAY_DKIM_SIGNING_DOMAIN")  # "": no key
    dkim_headers: tuple[str, ...] = setting("MAILRELAY_DKIM_HEADERS", tuple)  # (): usual
    lease: timedelta = setting("MAILRELAY_DELIVERY_LEASE")  # every claim's lease
    lease_margin: timedelta = setting("MAILRELAY_DELIVERY_LEASE_MARGIN")
    poison_threshold: int = setting("MAILRELAY_POISON_THRESHOLD")
    failures_before_problem: int = setting("MAILRELAY_PER_MESSAGE_FAILURES_BEFORE_PROBLEM")
    db_prepare: bool = setting("MAILRELAY_DB_PREPARE")
    max_dsn_size: int = setting("MAILRELAY_MAX_DSN_SIZE")
    postmaster: str = setting("MAILRELAY_POSTMASTER")  # "": none named in reports
    live_counts_up_to: int = setting("MAILRELAY_LIVE_COUNTS_UP_TO")


store_settings = settings_reader(StoreSettings)
