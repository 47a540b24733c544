"""Static views of the project's own source tree, for the layout rules of ``tests/test_project_layout.py``:
the import graph (module-level and function-level imports), its cycles, the same graph between
packages (the floors of docs/DESIGN.md §2), and module line counts."""

from __future__ import annotations

import ast
import fnmatch
import pathlib

__all__ = ["ROOT", "PACKAGES", "LIBRARY", "UNITS", "LEAVES", "module_files", "module_name", "import_graph",
           "import_cycles", "is_leaf", "unit_of", "package_graph", "package_cycles", "line_counts"]

ROOT = pathlib.Path(__file__).resolve().parents[2]
PACKAGES = ("inductor_ext", "lowerings", "fake_impls", "graphs", "tests")
LIBRARY = ("inductor_ext", "lowerings", "fake_impls", "graphs")  # the installed packages (tests/ left out)
# the packages of the package-level graph: a module belongs to the longest one that names it or a
# package above it. inductor_ext's own top-level modules are ``inductor_ext`` (the public surface:
# __init__, plugin), except its command line, which sits on top of the commands it runs
UNITS = ("fake_impls", "lowerings", "graphs", "inductor_ext", "inductor_ext.ops", "inductor_ext.kernels",
         "inductor_ext.parallel", "inductor_ext.bench", "inductor_ext.report", "inductor_ext.__main__")
# the leaves (DESIGN §2), fnmatch patterns of module names: they import nothing of the project but
# each other, so every floor may import them; in the package graph they are a node of their own
# below their package ("inductor_ext.ops (leaves)")
LEAVES = ("inductor_ext._version", "inductor_ext.validation", "inductor_ext.config", "inductor_ext.workspace",
          "inductor_ext.backends", "inductor_ext.cli_args", "inductor_ext.ops._checks", "inductor_ext.ops.packing",
          "inductor_ext.ops.ordered", "inductor_ext.ops.*_reference")


def module_files(root: pathlib.Path = ROOT, packages=PACKAGES) -> list[pathlib.Path]:
    """Every ``.py`` file of the project's packages below ``root``, sorted."""
    return sorted(p for pkg in packages for p in (root / pkg).rglob("*.py"))


def module_name(path: pathlib.Path, root: pathlib.Path = ROOT) -> str:
    """Dotted module name of ``path`` (a package's ``__init__.py`` names the package)."""
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imported(node: ast.AST, module: str, is_package: bool, known: set[str]) -> set[str]:
    """Project modules that one import statement names (``from a import b`` names ``a.b`` when that
    is a module, else ``a``; relative imports resolved against ``module``)."""
    if isinstance(node, ast.Import):
        names = [alias.name for alias in node.names]
    else:
        base = node.module or ""
        if node.level:
            anchor = module.split(".") if is_package else module.split(".")[:-1]
            anchor = anchor[: len(anchor) - (node.level - 1)]
            base = ".".join([*anchor, base] if base else anchor)
        names = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base for alias in node.names]
    out = set()
    for name in names:
        while name and name not in known:  # import a.b.c of a module a.b: the edge goes to a.b
            name = name.rpartition(".")[0]
        if name:
            out.add(name)
    return out


def import_graph(root: pathlib.Path = ROOT, packages=PACKAGES) -> dict[str, set[str]]:
    """module → the project modules it imports anywhere in its body (module level or inside
    functions and classes); ``TYPE_CHECKING`` blocks count too."""
    files = module_files(root, packages)
    known = {module_name(p, root) for p in files}
    graph: dict[str, set[str]] = {}
    for path in files:
        name = module_name(path, root)
        tree = ast.parse(path.read_text(), str(path))
        edges: set[str] = set()
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                edges |= _imported(node, name, path.name == "__init__.py", known)
        edges.discard(name)
        graph[name] = edges
    return graph


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
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
                cycles.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(cycles)


def is_leaf(module: str, leaves=LEAVES) -> bool:
    """Whether ``module`` matches one of the ``leaves`` patterns."""
    return any(fnmatch.fnmatchcase(module, pattern) for pattern in leaves)


def unit_of(module: str, units=UNITS, leaves=LEAVES) -> str | None:
    """The package-graph node of ``module``: the longest of ``units`` that is ``module`` or a package
    above it, with `` (leaves)`` added for a leaf; None outside every unit."""
    unit = max((u for u in units if module == u or module.startswith(u + ".")), key=len, default=None)
    return None if unit is None else unit + " (leaves)" if is_leaf(module, leaves) else unit


def package_graph(graph: dict[str, set[str]], units=UNITS, leaves=LEAVES) -> dict[str, dict[str, set[tuple[str, str]]]]:
    """Package → package it imports → the module imports that draw that edge, ``(importer, imported)``;
    ``graph`` from :func:`import_graph` (so function-level imports count). Imports inside one
    package, and of modules outside every unit, are left out."""
    out: dict[str, dict[str, set[tuple[str, str]]]] = {}
    for module, deps in graph.items():
        a = unit_of(module, units, leaves)
        if a is None:
            continue
        out.setdefault(a, {})
        for dep in deps:
            b = unit_of(dep, units, leaves)
            if b is not None and b != a:
                out[a].setdefault(b, set()).add((module, dep))
    return out


def package_cycles(packages: dict[str, dict[str, set[tuple[str, str]]]]) -> list[tuple[list[str], list[str]]]:
    """The circles of :func:`package_graph`: per strongly connected component of more than one
    package, ``(its packages sorted, one line per edge between them: "a -> b: importer -> imported, ...")``."""
    out = []
    for cycle in import_cycles({a: set(bs) for a, bs in packages.items()}):
        lines = [f"{a} -> {b}: " + ", ".join(f"{m} -> {d}" for m, d in sorted(packages[a][b]))
                 for a in cycle for b in sorted(packages[a]) if b in cycle]
        out.append((cycle, lines))
    return out


def line_counts(root: pathlib.Path = ROOT, packages=PACKAGES) -> dict[str, int]:
    """Relative path → number of lines, for every module of ``packages``."""
    return {p.relative_to(root).as_posix(): len(p.read_text().splitlines()) for p in module_files(root, packages)}
