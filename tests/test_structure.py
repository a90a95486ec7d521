"""The package's structure: no import cycles between its modules (any import, also one
made inside a function; only those under TYPE_CHECKING, for annotations, do not count), so
that each can be read, tested and changed from the bottom up; and its groups in layers —
protocol (talking to Redis) at the bottom, then the client side, the worker side, and
operations — so that a group never reaches up into one above it."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "taskrunner"
# Each group may import the groups before it (and the package's top-level basics: errors,
# config), never one after it. cli, demo and __init__ sit on top of everything.
LAYERS = ["protocol", "client", "worker", "ops"]
# The two imports that reach up, each for a reason.
UPWARD = {
    # Eager mode runs a task with the child's own code, so that its results and errors are
    # those of a real run.
    ("taskrunner.client.eager", "taskrunner.worker.child"),
    ("taskrunner.client.eager", "taskrunner.worker.context"),
    # The app registers the product's own pipeline as a periodic task when
    # TASKRUNNER_ANALYZE_CRON is set (imported only then).
    ("taskrunner.client.app", "taskrunner.ops.analyze"),
}


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
# Parsed once, at collection, before any test runs: on 3.11 ast.parse is not reentrant, and
# a finalizer that the garbage collector runs inside it (an object a test left behind) and
# that prints a traceback (which calls ast.parse) failed one parse with "AST constructor
# recursion depth mismatch".
TREES = {name: ast.parse(path.read_text()) for name, path in MODULES.items()}


def _edges(name: str) -> set[str]:
    """The package modules a module imports, anywhere but under `if TYPE_CHECKING:`."""
    tree = TREES[name]
    typing_only = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If)
                   and getattr(node.test, "id", None) == "TYPE_CHECKING" for n in ast.walk(node)}
    out = set()
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.ImportFrom) and node.module and not node.level:
            # `from taskrunner.protocol import codec` names a module; `from taskrunner.x import y`
            # names y in module x.
            for alias in node.names:
                full = f"{node.module}.{alias.name}"
                out.add(full if full in MODULES else node.module)
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
    return {m for m in out if m in MODULES and m != name}


GRAPH = {name: _edges(name) for name, path in MODULES.items() if path.name != "__init__.py"}


def test_imports_are_absolute():
    """Modules name each other by their full path, so a module's imports say which group
    each comes from (the layering below reads them)."""
    relative = [f"{name}:{node.lineno}" for name, tree in TREES.items()
                for node in ast.walk(tree)
                if isinstance(node, ast.ImportFrom) and node.level]
    assert not relative


def test_no_import_cycles():
    cycles = []

    def visit(module: str, path: list[str]) -> None:
        for dep in sorted(GRAPH.get(module, ())):
            if dep in path:
                cycles.append(" -> ".join([*path[path.index(dep):], dep]))
            elif dep not in done:
                visit(dep, [*path, dep])
        done.add(module)

    done: set[str] = set()
    for m in sorted(GRAPH):
        if m not in done:
            visit(m, [m])
    assert not cycles, cycles


def _layer(module: str) -> int | None:
    parts = module.split(".")
    return LAYERS.index(parts[1]) if len(parts) > 2 and parts[1] in LAYERS else None


def test_groups_import_only_the_layers_below():
    upward = [f"{m} -> {dep}" for m, deps in GRAPH.items() for dep in deps
              if _layer(m) is not None and _layer(dep) is not None and _layer(dep) > _layer(m)
              and (m, dep) not in UPWARD]
    assert not upward, upward
    assert UPWARD <= {(m, dep) for m, deps in GRAPH.items() for dep in deps}, "an exception no longer needed"


def test_every_module_is_in_the_graph():
    """The test reads every module (a file the glob missed would make it pass vacuously)."""
    assert {"taskrunner.protocol.claims", "taskrunner.worker.main", "taskrunner.ops.dispatcher",
            "taskrunner.client.app"} <= set(GRAPH)
    assert "taskrunner.protocol.codec" in GRAPH["taskrunner.protocol.claims"]


def test_apps_without_schedules_do_not_load_croniter():
    """croniter (and what it pulls in) costs each worker, child and producer ~1 MB and 0.1 s
    of its start: only apps that declare schedules, and the dispatcher, load it."""
    import subprocess
    import sys

    code = ("import sys, taskrunner.worker.main, taskrunner.worker.loop_child\n"
            "from taskrunner import TaskRunner\n"
            "app = TaskRunner('x')\n"
            "@app.task(name='f')\n"
            "def f(): pass\n"
            "assert 'croniter' not in sys.modules, 'croniter loaded'\n"
            "app.periodic('*/5 * * * *')(f)\n"
            "assert 'croniter' in sys.modules\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
