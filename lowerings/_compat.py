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
    "cudagraph_trees_recorded",
    "get_hash_for_files",
    "inductor_config",
    "inductor_decomposition",
    "register_inductor_decomposition",
    "register_rounding_lowering",
    "reset_cudagraph_trees",
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


def register_rounding_lowering(op: torch._ops.OpOverload) -> None:
    """Lower ``op(x: FP32, dtype) -> FP32`` (``glm53::round_to``) to a pointwise conversion to
    ``dtype`` and back, idempotent.

    ``ops.to_dtype(..., use_compute_types=False)`` is the store-type conversion (Triton
    ``x.to(tl.bfloat16)``, C++ ``c10::convert``): a real rounding. The default (compute types)
    maps BF16 to FP32 and would make it a no-op.
    """
    from torch._inductor.lowering import lowerings, make_pointwise, register_lowering
    from torch._inductor.virtualized import ops

    if op in lowerings:
        return

    def lower(x, dtype):
        def round_trip(v):
            narrow = ops.to_dtype(v, dtype, src_dtype=torch.float32, use_compute_types=False)
            return ops.to_dtype(narrow, torch.float32)

        return make_pointwise(round_trip, override_return_dtype=torch.float32)(x)

    register_lowering(op, type_promotion_kind=None)(lower)


def inductor_decomposition(op: torch._ops.OpOverload) -> Callable | None:
    """The decomposition Inductor uses for ``op`` now (None when it has none)."""
    return _inductor_decomposition.select_decomp_table().get(op)


def reset_cudagraph_trees() -> None:
    """Free every CUDA graph and memory pool that ``mode="reduce-overhead"`` recorded (no-op when
    none). ``torch._dynamo.reset()`` does this through the backends' ``reset()`` too; calling it
    directly keeps benchmarks from stacking pools whatever a torch version's reset covers."""
    from torch._inductor.cudagraph_trees import reset_cudagraph_trees as reset

    reset()


def cudagraph_trees_recorded(device_index: int) -> int | None:
    """How many CUDA graphs ``mode="reduce-overhead"`` (cudagraph trees) has recorded on the device
    since the last ``torch._dynamo.reset()``; ``None`` when this torch's internals differ.

    Walks ``torch._inductor.cudagraph_trees``' manager: ``roots`` and each node's ``children``
    (dicts of function id → recorded nodes; warm-up runs are not nodes): the same names in 2.13 and
    in older 2.x sources; guarded all the same.
    """
    try:
        from torch._inductor import cudagraph_trees

        manager = cudagraph_trees.get_manager(device_index, create_if_none_exists=False)
        if manager is None:
            return 0
        stack, count = [n for nodes in manager.roots.values() for n in nodes], 0
        while stack:
            node = stack.pop()
            count += 1
            stack.extend(child for nodes in node.children.values() for child in nodes)
        return count
    except Exception:  # noqa: BLE001  (a private structure: report unknown rather than fail a benchmark)
        return None
