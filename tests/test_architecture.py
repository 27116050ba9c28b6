"""The package's shape (docs/architecture.md): no import cycle, at most ``MAX_FLOOR`` import
floors in ``flowtt_jax/``, no source file past ``MAX_LINES`` lines anywhere.

A module's floor is 0 when it imports no other module of the package, else one more than
the highest floor it imports; every import counts, at module level or inside a function.
"""

from __future__ import annotations

import ast
import functools
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "flowtt_jax"
MAX_FLOOR = 6
MAX_LINES = 700
SOURCE_SUFFIXES = {".py", ".cc", ".cu", ".cuh", ".h", ".sh"}
SOURCE_DIRS = ("flowtt_jax", "ffi", "cuda", "tests", "benchmarks", "examples", "scripts")


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def internal_imports(path: Path, modules: set[str], package: str) -> set[str]:
    """The package's modules that ``path`` imports (``from X import name`` counts module
    ``X.name`` when that is a module, else ``X``)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [
                f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in modules else node.module
                for a in node.names
            ]
        else:
            continue
        found.update(n for n in names if n == package or n.startswith(package + "."))
    return {n for n in found if n in modules}


def import_graph(root: Path, package: str) -> dict[str, set[str]]:
    paths = {module_name(p, root): p for p in (root / package).rglob("*.py")}
    return {m: internal_imports(p, set(paths), package) - {m} for m, p in paths.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on_stack, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in graph:
        if v not in index:
            visit(v)
    return out


def floors(graph: dict[str, set[str]]) -> dict[str, int]:
    """Each module's floor (``ValueError`` on a cycle)."""
    if cycles(graph):
        raise ValueError(f"import cycles: {cycles(graph)}")

    @functools.cache
    def floor(m: str) -> int:
        return 1 + max((floor(d) for d in graph[m]), default=-1)

    return {m: floor(m) for m in graph}


def test_checkers_catch_a_cycle_and_count_floors(tmp_path):
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from pkg.sub import b\n")
    (pkg / "sub" / "b.py").write_text("def f():\n    import pkg.c\n")
    (pkg / "c.py").write_text("import os\n")
    graph = import_graph(tmp_path, "pkg")
    assert floors(graph) == {"pkg": 0, "pkg.sub": 0, "pkg.a": 2, "pkg.sub.b": 1, "pkg.c": 0}
    assert cycles(graph) == []
    (pkg / "c.py").write_text("from pkg.a import x\n")
    assert cycles(import_graph(tmp_path, "pkg")) == [["pkg.a", "pkg.c", "pkg.sub.b"]]


def test_no_import_cycle():
    assert cycles(import_graph(ROOT, PACKAGE)) == []
    for sub in ("benchmarks", "examples"):
        assert cycles(import_graph(ROOT, sub)) == [], sub


def test_import_floors():
    graph = import_graph(ROOT, PACKAGE)
    high = {m: f for m, f in floors(graph).items() if f > MAX_FLOOR}
    assert not high, f"modules above floor {MAX_FLOOR}: {high}"


@pytest.mark.parametrize("top", SOURCE_DIRS)
def test_no_source_file_too_long(top):
    long = {
        str(p.relative_to(ROOT)): n
        for p in (ROOT / top).rglob("*")
        if p.suffix in SOURCE_SUFFIXES and (n := len(p.read_text().splitlines())) > MAX_LINES
    }
    assert not long, f"source files over {MAX_LINES} lines: {long}"
