"""The back-end registry: which implementation runs an op's CUDA kernel.

A *package* is an optional dependency (:data:`PACKAGES`; ``pip install glm53-inductor[cuda]`` etc.),
detected by importing it once. A *back-end* (:class:`Backend`) is one implementation of an op's CUDA
kernel (e.g. ``glm53::sparse_mla``: ``tilelang``, ``triton``, ``reference``): ``available()`` says
whether every package it needs imports (cached), ``supports(**args)`` whether it handles a call,
``(ok, reason)``, from the call's static arguments only (shapes, dtypes, devices, the int, float
and string arguments; never tensor data).

:func:`register` stores an op's back-ends in :data:`REGISTRY` in preference order (one order, or one
per value of a string argument of the op) and registers the op's CUDA kernel, which runs the first
back-end that is available and supports the call (:func:`select`). Every back-end passed over on the
way is logged once per (op, back-end, reason) through the ``inductor_ext`` logger, with the one
taken. Each order ends with an unconditional back-end (the op's plain-torch reference), so a call
always finds one. Selection happens where the op's CUDA kernel runs, opaque to Dynamo and Inductor:
it reads no tensor data and never synchronises with the host.
"""

from __future__ import annotations

import functools
import importlib
import logging
from collections.abc import Callable, Mapping, Sequence

import torch

__all__ = ["PACKAGES", "REGISTRY", "Backend", "OpBackends", "available", "reference", "register", "register_triton",
           "select", "triton", "version"]

log = logging.getLogger("inductor_ext")

# package name -> module imported to detect it
PACKAGES = {
    "triton": "triton",
    "fla": "fla.ops.kda.chunk_fwd",
    "tilelang": "tilelang",
    "lmdeploy": "lmdeploy",
}
_DISTRIBUTIONS = {"triton": "triton", "fla": "fla-core", "tilelang": "tilelang", "lmdeploy": "lmdeploy"}


@functools.cache
def _import(package: str):
    try:
        return importlib.import_module(PACKAGES[package]), None
    except Exception as exc:  # ImportError, or a broken install raising at import
        return None, f"{type(exc).__name__}: {exc}"


def _known(package: str) -> None:
    if package not in PACKAGES:
        raise ValueError(f"unknown package {package!r}; known: {sorted(PACKAGES)}")


def available(package: str) -> bool:
    """Whether optional package ``package`` (a key of :data:`PACKAGES`) imports."""
    _known(package)
    return _import(package)[0] is not None


def version(package: str) -> str | None:
    """Installed distribution version of optional package ``package``, or ``None``."""
    from importlib import metadata

    try:
        return metadata.version(_DISTRIBUTIONS[package])
    except metadata.PackageNotFoundError:
        return None


class Backend:
    """One implementation of an op's CUDA kernel.

    Args:
        name: short name in logs and tests (``"tilelang"``, ``"triton"``, ``"fla"``, ``"reference"``).
        label: what it is, for a reader of the log (``"the TileLang kernels"``).
        load: zero-argument loader of the kernel (imports it), called once, on first use; the kernel
            takes the op's arguments.
        packages: the optional packages it needs (keys of :data:`PACKAGES`).
        why_not: called with the op's arguments by name: ``None`` when the back-end handles the
            call, else the reason it does not, a sentence a user can read. Static properties only.
    """

    def __init__(self, name: str, label: str, load: Callable[[], Callable], *, packages: Sequence[str] = (),
                 why_not: Callable[..., str | None] | None = None):
        for package in packages:
            _known(package)
        self.name, self.label, self.packages = name, label, tuple(packages)
        self._load, self._why_not, self._kernel = load, why_not, None

    def __repr__(self) -> str:
        return f"Backend({self.name!r}, {self.label!r})"

    @property
    def unconditional(self) -> bool:
        """Needs no package and handles every call."""
        return not self.packages and self._why_not is None

    def missing(self) -> str | None:
        """Why the back-end is unavailable (the first of its packages that does not import), or ``None``."""
        for package in self.packages:
            module, error = _import(package)
            if module is None:
                return f"{package} does not import ({error}); install it: pip install {_DISTRIBUTIONS[package]}"
        return None

    def available(self) -> bool:
        """Whether every package it needs imports (each import tried once per process)."""
        return self.missing() is None

    def supports(self, **args) -> tuple[bool, str]:
        """``(True, "")``, or ``(False, reason)`` when the back-end does not handle a call with these arguments."""
        reason = None if self._why_not is None else self._why_not(**args)
        return reason is None, reason or ""

    def kernel(self) -> Callable:
        """The loaded kernel (loaded on the first call)."""
        if self._kernel is None:
            self._kernel = self._load()
        return self._kernel


