"""Layers point one way. Every `import` in src/pagedserve (at module level or inside a
function) may reach only its own layer or one below; core imports nothing but the
standard library; and neither two modules nor two packages import each other, however
indirectly. No module is exempt: the `pagedserve` command (entrypoints/cli.py) is part
of entrypoints, the top layer, and reaches router/, sim/ and bench/ by ordinary
(lazy) imports that this test reads like any other.

The order (docs/architecture.md draws it):

    core -> attention, kernels, model, workload, paths, kv_transfer -> spec_decode,
    structured_output and the top-level option/result modules -> http (engine-free HTTP
    pieces: request bodies, errors, middleware, SSE, chat rendering) -> worker ->
    distributed (tensor parallelism) -> engine -> router, sim, bench -> entrypoints (the
    server and the command line) and the package root (they launch everything)
"""
from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

PACKAGE = "pagedserve"
SRC = Path(__file__).resolve().parent.parent / "src" / PACKAGE

LAYERS: list[set[str]] = [
    {"core"},
    {"attention", "kernels", "model", "multimodal", "workload", "paths", "kv_transfer"},
    {"spec_decode", "structured_output", "engine_config", "resolved_config", "sampling_params", "pooling_params", "sampling_state", "outputs"},
    {"http"},
    {"worker"},
    {"distributed"},
    {"engine"},
    {"router", "sim", "bench"},
    {"entrypoints", PACKAGE},
]
RANK = {unit: rank for rank, units in enumerate(LAYERS) for unit in units}


def module_name(root: Path, path: Path) -> str:
    parts = (root.name, *path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def unit_of(module: str) -> str:
    """The layer unit a module belongs to: its sub-package (or top-level module)."""
    parts = module.split(".")
    return PACKAGE if len(parts) == 1 else parts[1]


def imports_of(root: Path, path: Path) -> list[tuple[int, str]]:
    """(line, absolute module) for every import in the file, nested ones included."""
    module = module_name(root, path)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    known = {module_name(root, p) for p in root.rglob("*.py")}
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = package.split(".")[: len(package.split(".")) - node.level + 1] if node.level else []
            target = ".".join(base + ([node.module] if node.module else []))
            if target == root.name and all(a.name.startswith("__") for a in node.names):
                continue  # package metadata (__version__), not code from the top layer
            # `from . import x` names a module; `from .m import f` names something in m.
            subs = [f"{target}.{a.name}" for a in node.names if f"{target}.{a.name}" in known]
            found += [(node.lineno, t) for t in subs or [target]]
    return found


def check(root: Path) -> tuple[list[str], list[str], dict[str, set[str]]]:
    """(upward imports, core's non-stdlib imports, module -> package modules it imports)."""
    upward, core_outside, graph = [], [], {}
    for path in sorted(root.rglob("*.py")):
        module = module_name(root, path)
        src_unit = unit_of(module)
        graph[module] = set()
        for line, target in imports_of(root, path):
            where = f"{path.relative_to(root.parent)}:{line} imports {target}"
            if target.split(".")[0] != root.name:
                if src_unit == "core" and target.split(".")[0] not in sys.stdlib_module_names:
                    core_outside.append(where)
                continue
            graph[module].add(target)
            dst_unit = unit_of(target)
            if dst_unit != src_unit and RANK[dst_unit] > RANK[src_unit]:
                upward.append(where)
    return upward, core_outside, graph


def package_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """The module graph with each module replaced by its unit (package or top-level module)."""
    units: dict[str, set[str]] = {}
    for module, targets in graph.items():
        units.setdefault(unit_of(module), set()).update(unit_of(t) for t in targets)
    for unit, targets in units.items():
        targets.discard(unit)
    return units


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected groups of more than one node (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_every_unit_has_a_layer():
    units = {unit_of(module_name(SRC, p)) for p in SRC.rglob("*.py")}
    assert units <= set(RANK), f"place {sorted(units - set(RANK))} in LAYERS (and in docs/architecture.md)"


def test_imports_point_down():
    upward, _, _ = check(SRC)
    assert not upward, "upward imports:\n" + "\n".join(upward)


def test_core_imports_only_the_standard_library():
    _, core_outside, _ = check(SRC)
    assert not core_outside, "core imports outside the standard library:\n" + "\n".join(core_outside)


def test_no_import_cycles():
    groups = cycles(check(SRC)[2])
    assert not groups, "modules that import each other: " + "; ".join(" <-> ".join(g) for g in groups)


def test_no_package_cycles():
    groups = cycles(package_graph(check(SRC)[2]))
    assert not groups, "packages that import each other: " + "; ".join(" <-> ".join(g) for g in groups)


@pytest.fixture
def tiny_package(tmp_path: Path) -> Path:
    root = tmp_path / PACKAGE
    for sub in ("core", "engine"):
        (root / sub).mkdir(parents=True)
        (root / sub / "__init__.py").write_text("")
    (root / "__init__.py").write_text("")
    (root / "engine" / "loop.py").write_text("from ..core import request\n")
    (root / "core" / "request.py").write_text("import json\n")
    return root


def test_the_check_sees_an_upward_import(tiny_package: Path):
    assert check(tiny_package)[:2] == ([], [])
    (tiny_package / "core" / "request.py").write_text("def f():\n    from ..engine import loop\n")
    upward, _, graph = check(tiny_package)
    assert upward == [f"{PACKAGE}/core/request.py:2 imports {PACKAGE}.engine.loop"]
    assert cycles(graph) == [[f"{PACKAGE}.core.request", f"{PACKAGE}.engine.loop"]]


def test_the_check_sees_a_package_cycle_between_acyclic_modules(tiny_package: Path):
    for sub in ("sim", "bench"):
        (tiny_package / sub).mkdir()
        (tiny_package / sub / "__init__.py").write_text("")
    (tiny_package / "sim" / "twin.py").write_text("from ..bench import load\n")
    (tiny_package / "bench" / "load.py").write_text("")
    (tiny_package / "bench" / "compare.py").write_text("def f():\n    from ..sim import report\n")
    (tiny_package / "sim" / "report.py").write_text("")
    upward, _, graph = check(tiny_package)
    assert upward == [] and cycles(graph) == []
    assert cycles(package_graph(graph)) == [["bench", "sim"]]


def test_the_check_sees_core_reaching_outside_the_standard_library(tiny_package: Path):
    (tiny_package / "core" / "request.py").write_text("import numpy\n")
    assert check(tiny_package)[1] == [f"{PACKAGE}/core/request.py:1 imports numpy"]
