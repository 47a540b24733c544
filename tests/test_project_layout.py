"""Rules of the project's layout (docs/DESIGN.md, "Layout" and "Rules"): no import circles among the
project's modules nor among its packages (the leaves importing only leaves, the fakes and kernels
only leaves), no module over 500 lines outside ``tests/``, no test module importing another,
a cache salt that covers exactly the files that change compiled code, and the README's usage
snippet running as written. Each checker is also run on a small planted tree, so it is seen to fail."""

import pathlib
import re
import shutil
import textwrap

import pytest

from inductor_ext import plugin
from tests.support.project import (
    LEAVES,
    LIBRARY,
    ROOT,
    import_cycles,
    import_graph,
    is_leaf,
    line_counts,
    module_name,
    package_cycles,
    package_graph,
)

MAX_LINES = 500


def _tree(tmp_path: pathlib.Path, files: dict[str, str]) -> pathlib.Path:
    for rel, text in files.items():
        path = tmp_path / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
    return tmp_path


# ---------------------------------------------------------------------------------------------
# import circles
# ---------------------------------------------------------------------------------------------


def test_no_import_circles():
    cycles = import_cycles(import_graph())
    assert not cycles, "import circles (module-level and function-level imports):\n" + "\n".join(
        " <-> ".join(c) for c in cycles)


@pytest.mark.parametrize("package", ["fake_impls", "lowerings", "graphs", "inductor_ext", "inductor_ext.ops",
                                     "inductor_ext.parallel", "inductor_ext.bench", "inductor_ext.report"])
def test_every_package_imports_first_in_a_fresh_process(package):
    """Whatever is imported first, the ops and their fakes end up registered (a fake kernel runs)."""
    import subprocess
    import sys

    code = (f"import {package}, torch, inductor_ext.ops\n"
            "from torch._subclasses.fake_tensor import FakeTensorMode\n"
            "with FakeTensorMode():\n"
            "    x = torch.empty(4, 8)\n"
            "    assert torch.ops.glm53.swiglu(x, x, 10.0, 'native').shape == (4, 8)\n")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_circle_checker_finds_a_function_level_circle(tmp_path):
    root = _tree(tmp_path, {
        "pkg/__init__.py": "",
        "pkg/a.py": "from pkg import b\n",
        "pkg/b.py": "def f():\n    from pkg.c import g\n    return g\n",
        "pkg/c.py": "import pkg.a\n",
        "pkg/leaf.py": "import torch\nfrom pkg import a\n",
    })
    assert import_cycles(import_graph(root, ("pkg",))) == [["pkg.a", "pkg.b", "pkg.c"]]


def test_circle_checker_resolves_relative_and_attribute_imports(tmp_path):
    root = _tree(tmp_path, {
        "pkg/__init__.py": "from .sub import x\n",
        "pkg/sub/__init__.py": "x = 1\n",
        "pkg/sub/m.py": "from .. import sub\nfrom pkg.sub import x\n",
    })
    graph = import_graph(root, ("pkg",))
    assert graph["pkg"] == {"pkg.sub"} and graph["pkg.sub.m"] == {"pkg.sub"}
    assert import_cycles(graph) == []


# ---------------------------------------------------------------------------------------------
# package circles: the floors
# ---------------------------------------------------------------------------------------------


def _package_circles(graph: dict[str, set[str]], **kw) -> str:
    return "\n".join(" <-> ".join(packages) + "\n" + "\n".join("    " + line for line in lines)
                     for packages, lines in package_cycles(package_graph(graph, **kw)))


def test_no_package_circles():
    """Every import runs down the floors of DESIGN §2: the package graph (leaves a node of their own
    below their package, function-level imports counted) has no circle."""
    circles = _package_circles(import_graph(ROOT, LIBRARY))
    assert not circles, "package circles (each with the imports between its packages):\n" + circles


