"""The import contracts of pyproject's ``[tool.autopar.architecture]``, on the source itself.

Every import counts, function-local ones included: layers (a module never imports a layer
above its own), no cycles, the context read only at the public entry points, and no function
longer than ``max_function_lines`` (and no line of any Python file longer than
``max_line_length``). Each check also runs on a small bad example, so it can fail.
"""

from __future__ import annotations

import ast
import fnmatch
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CONTRACTS = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["autopar"][
    "architecture"]
PACKAGES = {"autopar": ROOT / "autopar", "autopar.strategies": ROOT / "strategies",
            "autopar.kernels": ROOT / "kernels"}
CONTEXT_READS = {"current_config", "resolve_context", "explicit_keys", "resolve_setup",
                 "current_algo_parameters", "read_context"}


def modules() -> dict[str, Path]:
    """Every module of autopar by dotted name (strategies/ and kernels/ under their names)."""
    out = {}
    for pkg, folder in PACKAGES.items():
        for f in sorted(folder.rglob("*.py")):
            parts = [p for p in f.relative_to(folder).with_suffix("").parts if p != "__init__"]
            out[".".join([pkg, *parts])] = f
    return out


def _target(name: str, known: dict) -> str | None:
    while name and name not in known:
        name = name.rpartition(".")[0]
    return name or None


def imports(module: str, tree: ast.AST, known: dict) -> set[str]:
    """The autopar modules ``module`` imports anywhere in its source."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                here = module if known[module].name == "__init__.py" else \
                    module.rpartition(".")[0]
                for _ in range(node.level - 1):
                    here = here.rpartition(".")[0]
                base = f"{here}.{base}" if base else here
            names = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base
                     for a in node.names]
        else:
            continue
        found |= {t for n in names if (t := _target(n, known)) and t != module}
    return found


def import_graph() -> dict[str, set[str]]:
    known = modules()
    return {m: imports(m, ast.parse(f.read_text(encoding="utf-8")), known)
            for m, f in known.items()}


def layer_of(module: str, layers: list[list[str]]) -> int | None:
    """Index of the layer holding ``module`` (0 = top)."""
    hits = [i for i, layer in enumerate(layers) for pat in layer
            if module == pat or (pat.endswith(".*") and
                                 (module == pat[:-2] or fnmatch.fnmatch(module, pat)))]
    return min(hits) if hits else None


def layer_violations(graph: dict[str, set[str]], layers: list[list[str]]) -> list[str]:
    out = []
    for m, deps in sorted(graph.items()):
        lm = layer_of(m, layers)
        out += [f"{m} (layer {lm}) imports {d} (layer {layer_of(d, layers)}, above)"
                for d in sorted(deps) if lm is not None and (layer_of(d, layers) or 0) < lm]
    return out


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def context_reads(module: str, tree: ast.AST) -> list[tuple[str, int]]:
    """(qualified function, line) of every call reading the context in ``module``."""
    out = []

    def walk(node: ast.AST, where: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                walk(child, f"{where}.{child.name}")
                continue
            if isinstance(child, ast.Call):
                f = child.func
                name = f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", None)
                if name in CONTEXT_READS:
                    out.append((where, child.lineno))
            walk(child, where)

    walk(tree, module)
    return out


def long_functions(module: str, tree: ast.AST, limit: int) -> list[str]:
    return [f"{module}.{n.name}: {n.end_lineno - n.lineno + 1} lines"
            for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
            and n.end_lineno - n.lineno + 1 > limit]


def long_lines(name: str, text: str, limit: int) -> list[str]:
    return [f"{name}:{k}: {len(line)} characters"
            for k, line in enumerate(text.splitlines(), 1) if len(line) > limit]


# ------------------------------------------------------------------------------ the contracts

def test_every_module_has_a_layer():
    missing = [m for m in modules() if layer_of(m, CONTRACTS["layers"]) is None]
    assert not missing, f"place these modules in a layer of [tool.autopar.architecture]: {missing}"


def test_no_module_imports_a_layer_above_its_own():
    assert layer_violations(import_graph(), CONTRACTS["layers"]) == []


def test_no_import_cycle():
    assert cycles(import_graph()) == []


def test_the_context_is_read_only_at_the_entry_points():
    owners, readers = set(CONTRACTS["context_owners"]), set(CONTRACTS["context_readers"])
    bad = [f"{where}:{line}" for m, f in modules().items() if m not in owners
           for where, line in context_reads(m, ast.parse(f.read_text(encoding="utf-8")))
           if where not in readers and not any(where.startswith(r + ".") for r in readers)]
    assert bad == [], "context read below an entry point (pass the resolved values down)"


def test_no_function_is_longer_than_the_limit():
    limit = CONTRACTS["max_function_lines"]
    bad = [x for m, f in modules().items()
           for x in long_functions(m, ast.parse(f.read_text(encoding="utf-8")), limit)]
    assert bad == []


def test_no_line_is_longer_than_the_limit():
    limit = CONTRACTS["max_line_length"]
    files = [f for d in ("autopar", "strategies", "kernels", "tests", "benchmarks")
             for f in sorted((ROOT / d).rglob("*.py"))]
    bad = [x for f in files
           for x in long_lines(str(f.relative_to(ROOT)), f.read_text(encoding="utf-8"), limit)]
    assert bad == []


# ------------------------------------------------------------------------ the checks can fail

def test_the_checks_find_what_they_look_for():
    graph = {"a.x": {"a.y"}, "a.y": {"a.z"}, "a.z": {"a.x"}, "a.w": set()}
    assert cycles(graph) == [["a.x", "a.y", "a.z"]]
    assert layer_violations({"a.low": {"a.top"}}, [["a.top"], ["a.low"]]) == [
        "a.low (layer 1) imports a.top (layer 0, above)"]
    src = ("def entry():\n    current_config()\n"
           "class Step:\n    def __init__(self):\n        ctx.resolve_context()\n")
    assert context_reads("m", ast.parse(src)) == [("m.entry", 2), ("m.Step.__init__", 5)]
    assert long_functions("m", ast.parse("def f():\n" + "    x = 1\n" * 3), 3) == [
        "m.f: 4 lines"]
    assert long_lines("m.py", "ok\n" + "x" * 6 + "\n", 5) == ["m.py:2: 6 characters"]


@pytest.mark.parametrize("source, expected", [
    ("from autopar.strategies import search\n", {"autopar.strategies.search"}),
    ("def f():\n    from autopar import clusters\n", {"autopar.clusters"}),
    ("import autopar.files as f\n", {"autopar.files"}),
    ("from .layout import DeviceMesh\n", {"autopar.strategies.layout"}),
])
def test_imports_are_resolved_to_modules(source, expected):
    known = modules()
    assert imports("autopar.strategies.plan", ast.parse(source), known) == expected


def test_every_module_is_in_docs_architecture():
    """docs/architecture.md's module table names every module (by its file name)."""
    doc = (ROOT / "docs" / "architecture.md").read_text(encoding="utf-8")
    names = {m.rpartition(".")[2] for m in modules()} - {"autopar", "strategies", "kernels"}
    assert sorted(n for n in names if n not in doc) == []
