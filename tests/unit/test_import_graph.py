"""The shape of the source tree: no import circles, the gateway's rooms import downward only,
and no module reaches into another package's private modules.

The graph is read with ``ast`` (nothing is imported): every ``import`` and ``from ... import``
counts, also those inside functions and under ``if TYPE_CHECKING:``, since a circle held by
type-only imports still ties its modules together. docs/architecture.md draws the same map.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[2] / "src"

GATEWAY = "tokenpace.gateway"
GATEWAY_LAYERS: tuple[tuple[str, ...], ...] = (
    ("metrics", "wire", "state"),
    ("ledger",),
    ("config",),
    ("tenants", "engines", "registry"),
    ("fleet",),
    ("dispatch",),
    ("exchange",),
    ("admission", "relay", "batch", "reconcile"),
    ("server",),
)
"""The gateway's rooms from the bottom up: a room imports rooms of lower rows only (and,
for ``server``, the rows below it). Rooms in one row do not import each other."""


def modules(src: Path) -> dict[str, Path]:
    """Dotted module name -> file, for every ``.py`` under ``src``."""
    found = {}
    for path in src.rglob("*.py"):
        parts = path.relative_to(src).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join(parts)] = path
    return found


def imported(name: str, path: Path, known: dict[str, Path]) -> Iterator[str]:
    """The known modules ``name`` imports (the longest known prefix of each target)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                parts = parts[: len(parts) - node.level + 1]
                base = ".".join(parts + ([base] if base else []))
            targets = [base] + [f"{base}.{alias.name}" for alias in node.names]
        else:
            continue
        for target in targets:
            while target and target not in known:
                target = target.rpartition(".")[0]
            if target and target != name:
                yield target


def graph(src: Path = SRC) -> dict[str, set[str]]:
    """Module -> the modules it imports. An import of one's own ancestor package (the
    ``from .. import x`` of a child module) is left out: it is how a child reaches a
    sibling, not a dependency on the package's ``__init__``."""
    known = modules(src)
    return {name: {t for t in imported(name, path, known) if not name.startswith(t + ".")}
            for name, path in known.items()}


def circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected groups of two or more modules (Tarjan, iteratively)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in edges:
        if root in index:
            continue
        work = [(root, iter(sorted(edges[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            for child in children:
                if child not in edges:
                    continue
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(edges[child]))))
                    break
                if child in on_stack:
                    low[node] = min(low[node], index[child])
            else:
                work.pop()
                if work:
                    parent = work[-1][0]
                    low[parent] = min(low[parent], low[node])
                if low[node] == index[node]:
                    group = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        group.append(member)
                        if member == node:
                            break
                    if len(group) > 1:
                        found.append(sorted(group))
    return found


def room(module: str) -> str | None:
    """The gateway room a module belongs to (``tokenpace.gateway.dispatch._shared`` ->
    ``dispatch``), None outside the gateway or for its ``__init__``."""
    if not module.startswith(GATEWAY + "."):
        return None
    return module[len(GATEWAY) + 1:].split(".")[0]


def test_no_import_circle_in_src() -> None:
    assert circles(graph()) == []


def test_gateway_rooms_import_only_the_rows_below() -> None:
    row = {name: i for i, names in enumerate(GATEWAY_LAYERS) for name in names}
    on_disk = {p.stem if p.is_file() else p.name for p in (SRC / "tokenpace" / "gateway").iterdir()
               if not p.name.startswith(("_", ".")) and (p.is_dir() or p.suffix == ".py")}
    assert on_disk == set(row), "every gateway room has its row in GATEWAY_LAYERS"
    upward = sorted(
        f"{source} -> {target}"
        for source, targets in graph().items() for target in targets
        if (a := room(source)) is not None and (b := room(target)) is not None
        and a != b and row[b] >= row[a])
    assert upward == []


def test_no_module_imports_another_packages_private_module() -> None:
    """``pkg._mod`` is imported only by ``pkg`` itself and the modules inside it: other
    packages use its public ``__init__``."""
    reaching = sorted(
        f"{source} -> {target}"
        for source, targets in graph().items() for target in targets
        if target.rpartition(".")[2].startswith("_")
        and source != (owner := target.rpartition(".")[0])
        and not source.startswith(owner + "."))
    assert reaching == []


@pytest.mark.parametrize("edges, expected", [
    ({"a": {"b"}, "b": {"c"}, "c": set()}, []),
    ({"a": {"b"}, "b": {"a"}, "c": {"a"}}, [["a", "b"]]),
    ({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"d"}}, [["a", "b", "c"]]),
])
def test_circles_finds_exactly_the_circles(edges: dict[str, set[str]],
                                           expected: list[list[str]]) -> None:
    assert circles(edges) == expected


def test_type_only_and_function_level_imports_count(tmp_path: Path) -> None:
    """A circle closed only under ``TYPE_CHECKING`` or inside a function is still one."""
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "_a.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from ._b import B\n")
    (package / "_b.py").write_text("def f():\n    from . import _a\n")
    assert circles(graph(tmp_path)) == [["pkg._a", "pkg._b"]]
