"""Inductor decomposition of ``glm53::fp32_linear`` (IEEE FP32 linear layer).

The opaque op materialises FP32 copies of x and the weight before its GEMM. Decomposed, the
GEMM stays the FP32 ``mm`` / ``addmm`` eager calls (Inductor's extern kernel; the bias inside it,
as in eager: ``enable()`` removes Inductor's rewrites that move it out) while the casts of x fuse
into the kernels around it: the producer of x writes FP32 directly.
The decomposition is the reference (:func:`~inductor_ext.ops.fp32_linear.fp32_linear_reference`,
autocast off inside, so an autocast region around the model cannot turn the GEMM into BF16)
on the exact FP32 values of its inputs. The backward formula is plain torch and fuses likewise.
"""

from __future__ import annotations

import torch

from inductor_ext.ops.fp32_linear import fp32_linear_reference
from lowerings._rounding import exact

__all__ = ["fp32_linear_decomposition", "DECOMPOSITIONS"]


def fp32_linear_decomposition(x, weight, bias):
    """FP32 ``[..., out]`` as ATen ops."""
    return fp32_linear_reference(exact(x), exact(weight), exact(bias))


DECOMPOSITIONS = {torch.ops.glm53.fp32_linear.default: fp32_linear_decomposition}
