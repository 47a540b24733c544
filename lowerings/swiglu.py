"""Inductor decomposition of ``glm53::swiglu`` (clamped SwiGLU, both modes).

SwiGLU is pointwise: decomposed, it fuses with the split of the gate/up projection before it
and with the FP8 QDQ or the down projection's input cast after it. Rounding points of the
contract (``inductor_ext/ops/swiglu.py``) are kept with :mod:`lowerings._rounding`, and the clamps
are compare-and-select (:func:`~lowerings._rounding.clamp_select`, bitwise ``clamp``):

- ``serving``: FP32 ``g / (1 + exp(−g)) · u`` from the exact inputs, one BF16 rounding: the
  expression of :func:`~inductor_ext.ops.swiglu.swiglu_reference`.
- ``native``: transformers' BF16 chain, ``silu`` rounded to the input dtype (ATen's CPU and CUDA
  kernels compute it as ``x / (1 + exp(−x))`` in FP32), then the product rounded again.

Bitwise equality with the reference then rests on ``exp`` alone: Inductor's C++ kernels call the
same SLEEF ``expf`` (1-ULP) as ATen's vectorised loop, and the BF16 rounding after it hides most
last-bit differences; tests state what remains. The backward formulas (``register_autograd``)
are plain torch and fuse likewise.
"""

from __future__ import annotations

import torch

from lowerings._rounding import clamp_select, exact, store

__all__ = ["swiglu_decomposition", "DECOMPOSITIONS"]


def swiglu_decomposition(gate, up, limit, mode):
    """SwiGLU output in the input dtype as ATen ops."""
    dtype = gate.dtype
    g = clamp_select(exact(gate), None, limit)
    u = clamp_select(exact(up), -limit, limit)
    if mode == "serving":
        return store(g / (1.0 + torch.exp(-g)) * u, dtype)
    silu = store(g / (1.0 + torch.exp(-g)), dtype).float()
    return store(silu * u, dtype)


DECOMPOSITIONS = {torch.ops.glm53.swiglu.default: swiglu_decomposition}
