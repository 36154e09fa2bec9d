"""The store owns every state word: outside ``queues/transitions/`` no code
writes the state of a Message, Recipient, Link or Queue (DESIGN.md principle 9).

The scan reads the source (``ast``) of every module of the project outside
migrations and tests, and fails on any write of a state word, naming
file:line:

- ``.update(<word>=…)`` (and ``.update(**{"<word>": …})``);
- an assignment ``x.<word> = …`` (then saved, bulk-updated or handed to a
  writer: the engine returns outcomes instead, the store sets the fields);
- ``setattr(x, "<word>", …)``;
- ``.save(update_fields=[…<word>…])``, ``bulk_update(rows, […<word>…])``
  and ``bulk_update_rows(rows, […])``, the field list literal or a module-level
  name;
- raw SQL ``UPDATE queues_<model> … SET … <word> =``.

The state words are the fields that say where a row is in its life and who
holds it: a Message's ``state``, ``suspended`` (+ ``_until``, ``_by``),
``problem`` and ``per_message_failures`` (the problem rule's counter),
``crash_count`` and ``isolate`` (the poison rule's), ``lease_owner`` and
``lease_until``; a Recipient's ``state`` and lease; a Link's ``state`` and
lease; a Queue's suspension and re-route (``reroute_to``/``_until``/``_by``/
``_from``). Creating a row in its first state (accept, a special queue) is
not a transition and is not scanned.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("queues", "delivery", "tracking", "insight", "mailrelay")
OWNER = Path("queues/transitions")  # the package: flow.py, operator.py

STATE_WORDS = frozenset(
    {
        "state",
        "suspended",
        "suspended_until",
        "suspended_by",
        "problem",
        "per_message_failures",
        "crash_count",
        "isolate",
        "lease_owner",
        "lease_until",
        "reroute_to",
        "reroute_until",
        "reroute_by",
        "reroute_from",
        "reroute_from_id",
    }
)
STORE_MODELS = {"Message", "Recipient", "Link", "Queue"}
# Objects of other kinds that have a field of the same name (not the store's rows).
NOT_STORE_ROWS = {
    # the back-pressure monitor's own in-memory state
    ("delivery/backpressure/monitor.py", "self.state"),
}
_WORDS = "|".join(sorted(STATE_WORDS, key=len, reverse=True))
_RAW_UPDATE = re.compile(
    rf"UPDATE\s+queues_(message|recipient|link|queue)\b.*?\bSET\b.*?\b({_WORDS})\s*=",
    re.IGNORECASE | re.DOTALL,
)


def _modules() -> list[Path]:
    paths = []
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            rel = path.relative_to(ROOT)
            if "migrations" in rel.parts or OWNER in rel.parents:
                continue
            paths.append(path)
    return paths


def _literal_fields(node: ast.AST | None, names: dict[str, ast.AST]) -> set[str]:
    if isinstance(node, ast.Name) and node.id in names:
        node = names[node.id]
    if isinstance(node, ast.List | ast.Tuple | ast.Set):
        return {e.value for e in node.elts if isinstance(e, ast.Constant)} & STATE_WORDS
    return set()


def _module_names(tree: ast.Module) -> dict[str, ast.AST]:
    names: dict[str, ast.AST] = {}
    for node in tree.body:
        if isinstance(node, ast.Assign):
            for target in node.targets:
                if isinstance(target, ast.Name):
                    names[target.id] = node.value
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names[node.target.id] = node.value  # type: ignore[assignment]
    return names


def _uses_store_rows(tree: ast.Module) -> bool:
    """Whether a module handles the store's rows at all: it imports one of the
    four models from ``queues.models`` (or the module), or looks one up by name.
    Modules that do not (tracking's webhook outbox, the back-pressure store)
    have rows of their own with a ``state``; only their raw SQL is scanned."""
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom | ast.Import):
            names = {a.name for a in node.names}
            module = getattr(node, "module", None)
            if (
                (module == "queues.models" and names & STORE_MODELS)
                or (module == "queues" and "models" in names)
                or (module is None and "queues.models" in names)
            ):
                return True
        elif isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "get_model":
            return True
    return False


def _writes(path: Path) -> list[str]:
    rel = path.relative_to(ROOT).as_posix()
    source = path.read_text()
    tree = ast.parse(source)
    names = _module_names(tree)
    rows = _uses_store_rows(tree)
    found: list[tuple[int, str]] = []

    def hit(node: ast.AST, what: str) -> None:
        found.append((node.lineno, f"{rel}:{node.lineno}: {what}"))

    for node in ast.walk(tree):
        if not rows and not isinstance(node, ast.Constant):
            continue
        if isinstance(node, ast.Assign | ast.AugAssign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            flat: list[ast.AST] = []
            for t in targets:
                flat.extend(t.elts if isinstance(t, ast.Tuple) else [t])
            for t in flat:
                if (
                    isinstance(t, ast.Attribute)
                    and t.attr in STATE_WORDS
                    and (rel, ast.unparse(t)) not in NOT_STORE_ROWS
                ):
                    hit(t, f"assigns {ast.unparse(t)}")
        elif isinstance(node, ast.Call):
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            if name == "update":
                words = {k.arg for k in node.keywords if k.arg} & STATE_WORDS
                for k in node.keywords:
                    if k.arg is None and isinstance(k.value, ast.Dict):
                        words |= {
                            key.value for key in k.value.keys if isinstance(key, ast.Constant)
                        } & STATE_WORDS
                if words:
                    hit(node, f".update({', '.join(sorted(words))}=…)")
            elif name == "setattr" and len(node.args) >= 2:
                key = node.args[1]
                if isinstance(key, ast.Constant) and key.value in STATE_WORDS:
                    hit(node, f'setattr(…, "{key.value}", …)')
            elif name == "save":
                for k in node.keywords:
                    words = _literal_fields(k.value, names) if k.arg == "update_fields" else set()
                    if words:
                        hit(node, f".save(update_fields=[{', '.join(sorted(words))}…])")
            elif name in ("bulk_update", "bulk_update_rows"):
                field_arg = node.args[1] if len(node.args) > 1 else None
                for k in node.keywords:
                    if k.arg == "fields":
                        field_arg = k.value
                words = _literal_fields(field_arg, names)
                if words:
                    hit(node, f"{name}(…, [{', '.join(sorted(words))}…])")
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            match = _RAW_UPDATE.search(node.value)
            if match:
                hit(node, f"raw SQL UPDATE queues_{match.group(1)} SET {match.group(2)}")
    return [what for _, what in sorted(found)]


def test_only_the_transitions_module_writes_a_state_word():
    found = [w for path in _modules() for w in _writes(path)]
    assert not found, "state written outside queues/transitions/:\n" + "\n".join(found)


def test_the_scan_sees_each_kind_of_write(tmp_path):
    """The scanner itself: each kind of write is caught, reads are not."""
    sample = tmp_path / "sample.py"
    sample.write_text(
        "from queues.models import Recipient\n"
        "def f(qs, row, link, cur):\n"
        "    qs.filter(state='queued').update(state='deferred')\n"
        "    qs.update(**{'suspended': True})\n"
        "    row.state = 'failed'\n"
        "    row.lease_owner, row.lease_until = '', None\n"
        "    setattr(link, 'state', 'retry')\n"
        "    link.save(update_fields=['state', 'last_error'])\n"
        "    qs.bulk_update([row], ['problem'])\n"
        "    cur.execute('UPDATE queues_link SET state = %s WHERE id = %s')\n"
        "    if row.state == 'queued' and qs.filter(suspended=False).exists():\n"
        "        cur.execute('SELECT 1 FROM queues_message WHERE state = %s')\n"
    )
    global ROOT
    saved, ROOT = ROOT, tmp_path
    try:
        found = _writes(sample)
    finally:
        ROOT = saved
    assert [line.split(":")[1] for line in found] == ["3", "4", "5", "6", "6", "7", "8", "9", "10"]
