"""The one place that imports private ``torch._inductor`` names (a torch upgrade edits this file).

Checked against torch 2.11 and 2.13: both keep Inductor's decomposition table in
``torch._inductor.decomposition.decompositions`` and serve it through ``select_decomp_table()``,
which (unless ``fallback_random``) returns the ``functools.cache``-d merge
``fast_random_decomps()``. An entry added to the table after that merge was first built is
invisible until the cache is cleared, so :func:`register_inductor_decomposition` clears it.
Only ``compile_fx`` (the ``"inductor"`` backend) reads this table: ``eager`` and ``aot_eager``
never see these entries and keep running the ops' reference kernels.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch._inductor import config as inductor_config
from torch._inductor import decomposition as _inductor_decomposition
from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files
from torch._inductor.utils import run_and_get_code

__all__ = [
    "CustomGraphPass",
    "get_hash_for_files",
    "inductor_config",
    "inductor_decomposition",
    "register_inductor_decomposition",
    "run_and_get_code",
]


def _clear_merged_table() -> None:
    merged = getattr(_inductor_decomposition, "fast_random_decomps", None)
    if merged is not None and hasattr(merged, "cache_clear"):
        merged.cache_clear()


def register_inductor_decomposition(op: torch._ops.OpOverload, fn: Callable) -> None:
    """Make Inductor decompose ``op`` with ``fn`` while AOTAutograd traces (idempotent).

    ``fn`` receives the op's arguments (fake tensors) and returns outputs built from ATen ops.
    It must handle every call: Inductor asserts when an op with a decomposition reaches it
    undecomposed (``NotImplemented`` would fail at lowering, "both a fallback and a decomp").
    """
    if _inductor_decomposition.decompositions.get(op) is fn:
        return
    _inductor_decomposition.decompositions[op] = fn
    _clear_merged_table()


def inductor_decomposition(op: torch._ops.OpOverload) -> Callable | None:
    """The decomposition Inductor uses for ``op`` now (None when it has none)."""
    return _inductor_decomposition.select_decomp_table().get(op)
