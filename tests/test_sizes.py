"""No function over 80 lines, no module over 800, outside tests and migrations (issue #21).

Measured with ``ast``: a function's span is ``end_lineno - lineno + 1`` of its
``def`` (methods and nested functions count on their own), a module's size is
its line count.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("delivery", "queues", "tracking", "insight", "mailrelay")
MAX_FUNCTION_LINES = 80
MAX_MODULE_LINES = 800
# Files not held to the limits (paths from the repository root). Keep it empty.
EXCLUDED: frozenset[str] = frozenset()


def sources() -> list[tuple[str, str]]:
    found = []
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
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
