"""Fetch the serving engine's Triton kernel modules that the LMDeploy parity checks import, without
installing LMDeploy (its wheel pins torch).

    python scripts/fetch_lmdeploy_kernels.py            # downloads lmdeploy==0.18.0, writes .lmdeploy/
    PYTHONPATH=$PWD/.lmdeploy python -m pytest -s -m cuda tests/kernels/test_serving_kernels_cuda.py
    PYTHONPATH=$PWD/.lmdeploy python -m inductor_ext bench moe

Users: ``tests/kernels/test_serving_kernels_cuda.py`` and ``inductor_ext/bench/moe.py`` import

- ``lmdeploy.pytorch.kernels.cuda.blocked_gemm_fp8`` (``quant_fp8``) and
- ``lmdeploy.pytorch.kernels.cuda.moe.v4_swiglu_quant`` (``v4_swiglu_and_quant_fp8``).

The script runs ``pip download lmdeploy==VERSION --no-deps --only-binary=:all:`` into a temporary
folder (for this interpreter's tags; if the index has no wheel for them, for CPython 3.12
manylinux_2_28 x86_64: the kernel modules are pure Python, the same in every wheel), or takes a wheel
given with ``--wheel``. From it, it extracts those two modules and the modules they import at module
level inside the ``lmdeploy`` package, found by reading their imports (today ``.utils`` and, through
``v4_swiglu_quant``, ``.activation``), byte for byte. Two kinds of file are not the wheel's:

- every package ``__init__.py`` on the way is written empty: the real ones import the whole engine
  (``lmdeploy/__init__.py`` the pipeline and the API server, ``kernels/cuda/__init__.py`` every
  kernel family);
- ``lmdeploy/utils.py``, which ``blocked_gemm_fp8`` imports for ``get_logger`` only, is a shim that
  returns ``logging.getLogger(name)`` (the real module imports transformers at load time).

The tree also gets the wheel's LICENSE, a ``MANIFEST.txt`` (the wheel's name and SHA-256, each file's
SHA-256 and origin) and nothing else. The modules need ``torch`` and ``triton`` at import time
(``pip install 'triton==3.6.*'``; the ``cuda`` extra has it). A GPU machine without network gets the
folder carried in (it is git-ignored), or the wheel carried in and ``--wheel PATH``.
``--check`` imports both modules in a fresh interpreter with ``PYTHONPATH`` set to the result.
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
import zipfile

ROOT = pathlib.Path(__file__).resolve().parents[1]
VERSION = "0.18.0"
MODULES = ("lmdeploy.pytorch.kernels.cuda.blocked_gemm_fp8", "lmdeploy.pytorch.kernels.cuda.moe.v4_swiglu_quant")
FALLBACK_TAGS = ["--python-version", "3.12", "--implementation", "cp", "--abi", "cp312",
                 "--platform", "manylinux_2_28_x86_64"]
SHIMS = {
    "lmdeploy.utils": (
        '"""Shim written by scripts/fetch_lmdeploy_kernels.py: the kernel modules import get_logger only;\n'
        'the real lmdeploy/utils.py imports transformers at load time."""\n\n'
        "import logging\n\n\n"
        "def get_logger(name=None, *args, **kwargs):\n"
        "    return logging.getLogger(name)\n"
    ),
}
EMPTY_INIT = "# written empty by scripts/fetch_lmdeploy_kernels.py: the wheel's __init__ imports the whole engine\n"


def download(version: str, dest: pathlib.Path) -> pathlib.Path:
    """The lmdeploy wheel from the package index, for this interpreter's tags or else CPython 3.12."""
    base = [sys.executable, "-m", "pip", "download", f"lmdeploy=={version}", "--no-deps", "--only-binary=:all:",
            "-d", str(dest)]
    for extra in ([], FALLBACK_TAGS):
        run = subprocess.run(base + extra, capture_output=True, text=True)
        wheels = sorted(dest.glob(f"lmdeploy-{version}-*.whl"))
        if run.returncode == 0 and wheels:
            return wheels[0]
        print(f"pip download {' '.join(extra) or '(this interpreter)'} failed:\n{run.stderr.strip()[-800:]}",
              file=sys.stderr)
    raise SystemExit(f"no lmdeploy=={version} wheel could be downloaded")


def module_path(name: str, files: set[str]) -> str:
    """The wheel path of module ``name`` (a module file or a package's __init__)."""
    rel = name.replace(".", "/")
    for path in (rel + ".py", rel + "/__init__.py"):
        if path in files:
            return path
    raise SystemExit(f"{name} is not in the wheel")


