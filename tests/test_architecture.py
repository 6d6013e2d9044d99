"""The package is a pipeline: every import, at module level or inside a function, points to an
earlier stage (or to the shared base modules), and no modules import each other in a circle."""
import ast
from pathlib import Path

import pytest

import symhess

PACKAGE = Path(symhess.__file__).resolve().parent
STAGES = ["expr", "calculus", "layers", "printing", "runtime", "codegen", "curvature", "cli"]
BASE = {"symhess.errors", "symhess._version"}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def is_module(name: str) -> bool:
    rel = Path(*name.split("."))
    return (PACKAGE.parent / rel.with_suffix(".py")).exists() or (PACKAGE.parent / rel / "__init__.py").exists()


def imports(path: Path) -> set:
    """Every symhess module ``path`` imports (``from pkg import submodule`` names the submodule)."""
    return imports_of(path.read_text(), module_name(path), path.name == "__init__.py")


def imports_of(source: str, name: str, is_package: bool) -> set:
    package = name if is_package else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(base + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            if base.split(".")[0] != "symhess":
                continue
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                out.add(sub if is_module(sub) else base)
        elif isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name.split(".")[0] == "symhess"}
    return out - {name}


GRAPH = {module_name(p): imports(p) for p in sorted(PACKAGE.rglob("*.py"))}


def stage(name):
    parts = name.split(".")
    return STAGES.index(parts[1]) if len(parts) > 1 and parts[1] in STAGES else None


def test_every_module_sits_in_a_stage():
    loose = sorted(m for m in GRAPH if stage(m) is None and m not in BASE
                   and m not in ("symhess", "symhess.__main__"))
    assert not loose, f"modules outside the pipeline's folders: {loose}"


@pytest.mark.parametrize("name", sorted(m for m in GRAPH if stage(m) is not None))
def test_imports_point_down_the_pipeline(name):
    bad = [t for t in sorted(GRAPH[name])
           if t not in BASE and (stage(t) is None or stage(t) > stage(name))]
    assert not bad, f"{name} imports from a later stage: {bad}"


def test_no_import_circles():
    """Tarjan's strongly connected components of the import graph are all single modules."""
    index, low, stack, on, circles = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in GRAPH.get(v, ()):
            if w not in GRAPH:
                continue
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
                circles.append(sorted(comp))

    for v in GRAPH:
        if v not in index:
            visit(v)
    assert not circles, f"import circles: {circles}"


def test_the_checker_sees_imports_inside_functions_and_relative_ones():
    source = ("from . import nodes as E\n"
              "def f():\n"
              "    from ..cli import main\n"
              "    from ..runtime.network import net\n")
    got = imports_of(source, "symhess.expr.fake", is_package=False)
    assert got == {"symhess.expr.nodes", "symhess.cli.main", "symhess.runtime.network"}
    assert [t for t in sorted(got) if stage(t) > stage("symhess.expr.fake")] == \
        ["symhess.cli.main", "symhess.runtime.network"]
