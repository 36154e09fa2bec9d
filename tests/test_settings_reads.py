"""Issue #21: "each subsystem reads its settings into a frozen config once per
process; the hot paths read no django.conf.settings".

Parsed with ``ast``: in the store, the engine and the tracking (every module
below the operator surface; ``tests/test_architecture.py`` names the layers), a
setting is read only where a part builds its frozen value: a function wrapped
in ``queues.config.once_per_process`` (``settings_reader`` wraps the one
generic reader, ``read_settings``, that fills a part's frozen dataclass), a
``from_settings`` constructor, or one of the few readers listed below with
the reason each is not on a message's way. ``tests/test_message_path.py``
checks the same at run time: one message goes from DATA to the next hop's
250 reading no setting at all.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
from django.test import override_settings

from queues.config import once_per_process, store_settings
from tests.test_architecture import ROOT, STORE, SURFACE, layer_of, project_modules

# (module, function): why it may read settings at call time.
OTHER_READERS = {
    ("queues.config", "read_settings"): "fills a part's settings class, for its settings_reader",
    ("delivery.checks", "*"): "the start-up checks (Django's check framework)",
    ("delivery.route.routing", "routing_setting_checks"): "the start-up check of the routes",
    ("delivery.smtp.retry", "exchange_rules_text"): "a part of rules(), read once per process",
    ("delivery.smtp.retry", "options"): "a part of rules(), read once per process",
    ("delivery.shaping.policy", "builtin_default"): "read when the policy file is loaded again",
    ("delivery.backpressure.samplers", "__init__"): "a sampler, made when the monitor starts",
    ("delivery.backpressure.config", "_int"): "a part of BackPressureConfig.from_settings",
    ("delivery.backpressure.config", "_seconds"): "a part of BackPressureConfig.from_settings",
}


def _is_settings(node: ast.AST, aliases: set[str]) -> bool:
    return isinstance(node, ast.Name) and node.id in aliases


def settings_reads(source: str) -> list[tuple[int, str, str]]:
    """(line, function, setting) of each ``settings.X`` or ``getattr(settings,
    "X")`` in ``source`` outside a reader; ``function``: the innermost
    function around it ("<module>" at module level)."""
    found: list[tuple[int, str, str]] = []

    def visit(node: ast.AST, function: str, reader: bool, aliases: set[str]) -> None:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            decorators = {ast.unparse(d).rpartition(".")[2] for d in node.decorator_list}
            function = node.name
            reader = reader or "once_per_process" in decorators or node.name == "from_settings"
            aliases = set(aliases)
        if isinstance(node, ast.Assign) and _is_settings(node.value, aliases):
            aliases |= {t.id for t in node.targets if isinstance(t, ast.Name)}  # s = settings
        name = None
        if isinstance(node, ast.Attribute) and _is_settings(node.value, aliases):
            name = node.attr
        elif (
            isinstance(node, ast.Call)
            and ast.unparse(node.func) == "getattr"
            and node.args
            and _is_settings(node.args[0], aliases)
        ):
            named = node.args[1] if len(node.args) > 1 else None
            literal = isinstance(named, ast.Constant) and isinstance(named.value, str)
            name = named.value if literal else "<a name known at run time>"  # type: ignore[union-attr]
        if name is not None and (name.isupper() or name.startswith("<")) and not reader:
            found.append((node.lineno, function, name))
        for child in ast.iter_child_nodes(node):
            visit(child, function, reader, aliases)

    visit(ast.parse(source), "<module>", False, {"settings"})
    return found


def test_the_scan_finds_a_read_outside_a_reader():
    source = (
        "from django.conf import settings\n"
        "from queues.config import once_per_process\n"
        "def hot():\n    return settings.MAILRELAY_HOSTNAME\n"
        "def aliased():\n    s = settings\n    return s.MAILRELAY_HOSTNAME\n"
        "def by_name():\n    return getattr(settings, 'MAILRELAY_X', 1)\n"
        "def dynamic(name):\n    return getattr(settings, name)\n"
        "@once_per_process\ndef read():\n    return settings.MAILRELAY_HOSTNAME\n"
        "class C:\n    @classmethod\n    def from_settings(cls):\n"
        "        return cls(settings.MAILRELAY_HOSTNAME)\n"
    )
    assert settings_reads(source) == [
        (4, "hot", "MAILRELAY_HOSTNAME"),
        (7, "aliased", "MAILRELAY_HOSTNAME"),
        (9, "by_name", "MAILRELAY_X"),
        (11, "dynamic", "<a name known at run time>"),
    ]


def test_below_the_operator_surface_settings_are_read_only_by_the_parts_readers():
    outside = []
    for module, path in sorted(project_modules().items()):
        if not STORE <= layer_of(module) < SURFACE:
            continue
        for line, function, name in settings_reads(path.read_text()):
            if (module, "*") in OTHER_READERS or (module, function) in OTHER_READERS:
                continue
            outside.append(f"{path.relative_to(ROOT)}:{line} {function} reads {name}")
    assert outside == [], "\n".join(outside)


def test_a_part_reads_its_settings_once_and_again_after_a_change():
    first = store_settings()
    assert store_settings() is first  # the value kept, not read again
    with override_settings(MAILRELAY_HOSTNAME="changed.example"):
        assert store_settings().hostname == "changed.example"
    assert store_settings().hostname == first.hostname


def test_a_reader_that_raises_keeps_nothing():
    calls = []

    @once_per_process
    def flaky() -> int:
        calls.append(1)
        if len(calls) == 1:
            raise ValueError("not yet")
        return len(calls)

    with pytest.raises(ValueError):
        flaky()
    assert flaky() == 2
    assert flaky() == 2 and len(calls) == 2


def test_the_readers_listed_exist():
    modules = project_modules()
    for module, function in OTHER_READERS:
        source = Path(modules[module]).read_text()
        assert function == "*" or f"def {function}(" in source, (module, function)
