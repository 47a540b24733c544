"""Inductor decomposition of ``glm53::layer_norm_fp32`` (LayerNorm in FP32, one rounding).

Decomposed, the two row reductions and the affine fuse into one kernel with the producer of x
(e.g. the key projection's epilogue) and the consumer of y. The decomposition is the reference
(:func:`~inductor_ext.ops.layer_norm_fp32.layer_norm_fp32_reference`, autocast off) on the exact
FP32 inputs, rounded once by :func:`lowerings._rounding.store`. Inductor sums a row in its own
order (vector lanes, then a horizontal reduction), so mean and variance may differ from ATen's
in the last FP32 bit; the tests measure the effect on the output in ULPs.
"""

from __future__ import annotations

import torch

from inductor_ext.ops.layer_norm_fp32 import layer_norm_fp32_reference
from lowerings._rounding import exact, store

__all__ = ["layer_norm_fp32_decomposition", "DECOMPOSITIONS"]


def layer_norm_fp32_decomposition(x, weight, bias, eps):
    """``[..., D]`` in x's dtype as ATen ops."""
    y = layer_norm_fp32_reference(exact(x), exact(weight), exact(bias), eps)
    return store(y, x.dtype)


DECOMPOSITIONS = {torch.ops.glm53.layer_norm_fp32.default: layer_norm_fp32_decomposition}