def reference(kernel: Callable, label: str = "the plain-torch reference kernel") -> Backend:
    """The op's plain-torch kernel as its unconditional last back-end, ``"reference"``."""
    return Backend("reference", label, lambda: kernel)


def triton(load: Callable[[], Callable], label: str = "the Triton kernel", why_not=None) -> Backend:
    """The project's own Triton kernel, ``"triton"`` (needs the ``triton`` package)."""
    return Backend("triton", label, load, packages=("triton",), why_not=why_not)


_LOGGED: set[tuple[str, str, str]] = set()  # (op, back-end, reason) already logged


def _log_skip(op_name: str, skipped: Backend, reason: str, taken: Backend) -> None:
    key = (op_name, skipped.name, reason)
    if key not in _LOGGED:
        _LOGGED.add(key)
        log.warning("%s: back-end %r (%s) skipped: %s; using %r (%s)", op_name, skipped.name, skipped.label, reason,
                    taken.name, taken.label)


class OpBackends:
    """One op's back-ends in preference order: ``preference`` is a sequence of :class:`Backend`, or
    with ``by`` (the name of a string argument of the op) a mapping from that argument's value to one.
    ``params`` are the op's argument names, in schema order."""

    def __init__(self, op_name: str, params: Sequence[str], preference, by: str | None = None):
        orders = {None: tuple(preference)} if by is None else {k: tuple(v) for k, v in preference.items()}
        if by is not None and by not in params:
            raise ValueError(f"{op_name}: by={by!r} is not an argument of the op {tuple(params)}")
        for key, order in orders.items():
            if not order or not order[-1].unconditional:
                raise ValueError(f"{op_name}: the back-ends {order} (for {by}={key!r}) must end with an "
                                 "unconditional one (the reference)")
        self.op_name, self.params, self.by, self._orders = op_name, tuple(params), by, orders

    def order(self, **args) -> tuple[Backend, ...]:
        """The preference order for a call with these arguments."""
        return self._orders[None if self.by is None else args[self.by]]

    def select(self, **args) -> Backend:
        """The first back-end that is available and supports the call; those passed over are logged once."""
        skipped = []
        for backend in self.order(**args):
            reason = backend.missing()
            if reason is None:
                ok, reason = backend.supports(**args)
                if ok:
                    for other, why in skipped:
                        _log_skip(self.op_name, other, why, backend)
                    return backend
            skipped.append((backend, reason))
        raise AssertionError("unreachable: every order ends with an unconditional back-end")

    def run(self, *args, **kwargs):
        """The op's CUDA kernel: :meth:`select`, then the chosen back-end's kernel on the arguments."""
        named = dict(zip(self.params, args))
        named.update(kwargs)
        return self.select(**named).kernel()(*args, **kwargs)


REGISTRY: dict[str, OpBackends] = {}  # op name ("glm53::sparse_mla") -> its back-ends


def register(op_name: str, preference: Sequence[Backend] | Mapping[str, Sequence[Backend]], *,
             by: str | None = None) -> OpBackends:
    """Store ``op_name``'s back-ends (see :class:`OpBackends`) and register its CUDA kernel
    (:meth:`OpBackends.run`). The op must exist (``torch.library.custom_op``)."""
    namespace, name = op_name.split("::")
    schema = getattr(getattr(torch.ops, namespace), name).default._schema
    entry = OpBackends(op_name, [arg.name for arg in schema.arguments], preference, by)
    REGISTRY[op_name] = entry
    # one device type per registration: torch 2.13's custom_op binds every device type of one call
    # to the last one's kernel
    torch.library.register_kernel(op_name, "cuda", entry.run)
    return entry


def register_triton(op_name: str, load: Callable[[], Callable], reference_kernel: Callable,
                    fallback: str = "the plain-torch reference kernel") -> OpBackends:
    """:func:`register` for an op with one Triton kernel: ``triton``, else ``reference`` (labelled ``fallback``)."""
    return register(op_name, (triton(load), reference(reference_kernel, fallback)))


def select(op_name: str, **args) -> Backend:
    """The back-end that ``op_name``'s CUDA kernel runs for a call with these arguments (by name)."""
    return REGISTRY[op_name].select(**args)
