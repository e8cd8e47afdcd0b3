"""The house's shape (issues 17, 28, 51): the stage packages form a stack — utils < models < data_gen < decode < eval
< train < bench — and an import never points up it; no two modules import each other at any depth (a module cycle,
top-level or function-local imports alike); nothing imports an entry point (`__main__`); no module outside tests/ is
over 450 lines and no function over 60. The checkers take a root folder, so the last tests plant an upward import and
a module cycle in a tmp tree and see both caught."""

from __future__ import annotations

import ast
from pathlib import Path

from tests.conftest import REPO

STACK = ("utils", "models", "data_gen", "decode", "eval", "train", "bench")  # lower first
MAX_MODULE_LINES, MAX_FUNCTION_LINES = 450, 60


def module_name(root: Path, path: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules(root: Path, packages=STACK) -> dict[str, Path]:
    """Dotted name → file for every module of the stage packages under `root`."""
    return {module_name(root, p): p for pkg in packages if (root / pkg).is_dir() for p in sorted((root / pkg).rglob("*.py"))}


def imports(path: Path, name: str) -> list[str]:
    """Every module a file imports (absolute or relative, top level or inside functions), as written: `from a.b import
    c` gives both a.b and a.b.c (c may be a module; `edges` keeps whichever exists)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            out += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            out += [base] + [f"{base}.{a.name}" for a in node.names]
    return out


def edges(root: Path, packages=STACK) -> dict[str, set[str]]:
    """module → the repo modules it imports (the longest existing prefix of each imported name)."""
    mods = modules(root, packages)
    out: dict[str, set[str]] = {}
    for name, path in mods.items():
        deps = set()
        for imp in imports(path, name):
            parts = imp.split(".")
            while parts and ".".join(parts) not in mods:
                parts.pop()
            if parts and ".".join(parts) != name:
                deps.add(".".join(parts))
        out[name] = deps
    return out


def upward_imports(root: Path) -> list[str]:
    """`a -> b` for every import from a lower stage package of a higher one."""
    rank = {pkg: i for i, pkg in enumerate(STACK)}
    return sorted(f"{a} -> {b}" for a, deps in edges(root).items() for b in deps
                  if rank[b.split(".")[0]] > rank[a.split(".")[0]])


def module_cycles(root: Path) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan): each is a set of modules that import each
    other at some depth."""
    graph = edges(root)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:  # recursion depth is bounded by the module count (a few hundred)
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in graph:
        if v not in index:
            visit(v)
    return found


def entry_point_imports(root: Path) -> list[str]:
    return sorted(f"{a} -> {b}" for a, deps in edges(root).items() for b in deps if b.split(".")[-1] == "__main__")


def long_functions(root: Path = REPO, limit: int = MAX_FUNCTION_LINES) -> list[str]:
    """`path:name lines` for every function (methods and nested ones too) longer than `limit` lines."""
    out = []
    for name, path in modules(root).items():
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                if n > limit:
                    out.append(f"{path.relative_to(root)}:{node.name} {n}")
    return out


def long_modules(root: Path = REPO, limit: int = MAX_MODULE_LINES) -> list[str]:
    return [f"{p.relative_to(root)} {n}" for p in modules(root).values() if (n := len(p.read_text().splitlines())) > limit]


# ------------------------------------------------------------------------------------------------- the repository


def test_no_import_points_up_the_stack():
    assert upward_imports(REPO) == []


def test_no_two_modules_import_each_other():
    assert module_cycles(REPO) == []


def test_no_module_imports_an_entry_point():
    assert entry_point_imports(REPO) == []


def test_no_function_over_60_lines():
    """Issue 51's bar (issue 28's was 80): split a longer function into named steps."""
    assert long_functions() == []


def test_no_module_over_450_lines():
    assert long_modules() == []


# ------------------------------------------------------------------------------------- the checkers catch a plant


def plant(root: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    for pkg in STACK:
        (root / pkg).mkdir(exist_ok=True)
        (root / pkg / "__init__.py").touch()
    return root


def test_a_planted_upward_import_is_caught(tmp_path):
    root = plant(tmp_path, {"models/lm.py": "def f():\n    from decode.loop import speculative\n",
                            "decode/loop.py": "from models import lm\n\ndef speculative():\n    pass\n"})
    assert upward_imports(root) == ["models.lm -> decode.loop"]
    assert module_cycles(root) == [["decode.loop", "models.lm"]]  # and that one also closes a cycle


def test_a_planted_module_cycle_is_caught_at_any_depth(tmp_path):
    """a → b → c → a inside one package (no stage order broken), c's import hidden in a function, relative."""
    root = plant(tmp_path, {"eval/a.py": "import eval.b\n", "eval/b.py": "from eval.c import g\n",
                            "eval/c.py": "def g():\n    from . import a\n", "eval/d.py": "import eval.a\n"})
    assert upward_imports(root) == []
    assert module_cycles(root) == [["eval.a", "eval.b", "eval.c"]]
    (root / "eval/c.py").write_text("def g():\n    pass\n")
    assert module_cycles(root) == []


def test_a_planted_entry_point_import_and_long_function_are_caught(tmp_path):
    body = "\n".join(f"    x{i} = {i}" for i in range(61))
    root = plant(tmp_path, {"train/__main__.py": "", "bench/x.py": "import train.__main__\n",
                            "utils/long.py": f"def f():\n{body}\n"})
    assert entry_point_imports(root) == ["bench.x -> train.__main__"]
    assert long_functions(root) == ["utils/long.py:f 62"]
