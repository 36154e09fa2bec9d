"""mailrelay/settings.py evaluated again under a given environment.

Settings are read from the environment in settings.py only; a test that
wants to show an environment variable reaching a subsystem evaluates a
fresh copy of settings.py under that environment and copies its
``MAILRELAY_*`` values onto pytest-django's ``settings`` fixture, then builds
the subsystem's config as it would at start-up.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Mapping
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

import mailrelay

SETTINGS_FILE = Path(mailrelay.__file__).with_name("settings.py")


def load_settings(monkeypatch: pytest.MonkeyPatch, environ: Mapping[str, str]) -> ModuleType:
    """A fresh module of settings.py run with no ``MAILRELAY_*`` variables but ``environ``."""
    for name in list(os.environ):
        if name.startswith("MAILRELAY_"):
            monkeypatch.delenv(name)
    for name, value in environ.items():
        monkeypatch.setenv(name, value)
    # A name inside the package, so that settings.py's relative imports resolve.
    spec = importlib.util.spec_from_file_location("mailrelay._settings_under_test", SETTINGS_FILE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def apply_settings(settings: Any, module: ModuleType) -> None:
    """Copy the module's ``MAILRELAY_*`` values onto the ``settings`` fixture."""
    for name in dir(module):
        if name.startswith("MAILRELAY_"):
            setattr(settings, name, getattr(module, name))


def settings_from_environment(
    settings: Any, monkeypatch: pytest.MonkeyPatch, **environ: str
) -> None:
    """The ``settings`` fixture as settings.py would make it under ``environ``."""
    apply_settings(settings, load_settings(monkeypatch, environ))
