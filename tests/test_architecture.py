"""The import graph of the project: no cycles, and every arrow points down.

Every module of the five packages (not migrations, not tests) is parsed with
``ast``; every ``import`` counts, at module level and inside functions alike
(an import hidden in a function body is still a dependency). The layers,
from the bottom (README "Architecture"):

1. **store** — ``queues``: models, states, transitions, the batch writer,
   accept (cleanup), bounce, placement, signals, the operator services and
   their pure helpers. It knows no SMTP session, Celery or engine.
2. **engine** — ``delivery``: smtpd, qmgr, route, smtp, shaping,
   backpressure, pickup. It writes through the store and tells the read side
   what happened by the store's signals (``queues.signals``).
3. **read side** — ``tracking`` and ``insight``: fed by signals and by reading
   the store; they may read the engine's pure rules (retry rules, shaping
   policy) to explain them; nothing below imports them.
4. **operator surface** — the thin edges: UI, REST API, commands, the metrics
   and back-pressure endpoints, the web's auth helpers. They show the live
   state of every layer below (a queue's shaping limits, back pressure,
   insight's alerts), so they sit above all of them.
5. **project** — ``mailrelay``: settings, urls, the Celery app and the process
   supervisor (``runall``); nothing imports it.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("delivery", "queues", "tracking", "insight", "mailrelay")

STORE, ENGINE, READ, SURFACE, PROJECT = range(1, 6)
LAYER_NAMES = {
    STORE: "store",
    ENGINE: "engine",
    READ: "read side",
    SURFACE: "operator surface",
    PROJECT: "project",
}
# Module prefixes and their layer; the longest matching prefix wins.
LAYERS = {
    "queues": STORE,
    "delivery": ENGINE,
    "tracking": READ,
    "insight": READ,
    "mailrelay": PROJECT,
    # The operator surface.
    "queues.ui": SURFACE,
    "queues.api": SURFACE,
    "queues.management": SURFACE,
    "queues.admin": SURFACE,
    "queues.spec": SURFACE,  # the edges' one table of filters and actions
    "queues.login": SURFACE,
    "queues.permissions": SURFACE,
    "queues.access": SURFACE,
    "queues.throttle": SURFACE,
    "delivery.management": SURFACE,
    "delivery.backpressure.api": SURFACE,
    "delivery.metrics": SURFACE,
    "delivery.templatetags": SURFACE,
    "tracking.api": SURFACE,
    "tracking.api_urls": SURFACE,
    "tracking.ui": SURFACE,
    "tracking.ui_urls": SURFACE,
    "tracking.management": SURFACE,
    "insight.views": SURFACE,
    "insight.api": SURFACE,
    "insight.urls": SURFACE,
    "insight.cli": SURFACE,
    "insight.templatetags": SURFACE,
}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def project_modules() -> dict[str, Path]:
    modules = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            if {"migrations", "tests"} & set(path.relative_to(ROOT).parts):
                continue
            modules[_module_name(path)] = path
    return modules


def _resolve(name: str, modules: dict[str, Path]) -> str | None:
    """The project module ``name`` is or lives in (``queues.models.Message`` →
    ``queues.models``); None outside the project."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def imports_of(
    module: str, source: str, modules: dict[str, Path], *, package: bool = False
) -> dict[str, int]:
    """The project modules ``module`` (whose text is ``source``; ``package``: an
    ``__init__.py``) imports, anywhere in it, with the line of the first
    import of each."""
    found: dict[str, int] = {}

    def add(target: str | None, line: int) -> None:
        if target and target != module:
            found.setdefault(target, line)

    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            for alias in node.names:
                add(_resolve(alias.name, modules), node.lineno)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = module.split(".") if package else module.split(".")[:-1]
                parts = parts[: len(parts) - (node.level - 1)]
                base = ".".join(parts + ([base] if base else []))
            for alias in node.names:
                # ``from delivery.qmgr import tasks`` imports the module tasks.
                target = _resolve(f"{base}.{alias.name}", modules)
                if target is None or target == module:
                    target = _resolve(base, modules)
                add(target, node.lineno)
    return found


def import_graph() -> dict[str, dict[str, int]]:
    modules = project_modules()
    return {
        m: imports_of(m, p.read_text(), modules, package=p.name == "__init__.py")
        for m, p in modules.items()
    }


def layer_of(module: str) -> int:
    parts = module.split(".")
    for end in range(len(parts), 0, -1):
        layer = LAYERS.get(".".join(parts[:end]))
        if layer is not None:
            return layer
    raise AssertionError(f"{module} is in no layer: add it to LAYERS")


def cycles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's
    algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = 0
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_every_module_has_a_layer():
    for module in project_modules():
        layer_of(module)


def test_the_imports_have_no_cycle():
    graph = import_graph()
    found = cycles(graph)
    described = []
    for component in found:
        members = set(component)
        arrows = [
            f"    {src} -> {dst} (line {line})"
            for src in component
            for dst, line in sorted(graph[src].items())
            if dst in members
        ]
        described.append(" <-> ".join(component) + "\n" + "\n".join(arrows))
    assert not found, f"{len(found)} import cycles:\n" + "\n".join(described)


def test_every_import_points_down_the_layers():
    graph = import_graph()
    modules = project_modules()
    upward = [
        f"{modules[src].relative_to(ROOT)}:{line}: {src} ({LAYER_NAMES[layer_of(src)]}) "
        f"imports {dst} ({LAYER_NAMES[layer_of(dst)]})"
        for src, targets in sorted(graph.items())
        for dst, line in sorted(targets.items())
        if layer_of(dst) > layer_of(src)
    ]
    assert not upward, f"{len(upward)} imports run back up:\n" + "\n".join(upward)


def test_it_sees_imports_in_functions_and_relative_ones():
    modules = {name: ROOT for name in ("a", "a.b", "a.c", "a.d", "e")}
    source = "import e\ndef f():\n    from . import c\n    from .d import thing\n"
    assert imports_of("a.b", source, modules) == {"e": 1, "a.c": 3, "a.d": 4}


def test_it_finds_a_cycle_and_only_cycles():
    assert cycles({"a": {"b": 1}, "b": {"c": 1}, "c": {"a": 1}, "d": {"a": 1}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b": 1}, "b": {}}) == []
