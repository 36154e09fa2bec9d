"""No function over 80 lines, no module over 800, outside tests and migrations (issue #21):
the packages and the benchmarks (``bench/``: its modules and its Python scripts).

Measured with ``ast``: a function's span is ``end_lineno - lineno + 1`` of its
``def`` (methods and nested functions count on their own), a module's size is
its line count.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("delivery", "queues", "tracking", "insight", "mailrelay", "bench")
MAX_FUNCTION_LINES = 80
MAX_MODULE_LINES = 800
# Files not held to the limits (paths from the repository root). Keep it empty.
EXCLUDED: frozenset[str] = frozenset()


def _python_files(folder: Path) -> list[Path]:
    """Modules, and scripts without a suffix that start with a Python shebang."""
    return sorted(
        path
        for path in folder.rglob("*")
        if path.is_file()
        and (
            path.suffix == ".py"
            or (not path.suffix and path.read_bytes().startswith(b"#!/usr/bin/env python"))
        )
    )


def sources() -> list[tuple[str, str]]:
    found = []
    for package in PACKAGES:
        for path in _python_files(ROOT / package):
            rel = path.relative_to(ROOT).as_posix()
            if "migrations" in path.parts or rel in EXCLUDED:
                continue
            found.append((rel, path.read_text()))
    return found


def test_no_module_is_over_800_lines():
    long = [
        f"{rel}: {lines} lines"
        for rel, text in sources()
        if (lines := len(text.splitlines())) > MAX_MODULE_LINES
    ]
    assert not long, "modules over 800 lines:\n" + "\n".join(long)


def test_no_function_is_over_80_lines():
    long = []
    for rel, text in sources():
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                assert node.end_lineno is not None
                span = node.end_lineno - node.lineno + 1
                if span > MAX_FUNCTION_LINES:
                    long.append(f"{rel}:{node.lineno} {node.name}: {span} lines")
    assert not long, "functions over 80 lines:\n" + "\n".join(long)


def test_the_scripts_of_the_benchmarks_are_measured_too():
    names = {rel for rel, _ in sources()}
    assert {"bench/relay_throughput", "bench/overload", "bench/faults/multihost.py"} <= names
