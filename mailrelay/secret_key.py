"""Which ``SECRET_KEY`` the web app signs sessions and CSRF tokens with.

The rule (README "Production"):

- ``DJANGO_SECRET_KEY`` set: it is used, unless it is a key published in
  this repository (the old built-in default, ``.env.example``'s placeholder)
  or too weak for Django's own check, and ``DJANGO_DEBUG`` is off: then
  start-up stops with a message naming the setting.
- unset, ``DJANGO_DEBUG`` on: the development key.
- unset, the embedded default (no ``DATABASE_URL``: one machine, its
  database and broker in the data folder): the key in
  ``<MAILRELAY_DATA_DIR>/secret-key.txt``, created at the first start (random,
  mode 0600). It sits beside the database it protects, so it is as safe as
  that data; ``make run`` needs no configuration.
- unset, anything else (PostgreSQL: usually several machines, which must
  share one key): the key file when one exists there (an operator put it),
  else the web app does not start (``RequireSecretKey``, the first
  middleware, stops gunicorn's workers and ``runserver`` with a message
  naming ``DJANGO_SECRET_KEY``). A key made up per machine would silently log
  users out between web nodes. The SMTP ingress, the workers and beat sign
  nothing, so they start without one (SECRET_KEY is then empty, and Django
  itself refuses any use of it).
- under pytest (``PYTEST_VERSION``, set by pytest 8.2+): a random key for the
  session, exported so the processes a test starts share it.
"""

from __future__ import annotations

import os
import secrets
from pathlib import Path

from django.conf import settings
from django.core.exceptions import ImproperlyConfigured

DEVELOPMENT_KEY = "insecure-development-key-change-me"
# Keys anyone can read in this repository: never good enough for production.
PUBLISHED_KEYS = frozenset({DEVELOPMENT_KEY, "change-me-to-a-long-random-string"})
KEY_FILE = "secret-key.txt"
_MIN_LENGTH = 50  # Django's security.W009 threshold
_MIN_UNIQUE = 5


def _weakness(key: str) -> str:
    if key in PUBLISHED_KEYS:
        return "is a published example key"
    if key.startswith("django-insecure-"):
        return "is marked insecure (django-insecure-)"
    if len(key) < _MIN_LENGTH or len(set(key)) < _MIN_UNIQUE:
        return f"is too short (at least {_MIN_LENGTH} random characters)"
    return ""


def _read_or_create(path: Path, create: bool) -> str | None:
    """The key stored at ``path``; with ``create``, a new one if there is none.

    Created with O_EXCL, so processes starting together agree: the loser
    of the race reads the winner's file.
    """
    if create and not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError:
            pass
        else:
            with os.fdopen(fd, "w") as fh:
                fh.write(secrets.token_urlsafe(48) + "\n")
    try:
        key = path.read_text().strip()
    except FileNotFoundError:
        return None
    return key or None


def secret_key(configured: str, *, debug: bool, data_dir: Path, embedded: bool) -> str:
    """The SECRET_KEY to use, or ImproperlyConfigured naming DJANGO_SECRET_KEY."""
    if configured:
        problem = _weakness(configured)
        if problem and not debug:
            raise ImproperlyConfigured(
                f"DJANGO_SECRET_KEY {problem}; set it to a long random string, e.g. "
                "python -c 'import secrets; print(secrets.token_urlsafe(48))'"
            )
        return configured
    if debug:
        return DEVELOPMENT_KEY
    if os.environ.get("PYTEST_VERSION"):
        key = secrets.token_urlsafe(48)
        os.environ["DJANGO_SECRET_KEY"] = key  # the relay processes a test starts
        return key
    key = _read_or_create(Path(data_dir) / KEY_FILE, create=embedded)
    if key is None:
        return ""  # the web app refuses to start (RequireSecretKey); nothing else signs
    problem = _weakness(key)
    if problem:
        raise ImproperlyConfigured(f"DJANGO_SECRET_KEY from {Path(data_dir) / KEY_FILE} {problem}")
    return key


def missing_key_message(data_dir: Path) -> str:
    return (
        "DJANGO_SECRET_KEY is not set: with DJANGO_DEBUG off the web app needs it "
        f"(or a key in {Path(data_dir) / KEY_FILE}); every web node needs the same key"
    )


class RequireSecretKey:
    """The first middleware: the web app does not start without a secret key.

    Middleware is built when the WSGI handler is (a gunicorn worker's boot,
    ``runserver``), never by the SMTP ingress or the workers.
    """

    def __init__(self, get_response) -> None:
        if settings.MAILRELAY_SECRET_KEY_MISSING:  # settings.SECRET_KEY itself would raise
            raise ImproperlyConfigured(missing_key_message(settings.DATA_DIR))
        self.get_response = get_response

    def __call__(self, request):
        return self.get_response(request)


def ensure_key_file(data_dir: Path) -> tuple[Path, bool]:
    """``make run``'s local key: ``<data_dir>/secret-key.txt``, created if missing.

    Returns the path and whether it was created now. runall calls it before it
    starts its children when DJANGO_SECRET_KEY is unset, so that ``make run``
    on PostgreSQL (DATABASE_URL set) serves the web app with a stored key too.
    """
    path = Path(data_dir) / KEY_FILE
    existed = path.exists()
    _read_or_create(path, create=True)
    return path, not existed
