"""The project's import graph (grimp, import-linter's engine) has no circle between two of
its modules, lazy imports inside functions included, and keeps the layers of pyproject.toml."""

from __future__ import annotations

import pkgutil
import subprocess
import sys
from pathlib import Path

import pytest

grimp = pytest.importorskip("grimp")

REPO = Path(__file__).resolve().parents[2]


def circles(graph) -> list[list[str]]:
    """The strongly connected groups of more than one module (Tarjan, iteratively)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in sorted(graph.modules):
        if root in index:
            continue
        work = [(root, iter(sorted(graph.find_modules_directly_imported_by(root))))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.find_modules_directly_imported_by(
                        child)))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
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


def test_no_module_imports_itself_through_others() -> None:
    graph = grimp.build_graph("compress", "export", "serve", "benchmarks")
    assert len(graph.modules) > 100
    assert any(m.startswith("benchmarks.harness.") for m in graph.modules)
    assert circles(graph) == []


def test_benchmark_suites_import_the_harness_and_no_other_suite() -> None:
    """benchmarks/<suite>/ imports its own suite and benchmarks/harness/ alone; the harness
    imports no suite (pyproject.toml's contract says the same to lint-imports)."""
    graph = grimp.build_graph("benchmarks")
    suites = {m.split(".")[1] for m in graph.modules if m.count(".") >= 2}
    assert {"harness", "classifier", "embedding", "causal_lm", "headline"} <= suites
    crossing = []
    for module in sorted(graph.modules):
        if module.count(".") < 2:
            continue
        own = module.split(".")[1]
        allowed = {own} if own == "harness" else {own, "harness"}
        crossing += [f"{module} -> {imported}"
                     for imported in sorted(graph.find_modules_directly_imported_by(module))
                     if imported.startswith("benchmarks.") and imported.count(".") >= 1
                     and imported.split(".")[1] not in allowed]
    assert crossing == []


def test_the_circle_finder_finds_a_circle() -> None:
    graph = grimp.ImportGraph()
    for module in ("a", "a.x", "a.y", "a.z"):
        graph.add_module(module)
    graph.add_import(importer="a.x", imported="a.y")
    graph.add_import(importer="a.y", imported="a.x")
    graph.add_import(importer="a.z", imported="a.x")
    assert circles(graph) == [["a.x", "a.y"]]


def test_the_layer_contracts_hold() -> None:
    done = subprocess.run([str(Path(sys.executable).with_name("lint-imports"))], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout[-3000:]
    assert "0 broken" in done.stdout and "6 kept" in done.stdout


def test_what_ships_imports_only_what_ships_beside_it() -> None:
    """serve's own modules (every archive's) import no family package; a family's package
    imports serve's own modules and itself; the causal-LM runtime, which an export folder
    ships alone, imports nothing of serve outside itself."""
    graph = grimp.build_graph("serve")
    families = {"classifier", "embedding", "causal_lm"}
    crossing = []
    for module in sorted(graph.modules):
        parts = module.split(".")
        if len(parts) < 2:
            continue
        own = parts[1] if parts[1] in families else None
        runtime = module.startswith("serve.causal_lm.runtime")
        for imported in sorted(graph.find_modules_directly_imported_by(module)):
            theirs = imported.split(".")
            other = len(theirs) > 1 and theirs[1] in families and theirs[1] != own
            outside = runtime and not imported.startswith("serve.causal_lm.runtime")
            if imported.startswith("serve") and (other or outside):
                crossing.append(f"{module} -> {imported}")
    assert crossing == []
    assert "serve.causal_lm.server.handler" in graph.modules


def test_a_family_is_one_package_not_affixed_modules() -> None:
    """A family's code lives in its package (compress/families/<family>/, serve/<family>/):
    no module or package is named with an `lm_` prefix or an `_lm` suffix beside shared ones,
    and no test file either (the family's own name, `causal_lm`, names its packages and
    `test_causal_lm_*` its tests)."""
    named = [p.relative_to(REPO) for top in ("compress", "serve", "export", "tests")
             for p in (REPO / top).rglob("*") if "__pycache__" not in p.parts
             and (p.is_dir() or p.suffix in (".py", ".cpp"))]
    assert len(named) > 100
    stems = {p: p.stem.removeprefix("test_") for p in named}
    affixed = [str(p) for p, stem in stems.items() if stem != "causal_lm"
               and (stem.startswith("lm_") or stem.endswith("_lm"))]
    assert affixed == []


def test_no_sub_package_shadows_a_name_of_the_python_api() -> None:
    """Importing a sub-package sets it as an attribute of `compress`: one named like an API
    function (`compress.run`) would replace that function."""
    import compress

    packages = {info.name for info in pkgutil.iter_modules(compress.__path__)}
    assert packages >= {"cli", "pipeline", "stages", "models", "recipe"}
    assert packages.isdisjoint(compress.__all__), packages & set(compress.__all__)
