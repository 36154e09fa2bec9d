"""``DATABASE_URL`` → Django's ``DATABASES["default"]``, including libpq's multi-host forms.

A high-availability PostgreSQL is reached through every host that may be
the primary, and libpq picks the one that takes writes now:

    postgres://user:pw@h1:5432,h2:5432/db?target_session_attrs=read-write
    host=h1,h2 port=5432,5432 dbname=db user=user target_session_attrs=read-write

``dj_database_url`` refuses both, so these forms are parsed by libpq itself
(``psycopg.conninfo``): the host and port lists go to ``HOST``/``PORT`` as
comma lists (Django's backend hands them to ``psycopg.connect``, which tries
each host in turn), every other keyword to ``OPTIONS``. With several hosts
the relay only ever wants the primary, so ``target_session_attrs`` defaults
to ``read-write``, and ``connect_timeout`` (per host) to
``MULTI_HOST_CONNECT_TIMEOUT`` seconds so a host that is down but does not
refuse (a dead machine) costs seconds, not the kernel's TCP timeout.
A single-host URL is parsed as before (``dj_database_url``).
"""

from __future__ import annotations

from typing import Any

import dj_database_url
from django.core.exceptions import ImproperlyConfigured

MULTI_HOST_CONNECT_TIMEOUT = "5"
_MAPPED = {"dbname": "NAME", "user": "USER", "password": "PASSWORD", "host": "HOST", "port": "PORT"}


def _libpq_form(url: str) -> bool:
    """The key/value form, or a URL that names several hosts."""
    if "://" not in url:
        return "=" in url
    scheme, rest = url.split("://", 1)
    if scheme not in ("postgres", "postgresql"):
        return False
    authority = rest.split("/", 1)[0].split("?", 1)[0]
    return "," in authority.rpartition("@")[2]


def parse_database_url(url: str) -> dict[str, Any]:
    """The ``default`` database for ``url``: persistent connections checked before reuse."""
    if not _libpq_form(url):
        return dj_database_url.parse(url, conn_max_age=None, conn_health_checks=True)
    from psycopg.conninfo import conninfo_to_dict

    try:
        params = conninfo_to_dict(url)
    except Exception as exc:  # psycopg.ProgrammingError: libpq's own message
        raise ImproperlyConfigured(f"DATABASE_URL: {exc}") from None
    config: dict[str, Any] = {
        "ENGINE": "django.db.backends.postgresql",
        "NAME": "",
        "USER": "",
        "PASSWORD": "",
        "HOST": "",
        "PORT": "",
        "CONN_MAX_AGE": None,
        "CONN_HEALTH_CHECKS": True,
    }
    options: dict[str, Any] = {}
    for key, value in params.items():
        if key in _MAPPED:
            config[_MAPPED[key]] = str(value)
        else:
            options[key] = value
    if not config["NAME"]:
        raise ImproperlyConfigured("DATABASE_URL names no database (dbname)")
    if "," in config["HOST"]:
        options.setdefault("target_session_attrs", "read-write")
        options.setdefault("connect_timeout", MULTI_HOST_CONNECT_TIMEOUT)
    config["OPTIONS"] = options
    return config
