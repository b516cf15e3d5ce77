"""The house's shape, read from the imports (docs/architecture.md, "Layout"): imports run only
inward, the leaf packages (configuration, messages, IPC, metrics) import only leaves, and no two
files import each other, directly or around a loop.

Inward: serve -> frontend -> tokenizer_proc -> engine_core -> executor -> gpu_worker -> kernels;
a folder may skip layers. bench/ drives the engine as a user does, from outside serve/; the
`engine` command (serve/cli.py) dispatches to it. metrics/ is a leaf service: the processes
import it, it imports only leaves. Imports under `if TYPE_CHECKING:` are read for the direction
(they are still a dependency a reader follows) but not for loops (they never run).
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# Outermost first.
LAYERS = (
    "bench",
    "serve",
    "frontend",
    "tokenizer_proc",
    "engine_core",
    "executor",
    "gpu_worker",
    "kernels",
)
LEAF_PACKAGES = ("config", "protocol", "metrics", "ipc")
ENTRY_POINT = "serve.cli"  # the `engine` command: dispatches to bench/ too


def _modules() -> dict[str, Path]:
    found = {}
    for package in (*LAYERS, *LEAF_PACKAGES):
        for path in sorted((ROOT / package).rglob("*.py")):
            name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
            found[name.removesuffix(".__init__")] = path
    return found


MODULES = _modules()


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(name: str) -> list[tuple[str, int, bool]]:
    """(imported project module, line, under TYPE_CHECKING) of every import in module name,
    at any depth (imports inside functions count)."""
    path = MODULES[name]
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: list[tuple[str, int, bool]] = []

    def visit(node: ast.AST, typing_only: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _is_type_checking(child):
                for stmt in child.body:
                    visit_one(stmt, True)
                for stmt in child.orelse:
                    visit_one(stmt, typing_only)
                continue
            visit_one(child, typing_only)

    def visit_one(node: ast.AST, typing_only: bool) -> None:
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([node.module] if node.module else []))
            # `from pkg import module` imports the module; `from module import name` the module.
            targets = [
                f"{base}.{alias.name}" if f"{base}.{alias.name}" in MODULES else base
                for alias in node.names
            ]
        for target in targets:
            while target and target not in MODULES:
                target = target.rpartition(".")[0]
            if target and target != name:
                found.append((target, node.lineno, typing_only))
        visit(node, typing_only)

    visit(ast.parse(path.read_text()), False)
    return found


def _is_leaf(name: str) -> bool:
    return name.split(".")[0] in LEAF_PACKAGES


def _layer(name: str) -> int:
    return LAYERS.index(name.split(".")[0])


def test_imports_run_inward_and_leaves_stay_leaves():
    wrong = []
    for name in MODULES:
        for target, line, _ in _imports(name):
            if _is_leaf(target) or target.split(".")[0] == name.split(".")[0]:
                continue  # a leaf, or within one folder
            where = f"{MODULES[name].relative_to(ROOT)}:{line} imports {target}"
            if _is_leaf(name):
                wrong.append(f"{where}: a leaf imports only leaves")
            elif name == ENTRY_POINT and target.split(".")[0] == "bench":
                continue
            elif _layer(target) < _layer(name):
                wrong.append(f"{where}: outward")
    assert not wrong, "\n".join(wrong)


def test_no_import_loops_between_files():
    graph = {
        name: {t for t, _, typing_only in _imports(name) if not typing_only} for name in MODULES
    }
    # Tarjan's strongly connected components: a component of two or more files is a loop.
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    loops: list[list[str]] = []

    def connect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                loops.append(sorted(component))

    for name in graph:
        if name not in index:
            connect(name)
    assert not loops, "import loops: " + "; ".join(" <-> ".join(loop) for loop in loops)


def test_the_checks_see_a_wrong_import(monkeypatch, tmp_path):
    """The reader finds imports at any depth, and under TYPE_CHECKING for the direction."""
    fake = tmp_path / "kernels" / "fake.py"
    fake.parent.mkdir()
    fake.write_text(
        "from typing import TYPE_CHECKING\n"
        "def f():\n    from frontend import llm\n"
        "if TYPE_CHECKING:\n    from engine_core.scheduler import Scheduler\n"
    )
    monkeypatch.setitem(MODULES, "kernels.fake", fake)
    found = _imports("kernels.fake")
    assert ("frontend.llm", 3, False) in found
    assert ("engine_core.scheduler", 5, True) in found
    assert _layer("frontend.llm") < _layer("kernels.fake")


def test_folders_import_one_way():
    """No folder imports a folder that imports it back, type-only imports included (a reader
    follows those too); the one exception is the `engine bench` command's dispatch into bench/."""
    edges = {
        (name.split(".")[0], target.split(".")[0])
        for name in MODULES
        for target, _, _ in _imports(name)
        if name.split(".")[0] != target.split(".")[0]
        and not (name == ENTRY_POINT and target.split(".")[0] == "bench")
    }
    both_ways = sorted(f"{a} <-> {b}" for a, b in edges if (b, a) in edges and a < b)
    assert not both_ways, "folders that import each other: " + "; ".join(both_ways)


MAX_LINES = 600


def test_no_python_file_over_600_lines():
    """Small files with one idea each: no module of the engine, bench/ or scripts/ over 600
    lines (tests excluded)."""
    paths = [*MODULES.values(), *sorted((ROOT / "scripts").rglob("*.py"))]
    long = sorted(
        f"{path.relative_to(ROOT)}: {n}"
        for path in paths
        if (n := len(path.read_text().splitlines())) > MAX_LINES
    )
    assert not long, "over 600 lines: " + ", ".join(long)