def top_level_imports(source: str, name: str, is_package: bool) -> set[str]:
    """Modules of the ``lmdeploy`` package that ``source`` (module ``name``) imports at module level;
    imports inside functions run only on other code paths and are left out."""
    package = name if is_package else name.rpartition(".")[0]
    found = set()
    for node in ast.parse(source).body:
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            found.add(mod)
            found.update(f"{mod}.{alias.name}" for alias in node.names)  # `from pkg import submodule`
    return {m for m in found if m == "lmdeploy" or m.startswith("lmdeploy.")}


def closure(wheel: zipfile.ZipFile) -> dict[str, str]:
    """Module name -> wheel path for MODULES and their module-level in-package imports (shims excluded)."""
    files = set(wheel.namelist())
    todo, seen = list(MODULES), {}
    while todo:
        name = todo.pop()
        if name in seen or name in SHIMS:
            continue
        rel = name.replace(".", "/")
        if rel + ".py" not in files and rel + "/__init__.py" not in files:
            continue  # `from pkg import attribute`: not a module
        path = module_path(name, files)
        is_package = path.endswith("__init__.py")
        if is_package and name not in MODULES:
            seen[name] = path  # package __init__: written empty, its imports not followed
            continue
        seen[name] = path
        todo.extend(top_level_imports(wheel.read(path).decode(), name, is_package))
    return seen


def extract(wheel_path: pathlib.Path, dest: pathlib.Path) -> list[str]:
    """Write the minimal package tree into ``dest``; returns the manifest's lines."""
    sha = hashlib.sha256(wheel_path.read_bytes()).hexdigest()
    manifest = [f"wheel {wheel_path.name} sha256 {sha}", ""]
    with zipfile.ZipFile(wheel_path) as wheel:
        modules = closure(wheel)
        if dest.exists():
            shutil.rmtree(dest)
        written: dict[str, tuple[bytes, str]] = {}
        for name, path in sorted(modules.items()):
            if path.endswith("__init__.py") and name not in MODULES:
                continue
            written[path] = (wheel.read(path), "from the wheel")
        for name, text in SHIMS.items():
            written[name.replace(".", "/") + ".py"] = (text.encode(), "shim (get_logger only)")
        for path in list(written):  # every package on the way needs an __init__.py
            parts = path.split("/")[:-1]
            for i in range(1, len(parts) + 1):
                init = "/".join(parts[:i]) + "/__init__.py"
                written.setdefault(init, (EMPTY_INIT.encode(), "written empty"))
        licence = [n for n in wheel.namelist() if n.endswith(".dist-info/licenses/LICENSE")]
        if licence:
            written["LICENSE"] = (wheel.read(licence[0]), "the wheel's licence")
    for path, (data, origin) in sorted(written.items()):
        out = dest / path
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_bytes(data)
        manifest.append(f"{hashlib.sha256(data).hexdigest()}  {path}  ({origin})")
    (dest / "MANIFEST.txt").write_text("\n".join(manifest) + "\n")
    return manifest


def check(dest: pathlib.Path) -> bool:
    """Import MODULES in a fresh interpreter with ``dest`` first on PYTHONPATH."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(dest), os.environ.get("PYTHONPATH")])))
    code = "import importlib\n" + "".join(f"m = importlib.import_module({m!r}); print('imported', m.__name__, "
                                          f"'from', m.__file__)\n" for m in MODULES)
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, cwd=dest.parent)
    print(run.stdout.strip() or run.stderr.strip()[-2000:])
    return run.returncode == 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--version", default=VERSION, help=f"LMDeploy version (default {VERSION})")
    parser.add_argument("--dest", type=pathlib.Path, default=ROOT / ".lmdeploy", help="output folder (replaced)")
    parser.add_argument("--wheel", type=pathlib.Path, help="use this lmdeploy wheel instead of downloading one")
    parser.add_argument("--check", action="store_true", help="import the modules afterwards (needs torch, triton)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        wheel = args.wheel or download(args.version, pathlib.Path(tmp))
        manifest = extract(wheel, args.dest.resolve())
    print(f"wrote {args.dest}:", *manifest, sep="\n  ")
    print(f"use: PYTHONPATH={args.dest.resolve()} python -m pytest -s -m cuda "
          "tests/kernels/test_serving_kernels_cuda.py")
    if args.check and not check(args.dest.resolve()):
        raise SystemExit("the extracted modules do not import (see above)")


if __name__ == "__main__":
    main()
