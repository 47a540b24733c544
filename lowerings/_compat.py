"""The one place that imports private ``torch._inductor`` names (a torch upgrade edits this file).

Checked against torch 2.11 and 2.13: both keep Inductor's decomposition table in
``torch._inductor.decomposition.decompositions`` and serve it through ``select_decomp_table()``,
which (unless ``fallback_random``) returns the ``functools.cache``-d merge
``fast_random_decomps()``. An entry added to the table after that merge was first built is
invisible until the cache is cleared, so :func:`register_inductor_decomposition` clears it.
Only ``compile_fx`` (the ``"inductor"`` backend) reads this table: ``eager`` and ``aot_eager``
never see these entries and keep running the ops' reference kernels.

Heuristics go through ``InductorChoices`` (``torch._inductor.choices``), looked up per thread
through ``V.choices``; 2.13 builds each thread's instance from ``config.inductor_choices_class``
(a factory whose ``uuid()`` enters the cache key). On 2.11 the H200 run consulted
``InductorChoices.should_use_persistent_reduction`` for the FP8 QDQ kernel.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Callable

import torch
from torch._inductor import config as inductor_config
from torch._inductor import decomposition as _inductor_decomposition
from torch._inductor.custom_graph_pass import CustomGraphPass
from torch._inductor.utils import run_and_get_code

__all__ = [
    "CustomGraphPass",
    "cudagraph_trees_recorded",
    "inductor_config",
    "inductor_decomposition",
    "EAGER_NUMERICS",
    "drop_inductor_decomposition",
    "fallback_to_aten",
    "install_eager_gemms",
    "install_eager_numerics",
    "install_size_oblivious_shapes",
    "install_persistent_reductions",
    "lowering_batch_invariant_graph",
    "inductor_own_numerics",
    "plain_inductor_numerics",
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


_log = logging.getLogger(__name__)


EAGER_NUMERICS = {
    # keep every fp32 -> bf16/fp16 -> fp32 round trip of the graph inside fused kernels (Inductor
    # drops them by default); also turns off Triton's FMA contraction (enable_fp_fusion) and makes
    # Triton use the CUDA toolkit's libdevice, as ATen's kernels do
    "emulate_precision_casts": True,
    # FP32 x / y as IEEE division (Triton: div_rn; its default is the approximate div.full)
    "eager_numerics.division_rounding": True,
    # no flush of FP32 denormals to zero in Triton kernels (ATen's CUDA kernels keep them)
    "eager_numerics.disable_ftz": True,
    # the C++ backend compiles with -ffp-contract=off: no multiply-add contracted into an FMA
    "cpp.enable_floating_point_contract_flag": "off",
}
"""Inductor settings under which a fused kernel rounds where the eager graph rounds (``enable()``
installs them; each is an Inductor config entry, so part of every FX-graph cache key: a changed
setting recompiles). ``docs/DESIGN.md`` §10 states what they guarantee and what they cost."""


@functools.cache
def install_eager_numerics() -> tuple[str, ...]:
    """Set :data:`EAGER_NUMERICS` in ``torch._inductor.config`` for every graph Inductor compiles from
    now on in this process. Once per process: a setting the user changes afterwards stays changed
    (``inductor_config.patch`` compares both in one process). Returns the settings this torch lacks
    (2.13 has them all), logged once."""
    missing = []
    for dotted, value in EAGER_NUMERICS.items():
        owner, _, name = dotted.rpartition(".")
        target = inductor_config
        for part in filter(None, owner.split(".")):
            target = getattr(target, part, None)
        if target is None or not hasattr(target, name):
            missing.append(dotted)
            continue
        setattr(target, name, value)
    if missing:
        _log.warning("glm53: this torch's Inductor lacks %s; compiled kernels may round where eager does not",
                     ", ".join(missing))
    return tuple(missing)


GEMM_REWRITES = ("addmm", "unfuse_bias_add_to_pointwise")
"""Inductor's post-grad rewrites that move an addition across a GEMM's rounding (handlers in
``torch._inductor.fx_passes.post_grad``): ``addmm`` folds ``mm(a, b) + c`` into ``addmm(c, a, b)``
(CPU always; CUDA where a user of the sum is not pointwise), so a BF16 GEMM's output is no longer
rounded before the add; ``unfuse_bias_add_to_pointwise`` splits an ``addmm`` whose users are all
pointwise into ``mm`` + add on CUDA, adding a rounding (for BF16 only while
``keep_addmm_fused_for_half_dtypes`` is off). Measured on the tiny model without batch invariance:
the fold alone made the MoE block (routed experts + shared expert's ``down_proj``) differ from
eager in 28 % of its outputs."""


@functools.cache
def _gemm_rewrite_lists() -> tuple[tuple[list, tuple], ...]:
    """Every post-grad pattern list holding one of :data:`GEMM_REWRITES`, with those entries and
    their places in it: ``(entries, ((index, entry), ...))``. The lists are edited in place, so
    patterns Inductor registers later (its lazy first-compile set-up) stay."""
    from torch._inductor.fx_passes import post_grad

    def rewrite(entry) -> bool:
        handler = getattr(entry, "handler", None)
        return getattr(handler, "__module__", None) == post_grad.__name__ and handler.__name__ in GEMM_REWRITES

    found = ((entries, tuple((i, e) for i, e in enumerate(entries) if rewrite(e)))
             for patterns in post_grad.pass_patterns for entries in patterns.patterns.values())
    return tuple((entries, rewrites) for entries, rewrites in found if rewrites)


def _use_gemm_rewrites(inductors: bool) -> None:
    for entries, rewrites in _gemm_rewrite_lists():
        entries[:] = [x for x in entries if all(x is not e for _, e in rewrites)]
        for i, e in rewrites if inductors else ():  # ascending: each back at its own place
            entries.insert(i, e)


@functools.cache
def install_eager_gemms() -> int:
    """Remove :data:`GEMM_REWRITES` from Inductor's post-grad patterns, once per process, so each
    GEMM of the eager graph stays the GEMM Inductor calls (the salted plugin sources, this file
    among them, key the cache). Returns how many pattern lists held one (0, logged, where this
    torch names them otherwise)."""
    _use_gemm_rewrites(False)
    if not _gemm_rewrite_lists():
        _log.warning("glm53: found none of Inductor's GEMM rewrites %s; a compiled GEMM may round where "
                     "eager does not", ", ".join(GEMM_REWRITES))
    return len(_gemm_rewrite_lists())


@contextlib.contextmanager
def inductor_own_numerics(decompositions: dict):
    """Inside the block, Inductor compiles with its own numerics, to measure what the plugin's
    change or cost: its defaults for :data:`EAGER_NUMERICS`, its GEMM rewrites back in place, and
    ``decompositions`` (``{op: Inductor's own decomposition, or None for none}``) in its table; the
    FX-graph and AOT caches off (the rewrites and the table are not part of a cache key). On exit
    the plugin's state is back."""
    from torch._functorch import config as functorch_config

    def put(table: dict) -> None:
        for op, fn in table.items():
            if fn is None:
                drop_inductor_decomposition(op)
            else:
                register_inductor_decomposition(op, fn)

    plugins = {op: _inductor_decomposition.decompositions.get(op) for op in decompositions}
    _use_gemm_rewrites(True)
    put(decompositions)
    try:
        with inductor_config.patch({**plain_inductor_numerics(), "fx_graph_cache": False}), \
                functorch_config.patch(enable_autograd_cache=False):
            yield
    finally:
        _use_gemm_rewrites(not install_eager_gemms.cache_info().currsize)
        put(plugins)


@functools.cache
def install_size_oblivious_shapes() -> bool:
    """Let one symbolic-shape graph serve packed batches of one document and of many: set
    ``torch.fx.experimental._config.backed_size_oblivious`` (once per process; False where this torch
    lacks it, logged). Without it, a tensor with one row per document (the KDA final state
    ``[N, H, K, V]``, chunk tables) makes the contiguity checks guard ``N != 1``, and the first
    one-document batch after a many-document one compiles a third graph. With it, such a check
    on a symbolic size decides "not 1" without a guard (PyTorch's size-oblivious reasoning);
    sizes that enter a graph as 0 or 1 are still specialized, as without it."""
    from torch.fx.experimental import _config as fx_config

    if not hasattr(fx_config, "backed_size_oblivious"):
        _log.warning("glm53: this torch lacks torch.fx.experimental._config.backed_size_oblivious; a "
                     "one-document batch recompiles a graph compiled for many")
        return False
    fx_config.backed_size_oblivious = True
    return True


def plain_inductor_numerics() -> dict:
    """Inductor's own defaults (its environment variables applied) for the keys of
    :data:`EAGER_NUMERICS` that this torch has, read from the config module's entries
    (:func:`inductor_own_numerics` patches them in)."""
    entries = inductor_config._config
    return {key: entries[key].default for key in EAGER_NUMERICS if key in entries}


SMALL_REDUCTION_XBLOCK = 8
"""Rows per program of a persistent reduction of 65-128 elements (Triton's default 4 warps).

H200, the fused SwiGLU + FP8 QDQ kernel at 8192 x 2048, 10 launches back to back per graph replay
(plain BF16 SwiGLU: 25.5 us): Inductor's autotuner picks XBLOCK 32 with 2 warps, 28.5 us; XBLOCK 8
with 4 warps runs in 25.6-25.9 us (4 x 2: 25.6-25.8; 8 x 2: 26.7; 16 x 4: 26.9). Its benchmark times
lone launches, where the larger tile looks better."""


def _static_numel(numel) -> int | None:
    """``numel`` as an int when static (an int or a sympy number); None when dynamic."""
    if isinstance(numel, int) or bool(getattr(numel, "is_number", False)):
        return int(numel)
    return None


def lowering_batch_invariant_graph() -> bool:
    """Whether the graph Inductor is lowering is a forward (or inference) graph that calls a
    ``glm53::bi_*`` op: the graph of a module traced under ``PrecisionConfig.batch_invariant`` (the
    config reaches the graph only as its ops, so the FX graph, already part of Inductor's cache key,
    decides). A backward graph never is: batch invariance is a contract on forward values (the
    decode and the training forward), so backward reductions keep Inductor's splits. Cached on the
    graph module."""
    from torch._inductor.virtualized import V

    gm = getattr(V.graph, "module", None) if V.graph is not None else None  # V.graph is a NullHandler outside
    if not isinstance(gm, torch.fx.GraphModule) or getattr(V.graph, "is_backward", False):
        return False
    found = getattr(gm, "_glm53_batch_invariant", None)
    if found is None:
        found = any(node.op == "call_function" and str(node.target).startswith("glm53.bi_") for node in gm.graph.nodes)
        gm._glm53_batch_invariant = found
    return found


def _persistent_choices(max_numel: int):
    """An ``InductorChoices`` subclass whose persistent-reduction test also accepts every reduction
    of a static length ``<= max_numel``, launched with a fixed configuration."""
    from torch._inductor.choices import InductorChoices
    from torch._inductor.codegen.triton import FixedTritonConfig, TritonKernel

    def small(features, lowest: int = 2) -> bool:
        numel = _static_numel(features.reduction_numel)  # 1 for pointwise kernels
        return (numel is not None and lowest <= numel <= max_numel
                and bool(inductor_config.triton.persistent_reductions))

    def rows_by_groups(groups) -> bool:
        """One row dimension and one reduction dimension: 2.13 passes ``[{"x": .., "r0_": ..}]``."""
        if len(groups) == 1 and isinstance(groups[0], dict):
            return set(groups[0]) <= {"x", "r0_"}
        return len(groups) == 2

    class PersistentSmallReductions(InductorChoices):
        """Inductor's choices, except that reductions of at most ``MAX_NUMEL`` elements stay
        persistent (one pass over registers) whatever their reduction hint; rows longer than
        ``MAX_NUMEL/2`` run ``SMALL_REDUCTION_XBLOCK`` per program instead of an autotuned tile."""

        MAX_NUMEL = max_numel

        @staticmethod
        def should_use_persistent_reduction(features, cooperative_reduction: bool) -> bool:
            if InductorChoices.should_use_persistent_reduction(features, cooperative_reduction):
                return True
            return small(features)

        def triton_kernel_kwargs(self, kernel_cls, features, groups, kernel_kwargs):
            kwargs = super().triton_kernel_kwargs(kernel_cls, features, groups, kernel_kwargs)
            # the measured tile: rows of 65-128 elements (one R0_BLOCK of 128), no y dimension
            if (not issubclass(kernel_cls, TritonKernel) or "fixed_config" in kwargs
                    or not small(features, lowest=max_numel // 2 + 1) or not rows_by_groups(groups)
                    or kwargs.get("override_persistent_reduction") is False
                    or kwargs.get("mix_order_reduction")):  # its launch needs RSPLIT_SIZE: Inductor's configs
                return kwargs
            return {**kwargs, "fixed_config": FixedTritonConfig({"XBLOCK": SMALL_REDUCTION_XBLOCK})}

        # torch 2.11 and 2.13 give these hooks different arguments (2.11: the kernel's features to
        # should_use_cooperative_reduction), as static or bound methods: the overrides forward
        # whatever they get to Inductor's own through super()
        def reduction_split_factor(self, *args, **kwargs) -> int:
            """Inductor's split (it grows as the number of output rows shrinks), except in a
            batch-invariant graph: never split, so a row's reduction order is the same for every
            row count (a decode step and a full forward)."""
            if lowering_batch_invariant_graph():
                return 1
            return super().reduction_split_factor(*args, **kwargs)

        def should_use_cooperative_reduction(self, *args, **kwargs) -> bool:
            """Inductor's choice (cooperative below 16 rows), never in a batch-invariant graph."""
            if lowering_batch_invariant_graph():
                return False
            return super().should_use_cooperative_reduction(*args, **kwargs)

        def uuid(self) -> str:
            """Cache-key part (2.13 hashes ``config.inductor_choices_class`` through it)."""
            return f"glm53-persistent-reductions-{max_numel}-xblock-{SMALL_REDUCTION_XBLOCK}-bi-nosplit"

    # a module attribute, so that pickling Inductor's config (save_config) finds the class
    PersistentSmallReductions.__qualname__ = PersistentSmallReductions.__name__
    globals()[PersistentSmallReductions.__name__] = PersistentSmallReductions
    return PersistentSmallReductions


@functools.cache
def _warn_foreign_choices() -> None:
    _log.warning("glm53: torch._inductor.config.inductor_choices_class is set by someone else; small "
                 "reductions keep Inductor's own persistent-reduction heuristic")


def install_persistent_reductions(max_numel: int) -> bool:
    """Make Inductor keep reductions of at most ``max_numel`` elements persistent, those longer
    than ``max_numel/2`` launched with ``SMALL_REDUCTION_XBLOCK`` rows per program (no
    autotuning); idempotent.
    Returns False (and logs once) when a user's own ``inductor_choices_class`` is in place: that
    one is left alone.

    Why: Inductor keeps a reduction persistent up to 1024 elements only when its hint is INNER,
    and a reduction whose reads are not one contiguous range (the per-128-group amax of an FP8
    QDQ over the gate | up halves of a projection output) gets the DEFAULT hint, whose limit is 64.
    The looped form reads its input twice and recomputes the fused SwiGLU in its second pass
    (H200, 8192 x 2048: 59.8 us looped, 52.9 us persistent, bitwise equal outputs).

    Installed as ``config.inductor_choices_class`` where torch has it (2.13 does: every thread), and
    as the calling thread's ``V.choices`` handler when that is still Inductor's plain one (the only
    hook where torch lacks the factory)."""
    from torch._inductor.choices import InductorChoices
    from torch._inductor.virtualized import V

    current = getattr(inductor_config, "inductor_choices_class", None)
    if current is not None and getattr(current, "MAX_NUMEL", None) != max_numel:
        _warn_foreign_choices()
        return False
    cls = current or _persistent_choices(max_numel)
    if hasattr(inductor_config, "inductor_choices_class"):
        inductor_config.inductor_choices_class = cls
    if type(V.choices) is InductorChoices:  # built before the install (or torch without the factory)
        V.set_choices_handler(cls())
    return True


def fallback_to_aten(overloads) -> None:
    """Make Inductor call ATen's own kernel for each of ``overloads`` (its decomposition and lowering
    dropped) in every graph compiled from now on in this process; irreversible. What the mismatch
    attribution (``docs/experiments/inductor_attribution.py``) sends to ATen, one family at a time."""
    from torch._inductor.lowering import lowerings, make_fallback

    for op in overloads:
        drop_inductor_decomposition(op)
        lowerings.pop(op, None)
        make_fallback(op, warn=False)


def drop_inductor_decomposition(op: torch._ops.OpOverload) -> None:
    """Remove ``op``'s entry from Inductor's decomposition table (a ``glm53`` op then runs its own
    kernel compiled or not; ``register_inductor_decomposition`` puts one back)."""
    _inductor_decomposition.decompositions.pop(op, None)
    _clear_merged_table()


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
