"""The package's structure: no import cycles between its modules (any import, also one
made inside a function; only those under TYPE_CHECKING, for annotations, do not count), so
that each can be read, tested and changed from the bottom up."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "taskrunner"


def _edges(path: Path) -> set[str]:
    """The package modules a module imports, anywhere but under `if TYPE_CHECKING:`."""
    tree = ast.parse(path.read_text())
    typing_only = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If)
                   and getattr(node.test, "id", None) == "TYPE_CHECKING" for n in ast.walk(node)}
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level == 1 and id(node) not in typing_only:
            if node.module:
                out.add(node.module.split(".")[0])
            else:
                out.update(a.name for a in node.names)
    return {m for m in out if (PACKAGE / f"{m}.py").exists()}


def test_no_import_cycles():
    graph = {p.stem: _edges(p) for p in PACKAGE.glob("*.py") if p.stem != "__init__"}
    cycles = []

    def visit(module: str, path: list[str]) -> None:
        for dep in sorted(graph.get(module, ())):
            if dep in path:
                cycles.append(" -> ".join([*path[path.index(dep):], dep]))
            elif dep not in done:
                visit(dep, [*path, dep])
        done.add(module)

    done: set[str] = set()
    for m in sorted(graph):
        if m not in done:
            visit(m, [m])
    assert not cycles, cycles
