"""Inductor decomposition of ``glm53::swiglu`` (clamped SwiGLU, both modes).

SwiGLU is pointwise: decomposed, it fuses with the split of the gate/up projection before it
and with the FP8 QDQ or the down projection's input cast after it. Rounding points of the
contract (``inductor_ext/ops/swiglu.py``) are kept with :mod:`lowerings._rounding`:

- ``serving``: FP32 ``g / (1 + exp(−g)) · u`` from the exact inputs, one BF16 rounding: the
  reference expression itself (:func:`~inductor_ext.ops.swiglu.swiglu_reference` on FP32).
- ``native``: transformers' BF16 chain, ``silu`` rounded to the input dtype (ATen's CPU and CUDA
  kernels compute it as ``x / (1 + exp(−x))`` in FP32), then the product rounded again.

Bitwise equality with the reference then rests on ``exp`` alone: Inductor's C++ kernels call the
same SLEEF ``expf`` (1-ULP) as ATen's vectorised loop, and the BF16 rounding after it hides most
last-bit differences; tests state what remains. The backward formulas (``register_autograd``)
are plain torch and fuse likewise.
"""

from __future__ import annotations

import torch

from inductor_ext.ops.swiglu import swiglu_reference
from lowerings._rounding import exact, store

__all__ = ["swiglu_decomposition", "DECOMPOSITIONS"]


def swiglu_decomposition(gate, up, limit, mode):
    """SwiGLU output in the input dtype as ATen ops."""
    dtype = gate.dtype
    if mode == "serving":
        return store(swiglu_reference(exact(gate), exact(up), limit, "serving"), dtype)
    g = exact(gate).clamp(max=limit)
    u = exact(up).clamp(-limit, limit)
    silu = store(g / (1.0 + torch.exp(-g)), dtype).float()
    return store(silu * u, dtype)


DECOMPOSITIONS = {torch.ops.glm53.swiglu.default: swiglu_decomposition}
