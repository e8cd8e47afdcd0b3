"""The stage packages' import graph (issue 17): no module imports an entry point (`__main__` or a bench script), and
the packages import each other without a cycle — shared contracts live below the stages (data_gen.contract, models,
utils). And no function outside tests/ is over 80 lines (issue 28): a job reads top to bottom in named steps."""

from __future__ import annotations

import ast
from pathlib import Path

from tests.conftest import REPO

PACKAGES = ("data_gen", "models", "train", "eval", "decode", "utils", "bench")
STAGES = PACKAGES[:-1]  # bench/ holds entry points (python -m bench.<script>) above every stage


def imports(path: Path) -> list[str]:
    """Every absolute module a file imports, at top level or inside functions."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            out += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out += [node.module] + [f"{node.module}.{a.name}" for a in node.names]
    return out


def graph() -> dict[str, dict[str, list[str]]]:
    """package → {imported package: [importing files]} for edges between different stage packages."""
    edges: dict[str, dict[str, list[str]]] = {p: {} for p in PACKAGES}
    for pkg in PACKAGES:
        for path in sorted((REPO / pkg).rglob("*.py")):
            for mod in imports(path):
                top = mod.split(".")[0]
                if top in PACKAGES and top != pkg:
                    edges[pkg].setdefault(top, []).append(str(path.relative_to(REPO)))
    return edges


def test_no_module_imports_an_entry_point():
    bad = [(str(p.relative_to(REPO)), m) for pkg in PACKAGES for p in (REPO / pkg).rglob("*.py")
           for m in imports(p) if m.split(".")[0] in PACKAGES and "__main__" in m.split(".")]
    assert bad == []


def test_no_stage_imports_a_bench_script():
    edges = graph()
    assert {pkg: edges[pkg]["bench"] for pkg in STAGES if "bench" in edges[pkg]} == {}


def test_stage_packages_import_each_other_without_a_cycle():
    edges = graph()
    state: dict[str, int] = {}
    cycle: list[str] = []

    def visit(node, stack):
        state[node] = 1
        for nxt in edges[node]:
            if state.get(nxt) == 1:
                cycle.extend(stack + [node, nxt])
                return True
            if state.get(nxt) is None and visit(nxt, stack + [node]):
                return True
        state[node] = 2
        return False

    for pkg in PACKAGES:
        if state.get(pkg) is None and visit(pkg, []):
            break
    where = {f"{a}->{b}": edges[a][b][:3] for a, b in zip(cycle, cycle[1:])} if cycle else {}
    assert not cycle, f"import cycle {' -> '.join(cycle)}: {where}"


def long_functions(limit: int = 80) -> list[str]:
    """`path:name lines` for every function (methods and nested ones too) longer than `limit` lines in the packages."""
    out = []
    for pkg in PACKAGES:
        for path in sorted((REPO / pkg).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    n = node.end_lineno - node.lineno + 1
                    if n > limit:
                        out.append(f"{path.relative_to(REPO)}:{node.name} {n}")
    return out


def test_no_function_over_80_lines():
    """Issue 28's bar (issue 17 allowed two): split a longer function into named steps."""
    assert long_functions() == []