def test_package_checker_finds_a_package_circle(tmp_path):
    """No module circle, but the packages ``pkg.low`` and ``pkg.high`` import each other (one of
    the imports inside a function); an import of a leaf does not close a circle."""
    root = _tree(tmp_path, {
        "pkg/__init__.py": "",
        "pkg/leaf.py": "X = 1\n",
        "pkg/low/__init__.py": "",
        "pkg/low/a.py": "from pkg import leaf\n",
        "pkg/low/b.py": "def f():\n    from pkg.high.c import g\n    return g\n",
        "pkg/high/__init__.py": "",
        "pkg/high/c.py": "from pkg.low import a\nfrom pkg import leaf\ndef g():\n    pass\n",
        "pkg/high/d.py": "import pkg.leaf\n",
    })
    graph = import_graph(root, ("pkg",))
    units = ("pkg", "pkg.low", "pkg.high")
    assert import_cycles(graph) == []
    assert _package_circles(graph, units=units, leaves=("pkg.leaf",)) == (
        "pkg.high <-> pkg.low\n    pkg.high -> pkg.low: pkg.high.c -> pkg.low.a\n"
        "    pkg.low -> pkg.high: pkg.low.b -> pkg.high.c")
    graph["pkg.low.b"] = set()  # the function-level import gone, the packages run one way
    assert _package_circles(graph, units=units, leaves=("pkg.leaf",)) == ""
    assert package_graph(graph, units=units, leaves=("pkg.leaf",))["pkg.high"] == {
        "pkg.low": {("pkg.high.c", "pkg.low.a")}, "pkg (leaves)": {("pkg.high.c", "pkg.leaf"), ("pkg.high.d", "pkg.leaf")}}


def _outside(graph: dict[str, set[str]], importers, allowed) -> dict[str, set[str]]:
    """Modules matching ``importers`` → what they import that ``allowed`` rejects."""
    return {m: bad for m, deps in graph.items() if importers(m) and (bad := {d for d in deps if not allowed(m, d)})}


def _leaves_importing_non_leaves(graph, leaves=LEAVES):
    return _outside(graph, lambda m: is_leaf(m, leaves), lambda m, d: is_leaf(d, leaves))


def test_leaves_import_only_leaves():
    graph = import_graph(ROOT, LIBRARY)
    assert not _leaves_importing_non_leaves(graph), "leaves importing non-leaves: move what they need into a leaf"
    stale = [p for p in LEAVES if not any(is_leaf(m, (p,)) for m in graph)]
    assert not stale, f"leaf patterns naming no module: {stale}"


def test_fakes_and_kernels_import_only_leaves():
    """DESIGN §2: the fake kernels and the GPU kernels import leaves (and their own package), never
    an op module; a fake needing something of an op finds it in the family's leaf."""
    graph = import_graph(ROOT, LIBRARY)
    for pkg in ("fake_impls", "inductor_ext.kernels"):
        inside = lambda m, pkg=pkg: m == pkg or m.startswith(pkg + ".")  # noqa: E731
        bad = _outside(graph, inside, lambda m, d, inside=inside: inside(d) or is_leaf(d))
        assert not bad, f"{pkg} importing modules that are not leaves: {bad}"


def test_leaf_checker_flags_a_leaf_importing_an_op(tmp_path):
    root = _tree(tmp_path, {"pkg/__init__.py": "", "pkg/config.py": "", "pkg/op.py": "",
                            "pkg/x_reference.py": "from pkg import config\ndef f():\n    from pkg.op import g\n"})
    graph = import_graph(root, ("pkg",))
    assert _leaves_importing_non_leaves(graph, ("pkg.config", "pkg.*_reference")) == {"pkg.x_reference": {"pkg.op"}}


# ---------------------------------------------------------------------------------------------
# module size
# ---------------------------------------------------------------------------------------------


def _oversized(counts: dict[str, int]) -> dict[str, int]:
    return {path: n for path, n in counts.items() if n > MAX_LINES and not path.startswith("tests/")}


def test_no_module_over_500_lines_outside_tests():
    big = _oversized(line_counts())
    assert not big, f"modules over {MAX_LINES} lines (split them by job): {big}"


def test_size_checker_flags_a_long_module(tmp_path):
    root = _tree(tmp_path, {"pkg/__init__.py": "", "pkg/long.py": "x = 1\n" * (MAX_LINES + 1),
                            "tests/test_long.py": "x = 1\n" * (MAX_LINES + 1)})
    assert _oversized(line_counts(root, ("pkg", "tests"))) == {"pkg/long.py": MAX_LINES + 1}


