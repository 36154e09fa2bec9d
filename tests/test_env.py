import ast
import importlib
from datetime import timedelta
from pathlib import Path

import pytest
from django.core.exceptions import ImproperlyConfigured

from mailrelay.env import env_duration, env_int, env_networks, env_size, parse_duration, parse_size


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("90s", timedelta(seconds=90)),
        ("15m", timedelta(minutes=15)),
        ("2h", timedelta(hours=2)),
        ("2d", timedelta(days=2)),
        ("1h30m", timedelta(hours=1, minutes=30)),
        ("1w", timedelta(days=7)),
        ("00:01:00", timedelta(minutes=1)),
        ("2.00:00:00", timedelta(days=2)),
        ("1.02:03:04", timedelta(days=1, hours=2, minutes=3, seconds=4)),
    ],
)
def test_it_parses_durations(text, expected):
    assert parse_duration(text) == expected


@pytest.mark.parametrize("text", ["", "2x", "h", "1h 30m", "1.25:61:00", "-5m", "5"])
def test_it_refuses_bad_durations(text):
    with pytest.raises(ValueError):
        parse_duration(text)


def test_it_names_the_setting_of_a_bad_value(monkeypatch):
    monkeypatch.setenv("MAILRELAY_X", "soon")
    with pytest.raises(ImproperlyConfigured, match="MAILRELAY_X"):
        env_duration("MAILRELAY_X", "1m")
    with pytest.raises(ImproperlyConfigured, match="MAILRELAY_X"):
        env_int("MAILRELAY_X", 1)
    with pytest.raises(ImproperlyConfigured, match="MAILRELAY_X"):
        env_size("MAILRELAY_X", "1M")
    with pytest.raises(ImproperlyConfigured, match="MAILRELAY_X"):
        env_networks("MAILRELAY_X", "")


def test_it_parses_sizes_in_binary_units():
    assert parse_size("35MB") == 35 * 1024 * 1024
    assert parse_size("512K") == 512 * 1024
    assert parse_size("1000") == 1000
    with pytest.raises(ValueError):
        parse_size("35 parsecs")


def test_it_reads_a_secret_from_a_file(monkeypatch, tmp_path):
    secret = tmp_path / "n"
    secret.write_text("42\n")
    monkeypatch.setenv("MAILRELAY_N_FILE", str(secret))
    assert env_int("MAILRELAY_N", 1) == 42


# ----------------------------------------------------------------- settings are read once
#
# mailrelay/settings.py is the only module that reads a MAILRELAY_* variable
# (through these helpers) and the only place that holds its default; every
# other module reads django.conf.settings. A static scan of the source tree
# keeps it so.

PROJECT = Path(__file__).resolve().parent.parent
SOURCE_DIRS = ("mailrelay", "delivery", "queues")
# The one reader of the environment, and its helpers.
ALLOWED = {Path("mailrelay/settings.py"), Path("mailrelay/env.py")}
ENV_READERS = frozenset(
    {"env_str", "env_int", "env_bool", "env_list", "env_size", "env_duration", "env_networks"}
)
ENVIRON_METHODS = frozenset({"get", "pop", "setdefault", "__getitem__"})
PREFIX = "MAILRELAY_"


def _source_files() -> list[Path]:
    files = [PROJECT / "manage.py"]
    for directory in SOURCE_DIRS:
        files += sorted((PROJECT / directory).rglob("*.py"))
    return [f for f in files if f.relative_to(PROJECT) not in ALLOWED]


def _is_environ(node: ast.expr) -> bool:
    """``os.environ`` or a bare ``environ``."""
    if isinstance(node, ast.Attribute):
        return node.attr == "environ"
    return isinstance(node, ast.Name) and node.id == "environ"


def _is_getenv(node: ast.expr) -> bool:
    if isinstance(node, ast.Attribute):
        return node.attr == "getenv"
    return isinstance(node, ast.Name) and node.id == "getenv"


def _names_a_setting(key: ast.expr | None) -> bool:
    """A key that is, or may be, a MAILRELAY_* name (a computed key may be one)."""
    if isinstance(key, ast.Constant):
        return isinstance(key.value, str) and key.value.startswith(PREFIX)
    if isinstance(key, ast.JoinedStr) and key.values:
        first = key.values[0]
        return not (isinstance(first, ast.Constant) and not str(first.value).startswith(PREFIX))
    return key is not None


def _setting_name(key: ast.expr) -> bool:
    """A literal MAILRELAY_* name (plain or an f-string that starts with it)."""
    if isinstance(key, ast.Constant):
        return isinstance(key.value, str) and key.value.startswith(PREFIX)
    if isinstance(key, ast.JoinedStr) and key.values:
        first = key.values[0]
        return isinstance(first, ast.Constant) and str(first.value).startswith(PREFIX)
    return False


