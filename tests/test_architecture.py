"""The folder layout is the architecture: memwal_core's layers import only downwards, no module
imports itself back through others (lazy imports inside functions count), the core never
imports Dagster, and test modules share code only through tests/support/. Read from the source
with `ast`, so nothing here depends on what is installed.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# Lower layers first: a module may import its own layer and the ones before it.
LAYERS = ["memwal_core.faults", "memwal_core.units", "memwal_core.errors", "memwal_core.failures", "memwal_core.options", "memwal_core.proto",
          "memwal_core.state", "memwal_core.spark", "memwal_core.jobs", "memwal_core.observe", "memwal_core.steps",
          "memwal_core.tools"]


def _modules(package: str) -> dict[str, Path]:
    base = ROOT / package
    out = {}
    for path in base.rglob("*.py"):
        if path.name.endswith("_pb2.py"):
            continue
        parts = path.relative_to(ROOT).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


def _imports(name: str, path: Path, known: set[str]) -> set[str]:
    """Every module of `known` that `name` imports, at top level or inside a function."""
    pkg = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            mod = node.module or ""
            if node.level:
                base = pkg.split(".")[: len(pkg.split(".")) - node.level + 1]
                mod = ".".join(base + ([mod] if mod else []))
            targets = [f"{mod}.{a.name}" for a in node.names] + [mod]
        for t in targets:
            while t and t not in known:
                t = t.rpartition(".")[0]
            if t and t != name:
                found.add(t)
    return found


def _graph() -> dict[str, set[str]]:
    mods = {**_modules("memwal_core"), **_modules("memwal_pipeline")}
    known = set(mods)
    # A package's __init__ is not an edge of its own: importing `memwal_core.state.store` runs
    # `memwal_core.state` first, but that says nothing about who depends on whom.
    return {m: {t for t in _imports(m, p, known) if not (m.startswith(t + ".") and mods[t].name == "__init__.py")}
            for m, p in mods.items()}


def _layer(module: str) -> int | None:
    for i, prefix in enumerate(LAYERS):
        if module == prefix or module.startswith(prefix + "."):
            return i
    return None


def test_no_import_cycles():
    graph = _graph()
    state: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[list[str]] = []

    def visit(m: str) -> None:
        state[m] = 1
        stack.append(m)
        for n in sorted(graph.get(m, ())):
            if state.get(n) == 1:
                cycles.append(stack[stack.index(n):] + [n])
            elif n not in state:
                visit(n)
        stack.pop()
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m)
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(c) for c in cycles)


def test_core_layers_import_downwards_only():
    wrong = []
    for m, deps in _graph().items():
        if not m.startswith("memwal_core"):
            continue
        for d in deps:
            if d.startswith("memwal_pipeline"):
                wrong.append(f"{m} -> {d} (the core never imports the Dagster layer)")
            elif (_layer(m) or 0) < (_layer(d) or 0):
                wrong.append(f"{m} -> {d}")
    assert not wrong, "upward imports:\n" + "\n".join(sorted(wrong))


@pytest.mark.parametrize("path", sorted(_modules("memwal_core").values()), ids=lambda p: str(p.relative_to(ROOT)))
def test_core_never_imports_dagster(path):
    tree = ast.parse(path.read_text())
    names = [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
    names += [n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
    assert not [n for n in names if n.split(".")[0].startswith("dagster")]


def test_layers_cover_every_core_module():
    """A new top-level module must be given a layer (or it would escape the checks above)."""
    loose = [m for m in _modules("memwal_core") if m != "memwal_core" and _layer(m) is None]
    assert not loose, f"put these in a layer (tests/test_architecture.py LAYERS): {loose}"


def test_test_modules_import_only_the_support_package():
    """A test module is never a library: what several tests share lives in tests/support/, and the
    top of tests/ and its folders of tests (tests/wall/) hold only test modules and conftest.py."""
    tests = ROOT / "tests"
    folders = [tests, *(d for d in sorted(tests.iterdir()) if d.is_dir() and any(d.glob("test_*.py")))]
    loose = [str(p.relative_to(tests)) for d in folders for p in d.glob("*.py")
             if not p.name.startswith("test_") and p.name != "conftest.py"]
    wrong = []
    for path in sorted(p for d in folders for p in d.glob("test_*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else []
            wrong += [f"{path.name} imports {n}" for n in names if n.split(".")[0].startswith(("test_", "conftest"))]
    assert not loose, f"move these into tests/support/: {loose}"
    assert not wrong, "\n".join(wrong)