# ---------------------------------------------------------------------------------------------
# test modules import helpers only
# ---------------------------------------------------------------------------------------------


def _test_module_imports(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    is_test = lambda m: m.rpartition(".")[2].startswith("test_")  # noqa: E731
    return {m: {d for d in deps if is_test(d)} for m, deps in graph.items()
            if m.startswith("tests") and any(is_test(d) for d in deps - {m})}


def test_no_test_module_imports_another():
    bad = _test_module_imports(import_graph())
    assert not bad, f"test modules importing test modules (move shared helpers to tests/support/): {bad}"


def test_test_import_checker_flags_one(tmp_path):
    root = _tree(tmp_path, {"tests/__init__.py": "", "tests/test_a.py": "from tests.test_b import h\n",
                            "tests/test_b.py": "def h():\n    pass\n", "tests/support.py": ""})
    assert _test_module_imports(import_graph(root, ("tests",))) == {"tests.test_a": {"tests.test_b"}}


# ---------------------------------------------------------------------------------------------
# the cache salt
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tree_copy(tmp_path_factory):
    dest = tmp_path_factory.mktemp("salt")
    for pkg in LIBRARY:
        shutil.copytree(ROOT / pkg, dest / pkg, ignore=shutil.ignore_patterns("__pycache__"))
    return dest


def _edit(path: pathlib.Path) -> None:
    path.write_text(path.read_text() + "\n# an edit\n")


def test_salt_of_the_installed_tree():
    assert plugin.source_hash() == plugin.hash_sources(ROOT) and len(plugin.source_hash()) == 64


@pytest.mark.parametrize("rel", ["inductor_ext/bench/kda.py", "inductor_ext/report/report.py", "graphs/model.py",
                                 "inductor_ext/__main__.py", "inductor_ext/report/cp_check.py"])
def test_editing_tooling_leaves_the_salt(tree_copy, rel):
    before = plugin.hash_sources(tree_copy)
    _edit(tree_copy / rel)
    assert plugin.hash_sources(tree_copy) == before, f"{rel} is not compiled code: it must not salt the cache"


@pytest.mark.parametrize("rel", ["lowerings/swiglu.py", "inductor_ext/ops/kda.py", "fake_impls/kpool.py",
                                 "inductor_ext/config.py", "inductor_ext/kernels/kpool/select.py",
                                 "inductor_ext/ops/fp8_qdq_reference.py"])
def test_editing_compiled_code_changes_the_salt(tree_copy, rel):
    before = plugin.hash_sources(tree_copy)
    _edit(tree_copy / rel)
    assert plugin.hash_sources(tree_copy) != before, f"{rel} changes compiled code: it must salt the cache"


def test_salt_covers_every_op_kernel_fake_and_lowering():
    salted = {module_name(p) for p in plugin.salted_files()}
    for pkg in ("inductor_ext.ops", "inductor_ext.kernels", "fake_impls", "lowerings"):
        assert any(m == pkg or m.startswith(pkg + ".") for m in salted), pkg
    assert not any(m.startswith(("inductor_ext.bench", "inductor_ext.report", "graphs")) for m in salted)


# ---------------------------------------------------------------------------------------------
# the README's usage snippet
# ---------------------------------------------------------------------------------------------


def test_readme_usage_snippet_runs():
    text = (ROOT / "README.md").read_text()
    snippet = re.search(r"## Use\n\n```python\n(.*?)```", text, re.S).group(1)
    import torch

    T, H, K = 64, 2, 32
    q, k, v = (torch.randn(1, T, H, K, dtype=torch.bfloat16) for _ in range(3))
    g = -torch.rand(1, T, H, K)
    beta = torch.rand(1, T, H, dtype=torch.bfloat16)
    # batches: the loop over packed lengths is compiled for real in tests/graphs/test_dynamic_shapes.py
    scope = {"q": q, "k": k, "v": v, "g": g, "beta": beta, "batches": []}
    exec(compile(snippet, "README.md", "exec"), scope)  # noqa: S102  (the documented surface, as written)
    assert scope["compiled"] is not None and scope["model"] is not None
