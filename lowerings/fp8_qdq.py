"""Inductor decomposition of ``glm53::fp8_qdq`` (per-128-group e4m3 quantize-dequantize).

The op is one amax reduction per group plus pointwise work, so as ATen ops it fuses with the
producer of x (a SwiGLU, a norm) and with the consumer of â (the cast into a GEMM input) instead
of costing a full read and write of the activation. The decomposition *is* the reference kernel
(:func:`~inductor_ext.ops.fp8_qdq.fp8_qdq_reference`) run on the exact FP32 value of x; the one
BF16 rounding of â goes through :func:`lowerings._rounding.store`, and the e4m3 rounding through
:func:`lowerings._rounding.round_e4m3` (integer bit arithmetic) instead of a float8 cast in the
graph: with the cast, Inductor on the H200 (torch 2.11) split the op into a reduction kernel that
wrote ``a / s`` in FP32 and a pointwise kernel that read it back, 2.7x the time of a plain BF16
SwiGLU. The amax over a group of 128 is kept a one-pass persistent reduction by
``enable()`` (:func:`lowerings._compat.install_persistent_reductions`): over the gate | up halves
of a projection output Inductor would otherwise loop it and recompute the SwiGLU in a second pass.
Max is order-independent, the UE8M0 scale and its reciprocal come
from integer bit operations (``a · (1/s)`` by a power of two is exact, as ``a / s`` is) and the
e4m3 conversion rounds to nearest even on every backend, so the compiled result is bitwise the
reference's for ``ue8m0`` (tested); ``fp32`` scales keep one IEEE division, also bitwise on the CPU.

Backward: the straight-through formula of ``register_autograd`` (``dx = dâ``) traces to a cast
that Inductor fuses with the gradient's producer.
"""

from __future__ import annotations

import torch

from inductor_ext.ops.fp8_qdq import fp8_qdq_reference
from lowerings._rounding import exact, round_e4m3, store

__all__ = ["fp8_qdq_decomposition", "DECOMPOSITIONS"]


def fp8_qdq_decomposition(x, scale_fmt):
    """(â in x's dtype, FP32 scales) as ATen ops."""
    out, scales = fp8_qdq_reference(exact(x), scale_fmt, e4m3=round_e4m3)
    return store(out, x.dtype), scales


DECOMPOSITIONS = {torch.ops.glm53.fp8_qdq.default: fp8_qdq_decomposition}
