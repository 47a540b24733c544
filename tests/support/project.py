"""Static views of the project's own source tree, for the layout rules of ``tests/plugin/test_layout.py``:
the import graph (module-level and function-level imports), its cycles, and module line counts."""

from __future__ import annotations

import ast
import pathlib

__all__ = ["ROOT", "PACKAGES", "module_files", "module_name", "import_graph", "import_cycles", "line_counts"]

ROOT = pathlib.Path(__file__).resolve().parents[2]
PACKAGES = ("inductor_ext", "lowerings", "fake_impls", "graphs", "tests")


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


def line_counts(root: pathlib.Path = ROOT, packages=PACKAGES) -> dict[str, int]:
    """Relative path → number of lines, for every module of ``packages``."""
    return {p.relative_to(root).as_posix(): len(p.read_text().splitlines()) for p in module_files(root, packages)}
