"""``enable()``: installs the plugin into torch.compile / Inductor.

The ops register themselves with ``torch.library`` on import; ``enable()`` adds what must touch
Inductor's global state, and only when the user asks: the decompositions of :mod:`lowerings` into
Inductor's table (so the cheap ops fuse), an ``InductorChoices`` that keeps reductions of one FP8
QDQ group (128 elements) persistent and launches them with a fixed, measured tile
(:func:`lowerings._compat.install_persistent_reductions`), and a post-grad ``CustomGraphPass`` whose
``uuid()`` hashes this package's version and source files, so Inductor's caches never reuse an
artifact compiled by another version of the plugin (the precision itself is a literal in the graph
and already part of every cache key).
"""

from __future__ import annotations

import functools
import hashlib
import pathlib

import torch

from lowerings._compat import CustomGraphPass, get_hash_for_files, inductor_config

__all__ = ["enable", "is_enabled", "source_hash", "GLM53GraphPass"]

_PACKAGES = ("inductor_ext", "lowerings", "fake_impls", "graphs")


@functools.cache
def source_hash() -> str:
    """SHA-256 over the plugin's version and every ``.py`` file of its four packages."""
    from inductor_ext import __version__

    root = pathlib.Path(__file__).resolve().parent.parent
    files = sorted(str(p) for pkg in _PACKAGES for p in (root / pkg).rglob("*.py"))
    return hashlib.sha256(get_hash_for_files(tuple(files), extra=__version__)).hexdigest()


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
