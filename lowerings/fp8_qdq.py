"""Inductor decomposition of ``glm53::fp8_qdq`` (per-128-group e4m3 quantize-dequantize).

The op is one amax reduction per group plus pointwise work, so as ATen ops it fuses with the
producer of x (a SwiGLU, a norm) and with the consumer of â (the cast into a GEMM input) instead
of costing a full read and write of the activation. The decomposition computes the reference
kernel's values (:func:`~inductor_ext.ops.fp8_qdq_reference.fp8_qdq_reference`) on the exact FP32 value of
x, sharing its scale and quotient (:func:`~inductor_ext.ops.fp8_qdq_reference.scaled_quotient`), with three
cheaper steps that give the same bits:

- amax as an integer max over the bits of ``|a|``: non-negative floats order as their bit
  patterns, and NaN's patterns lie above inf's, so NaN still propagates (its payload may differ);
- no clamp to ±448: ``|a / s| <= 448·(1 + 2⁻²²)``, which e4m3 rounds to 448 anyway;
- e4m3 and the one BF16 rounding of â through :mod:`lowerings._rounding` (hardware conversions).

The amax over a group of 128 is kept a one-pass persistent reduction by ``enable()``
(:func:`lowerings._compat.install_persistent_reductions`): over the gate | up halves of a
projection output Inductor would otherwise loop it and recompute the SwiGLU in a second pass.

Backward: the straight-through formula of ``register_autograd`` (``dx = dâ``) traces to a cast
that Inductor fuses with the gradient's producer.
"""

from __future__ import annotations

import torch

from inductor_ext.ops.fp8_qdq_reference import AMAX_FLOOR, GROUP, scaled_quotient
from lowerings._rounding import exact, round_to, store

__all__ = ["fp8_qdq_decomposition", "DECOMPOSITIONS"]

_FLOOR_BITS = torch.tensor(AMAX_FLOOR, dtype=torch.float32).view(torch.int32).item()


def fp8_qdq_decomposition(x, scale_fmt):
    """(â in x's dtype, FP32 scales) as ATen ops."""
    a = exact(x).reshape(*x.shape[:-1], x.shape[-1] // GROUP, GROUP)
    amax_bits = a.abs().view(torch.int32).amax(-1, keepdim=True).clamp_min(_FLOOR_BITS)
    s, quotient = scaled_quotient(a, amax_bits.view(torch.float32), scale_fmt)
    out = store(round_to(quotient, torch.float8_e4m3fn) * s, x.dtype).reshape(x.shape)
    return out, s.squeeze(-1)


DECOMPOSITIONS = {torch.ops.glm53.fp8_qdq.default: fp8_qdq_decomposition}
