"""Optional kernel back-ends, detected at run time.

Each back-end is an optional dependency (``pip install glm53-inductor[cuda]`` etc.). When one is
missing, the op that wanted it takes its documented fallback and says so once through the
``inductor_ext`` logger; :func:`require` turns a missing back-end into a one-line error for callers
that asked for it explicitly.
"""

from __future__ import annotations

import functools
import importlib
import logging

__all__ = ["BACKENDS", "available", "load", "register_cuda_kernel", "register_cuda_router", "require", "version"]

log = logging.getLogger("inductor_ext")

# back-end name -> module to import
BACKENDS = {
    "triton": "triton",
    "fla": "fla.ops.kda.chunk_fwd",
    "tilelang": "tilelang",
    "deep_gemm": "deep_gemm",
    "lmdeploy": "lmdeploy",
}
_DISTRIBUTIONS = {"triton": "triton", "fla": "fla-core", "tilelang": "tilelang",
                  "deep_gemm": "deep-gemm", "lmdeploy": "lmdeploy"}


@functools.cache
def _import(name: str):
    try:
        return importlib.import_module(BACKENDS[name]), None
    except Exception as exc:  # ImportError, or a broken install raising at import
        return None, f"{type(exc).__name__}: {exc}"


def available(name: str) -> bool:
    """Whether back-end ``name`` (a key of :data:`BACKENDS`) imports."""
    if name not in BACKENDS:
        raise ValueError(f"unknown backend {name!r}; known: {sorted(BACKENDS)}")
    return _import(name)[0] is not None


@functools.cache
def _log_fallback(name: str, op: str, fallback: str, reason: str) -> None:
    log.warning("%s: backend %r unavailable (%s); using %s", op, name, reason, fallback)


def load(name: str, op: str, fallback: str):
    """The back-end's module, or ``None`` after logging (once per op) that ``op`` uses ``fallback``."""
    available(name)
    module, reason = _import(name)
    if module is None:
        _log_fallback(name, op, fallback, reason)
    return module


def register_cuda_kernel(op, op_name: str, backend: str, reference, fast, fallback: str) -> None:
    """Register ``op``'s CUDA kernel: ``fast()`` (a zero-argument loader of the back-end kernel,
    imported on first call) when ``backend`` imports, else ``reference`` after logging once that
    ``op_name`` uses ``fallback``."""
    register_cuda_router(op, op_name, lambda *args: (backend, fast), reference, fallback)


def register_cuda_router(op, op_name: str, route, reference, fallback: str) -> None:
    """Register ``op``'s CUDA kernel for an op whose back-end depends on its arguments:
    ``route(*args)`` returns ``(backend, loader)``; the loaded kernel runs when ``backend`` imports,
    else ``reference`` after logging once that ``op_name`` uses ``fallback``."""

    def kernel(*args):
        backend, loader = route(*args)
        if load(backend, op_name, fallback=fallback) is None:
            return reference(*args)
        return loader()(*args)

    op.register_kernel("cuda")(kernel)


def require(name: str):
    """The back-end's module; ``ValueError`` saying what to install when it is missing."""
    available(name)
    module, reason = _import(name)
    if module is None:
        raise ValueError(f"backend {name!r} is not usable ({reason}); "
                         f"install it: pip install {_DISTRIBUTIONS[name]}")
    return module


def version(name: str) -> str | None:
    """Installed distribution version of back-end ``name``, or ``None``."""
    from importlib import metadata

    try:
        return metadata.version(_DISTRIBUTIONS[name])
    except metadata.PackageNotFoundError:
        return None
