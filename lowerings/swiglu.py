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
last-bit differences; tests state what remains. On CUDA the serving form takes the serving
engine's ``exp`` instead (:func:`serving_exp`): bitwise LMDeploy's activation, one instruction
pair instead of libdevice's ``expf``, and at most 1 BF16 ULP from the eager reference (ATen's
``expf``) on a few elements per million. The backward formulas (``register_autograd``)
are plain torch and fuse likewise.
"""

from __future__ import annotations

import torch

from lowerings._rounding import clamp_select, exact, store

__all__ = ["serving_exp", "swiglu_decomposition", "DECOMPOSITIONS"]

LOG2E = 1.4426950408889634


def serving_exp(x: torch.Tensor) -> torch.Tensor:
    """FP32 ``x`` (any shape) → ``exp(x)`` in FP32 as LMDeploy's ``v4_swiglu_quant`` evaluates it on
    NVIDIA GPUs: Triton's ``tl.math.exp``, i.e. ``ex2.approx.f32(x · fp32(log2 e))``. Inductor lowers ``exp2`` to
    libdevice ``exp2f``, the same multiply and ``ex2.approx.ftz``; the flush to zero changes nothing
    here, since the SwiGLU's argument ``−min(g, L) >= −L`` keeps every input and result normal."""
    return torch.exp2(x * LOG2E)


def swiglu_decomposition(gate, up, limit, mode):
    """SwiGLU output in the input dtype as ATen ops."""
    dtype = gate.dtype
    g = clamp_select(exact(gate), None, limit)
    u = clamp_select(exact(up), -limit, limit)
    serving = mode == "serving"
    exp = serving_exp if serving and gate.device.type == "cuda" else torch.exp
    silu = g / (1.0 + exp(-g))
    if not serving:
        silu = store(silu, dtype).float()
    return store(silu * u, dtype)


DECOMPOSITIONS = {torch.ops.glm53.swiglu.default: swiglu_decomposition}
