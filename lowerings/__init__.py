"""Inductor lowering / decomposition rules for the ``glm53`` ops that should fuse with their
neighbours, and for the ATen ops whose Inductor code would not compute ATen's bits
(:mod:`lowerings.sigmoid`). Every private ``torch._inductor`` import lives in :mod:`lowerings._compat`.

Mechanism: each op family's module maps the op's ``OpOverload`` to a decomposition into ATen
ops; :func:`register_all` (called by ``inductor_ext.enable()``) adds them to *Inductor's*
decomposition table, which AOTAutograd applies only when the backend is ``"inductor"``. Eager
and ``aot_eager`` therefore keep the reference kernels, and Inductor fuses the decomposed work
into the kernels around it. The ops' ``register_autograd`` backward formulas are plain torch,
so their backward graphs are ATen ops already and fuse the same way. Every rounding point of a
contract is kept by :mod:`lowerings._rounding` (BF16, FP16 and e4m3 through ``glm53::round_to``,
lowered to a hardware conversion inside the fused kernel), which fusion cannot elide; its clamps
are compare-and-select, which keeps NaN without an extra test. The ops that must stay opaque
(KDA chunk, the KPool scorer) carry layout tags on their ``torch.library.custom_op`` definitions
instead.
"""

from __future__ import annotations

__all__ = ["register_all", "decompositions", "own_numerics"]


def decompositions() -> dict:
    """Every decomposition of this package: ``{OpOverload: fn}`` (defines the ops on import)."""
    import inductor_ext.ops  # noqa: F401  (defines the glm53 ops)
    from lowerings import fp8_qdq, fp32_linear, mhc, sigmoid, swiglu

    table = {}
    for module in (fp8_qdq, swiglu, fp32_linear, mhc, sigmoid):
        table.update(module.DECOMPOSITIONS)
    return table


def register_all() -> None:
    """Register every decomposition in Inductor's table and the lowering of their rounding point
    ``glm53::round_to``, keep reductions of one FP8 QDQ group (128 elements) persistent
    (:func:`lowerings._compat.install_persistent_reductions`) and make Inductor keep the eager
    graph's rounding points (:data:`lowerings._compat.EAGER_NUMERICS`) and GEMMs
    (:func:`lowerings._compat.install_eager_gemms`), and let one symbolic-shape
    graph serve every document count (:func:`lowerings._compat.install_size_oblivious_shapes`);
    idempotent."""
    import torch

    from inductor_ext.ops.fp8_qdq_reference import GROUP
    from lowerings._compat import (
        install_eager_gemms,
        install_eager_numerics,
        install_persistent_reductions,
        install_size_oblivious_shapes,
        register_inductor_decomposition,
        register_rounding_lowering,
    )

    register_rounding_lowering(torch.ops.glm53.round_to.default)
    for op, fn in decompositions().items():
        register_inductor_decomposition(op, fn)
    install_persistent_reductions(GROUP)
    install_eager_numerics()
    install_eager_gemms()
    install_size_oblivious_shapes()


def own_numerics():
    """Context manager: inside it Inductor compiles with its own numerics (its defaults for
    :data:`lowerings._compat.EAGER_NUMERICS`, its GEMM rewrites, its sigmoid and silu), caches off;
    the ``glm53`` ops keep their decompositions. For measuring what the plugin's numerics change
    and cost (tests, ``docs/experiments/eager_numerics_price.py``); call :func:`register_all` first."""
    from lowerings import sigmoid
    from lowerings._compat import inductor_own_numerics

    return inductor_own_numerics(sigmoid.INDUCTORS_OWN)