def _function_name(func: ast.expr) -> str:
    if isinstance(func, ast.Name):
        return func.id
    if isinstance(func, ast.Attribute):
        return func.attr
    return ""


def settings_violations(source: str, filename: str = "<source>") -> list[str]:
    """Every place in ``source`` that reads a setting other than from django.conf.settings."""
    found: list[str] = []

    def flag(node: ast.AST, why: str) -> None:
        found.append(f"{filename}:{getattr(node, 'lineno', 0)}: {why}")

    for node in ast.walk(ast.parse(source, filename)):
        if isinstance(node, ast.ImportFrom) and (node.module or "").endswith("env"):
            for alias in node.names:
                if alias.name in ENV_READERS:
                    flag(node, f"imports the environment reader {alias.name}")
        elif isinstance(node, ast.Subscript) and _is_environ(node.value):
            if _names_a_setting(node.slice):
                flag(node, "reads os.environ[...] for a setting")
        elif isinstance(node, ast.Call):
            name = _function_name(node.func)
            key = node.args[0] if node.args else None
            if name in ENV_READERS:
                flag(node, f"reads the environment with {name}()")
            elif (
                isinstance(node.func, ast.Attribute)
                and _is_environ(node.func.value)
                and name in ENVIRON_METHODS
                and _names_a_setting(key)
            ):
                flag(node, f"reads os.environ.{name}() for a setting")
            elif _is_getenv(node.func) and _names_a_setting(key):
                flag(node, "reads os.getenv() for a setting")
            elif name == "getattr" and len(node.args) == 3 and _setting_name(node.args[1]):
                flag(node, "repeats a setting's default: getattr(settings, name, default)")
            elif name == "hasattr" and len(node.args) == 2 and _setting_name(node.args[1]):
                flag(node, "falls back when settings.py lacks a setting: hasattr(settings, ...)")
    return found


def test_no_module_but_settings_py_reads_a_mailrelay_variable_or_repeats_a_default():
    found = []
    for path in _source_files():
        found += settings_violations(path.read_text(), str(path.relative_to(PROJECT)))
    assert found == [], "read these from django.conf.settings:\n" + "\n".join(found)


@pytest.mark.parametrize(
    "source",
    [
        "import os\nos.environ.get('MAILRELAY_X', '1')",
        "import os\nos.environ['MAILRELAY_X']",
        "import os\nname = 'MAILRELAY_X'\nos.environ.get(name)",
        "import os\nos.getenv(f'MAILRELAY_{kind}_DIR')",
        "from os import getenv\ngetenv('MAILRELAY_X')",
        "from mailrelay.env import env_int\nenv_int('MAILRELAY_X', 3)",
        "from mailrelay import env\nenv.env_duration('MAILRELAY_X', '5s')",
        "getattr(settings, 'MAILRELAY_X', 5)",
        "getattr(settings, f'MAILRELAY_{kind}_DIR', '')",
        "hasattr(settings, 'MAILRELAY_X')",
    ],
)
def test_the_scan_finds_each_way_of_reading_a_setting_around_settings_py(source):
    assert settings_violations(source)


@pytest.mark.parametrize(
    "source",
    [
        "import os\nos.environ.get('PROMETHEUS_MULTIPROC_DIR')",
        "import os\nos.environ.setdefault('DJANGO_SETTINGS_MODULE', 'mailrelay.settings')",
        "import os\nenv = os.environ.copy()",
        "from mailrelay.env import parse_duration\nparse_duration('5m')",
        "settings.MAILRELAY_X",
        "getattr(settings, f'MAILRELAY_{kind}_DIR')",
        "getattr(settings, 'CELERY_TASK_DEFAULT_QUEUE', 'celery')",
    ],
)
def test_the_scan_leaves_reads_of_django_settings_and_other_variables_alone(source):
    assert settings_violations(source) == []


def test_every_mailrelay_setting_the_code_reads_is_defined_in_settings_py():
    settings_module = importlib.import_module("mailrelay.settings")
    missing = []
    for path in _source_files():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            name = None
            if isinstance(node, ast.Attribute) and node.attr.startswith(PREFIX):
                name = node.attr
            elif (
                isinstance(node, ast.Call)
                and _function_name(node.func) == "getattr"
                and len(node.args) >= 2
                and isinstance(node.args[1], ast.Constant)
                and str(node.args[1].value).startswith(PREFIX)
            ):
                name = str(node.args[1].value)
            if name and not hasattr(settings_module, name):
                missing.append(f"{path.relative_to(PROJECT)}:{node.lineno}: {name}")
    assert missing == [], "define these in mailrelay/settings.py:\n" + "\n".join(missing)
