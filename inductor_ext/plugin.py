"""``enable()``: installs the plugin into torch.compile / Inductor.

The ops register themselves with ``torch.library`` on import; ``enable()`` adds what must touch
Inductor's global state, and only when the user asks: the decompositions of :mod:`lowerings` into
Inductor's table (so the cheap ops fuse), an ``InductorChoices`` that keeps reductions of one FP8
QDQ group (128 elements) persistent and launches them with a fixed, measured tile
(:func:`lowerings._compat.install_persistent_reductions`), the settings under which Inductor keeps the
eager graph's rounding points (:data:`lowerings._compat.EAGER_NUMERICS`, ``docs/DESIGN.md`` §10: every
graph compiled in the process), and a post-grad ``CustomGraphPass`` whose
``uuid()`` hashes the package version and the source files that change compiled code (:data:`SALTED`:
op definitions and kernels, fakes, lowerings, the config and its field checks, the back-end choice, the
workspace plan), so Inductor's caches never reuse an artifact compiled by another version of them. Benchmarks,
reports, the command line and ``graphs`` are not hashed: traced Python code is part of the graph
itself, and tooling never reaches compiled code. The precision is a literal in the graph and
already part of every cache key.
"""

from __future__ import annotations

import functools
import hashlib
import pathlib

import torch

from lowerings._compat import CustomGraphPass, inductor_config

__all__ = ["enable", "is_enabled", "hash_sources", "salted_files", "source_hash", "GLM53GraphPass", "SALTED"]

# what the cache salt hashes, relative to the repository root: folders (every .py below) and files
SALTED = (
    "inductor_ext/ops",
    "inductor_ext/kernels",
    "fake_impls",
    "lowerings",
    "inductor_ext/config.py",
    "inductor_ext/validation.py",  # the config's field rules (they normalize its values)
    "inductor_ext/plugin.py",
    "inductor_ext/_version.py",
    "inductor_ext/backends.py",
    "inductor_ext/workspace.py",
)
_ROOT = pathlib.Path(__file__).resolve().parent.parent


def salted_files(root: pathlib.Path = _ROOT) -> list[pathlib.Path]:
    """The ``.py`` files :func:`source_hash` covers (:data:`SALTED` below ``root``), sorted."""
    files = []
    for entry in SALTED:
        path = root / entry
        files.extend(path.rglob("*.py") if path.is_dir() else [path])
    return sorted(files)


def hash_sources(root: pathlib.Path = _ROOT) -> str:
    """SHA-256 over the package version and the relative path and bytes of each of
    :func:`salted_files` below ``root``."""
    from inductor_ext._version import __version__

    hasher = hashlib.sha256(__version__.encode())
    for path in salted_files(root):
        hasher.update(path.relative_to(root).as_posix().encode() + b"\0")
        hasher.update(path.read_bytes())
    return hasher.hexdigest()


@functools.cache
def source_hash() -> str:
    """:func:`hash_sources` of the installed plugin, computed once per process."""
    return hash_sources()


class GLM53GraphPass(CustomGraphPass):
    """Post-grad pass slot of the plugin. It rewrites nothing yet; it runs any pass that was
    installed before ``enable()`` and salts Inductor's cache key with :func:`source_hash`."""

    def __init__(self, inner=None) -> None:
        self.inner = inner

    def __call__(self, graph: torch.fx.Graph) -> None:
        if self.inner is not None:
            self.inner(graph)

    def uuid(self):
        """Cache-key salt: the plugin's source hash and the wrapped pass's uuid."""
        inner = None if self.inner is None else self.inner.uuid()
        return ("glm53-inductor", source_hash(), inner)


def is_enabled() -> bool:
    """Whether :func:`enable` has installed the plugin's graph pass."""
    return isinstance(inductor_config.post_grad_custom_post_pass, GLM53GraphPass)


def enable() -> None:
    """Install the plugin into Inductor; idempotent. Call once before ``torch.compile``."""
    import inductor_ext.ops  # noqa: F401  (defines the ops and their fakes)
    import lowerings

    lowerings.register_all()  # idempotent: Inductor-only decompositions of the fusible ops
    if is_enabled():
        return
    current = inductor_config.post_grad_custom_post_pass
    if current is not None and not isinstance(current, CustomGraphPass):
        raise ValueError(
            "torch._inductor.config.post_grad_custom_post_pass holds a plain callable; Inductor can "
            "cache it only as a CustomGraphPass with a uuid(). Wrap it before calling enable()."
        )
    inductor_config.post_grad_custom_post_pass = GLM53GraphPass(current)
