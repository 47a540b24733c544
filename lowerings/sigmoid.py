"""Inductor decompositions of ``aten.sigmoid`` and ``aten.silu`` on CUDA: ATen's CUDA formulas.

ATen's CUDA kernels compute, in FP32 for BF16 / FP16 / FP32 inputs, ``sigmoid(x) = 1 / (1 + exp(-x))``
and ``silu(x) = x / (1 + exp(-x))``, with the CUDA toolkit's ``expf`` and IEEE division. Inductor's
Triton code calls ``tl.sigmoid`` instead, and its own ``silu`` is ``x · sigmoid(x)``: each can differ
from eager's in the last FP32 bit. Written as ``exp`` and ``/``, they compile, under the plugin's
settings (``lowerings._compat.EAGER_NUMERICS``: the toolkit's libdevice ``exp``, IEEE division, no
FMA contraction), to ATen's operations in ATen's order. The numerator is a tensor of ones, not the
number 1: torch 2.11's Triton code divides a number by a tensor with the approximate division.

Measured on an H100 with torch 2.11: FP32 ``sigmoid`` of 2²⁰ normal values (σ = 8) differed from
ATen's in 144,079 with Inductor's code, in none with these; on the tiny batch-invariant model the
KDA forget gate and the MoE router's FP32 weights differed from eager in 16 % and 19 % of their
values before, in none after.

On other devices Inductor's own code matches ATen's already (the CPU tests are bitwise): these
return ``NotImplemented`` there (sigmoid: Inductor's lowering) or defer to Inductor's decomposition (silu).
"""

from __future__ import annotations

import torch

from lowerings._compat import inductor_decomposition

__all__ = ["sigmoid_decomposition", "silu_decomposition", "DECOMPOSITIONS", "INDUCTORS_OWN"]

_aten = torch.ops.aten
_INDUCTOR_SILU = inductor_decomposition(_aten.silu.default)  # Inductor's own, read before ours replaces it


def _opmath(x: torch.Tensor) -> torch.Tensor:
    return x.float() if x.dtype in (torch.bfloat16, torch.float16) else x


def sigmoid_decomposition(x: torch.Tensor) -> torch.Tensor:
    """``1 / (1 + exp(-x))`` in FP32 (FP64 stays FP64), one rounding to x's dtype; CUDA only."""
    if x.device.type != "cuda" or not x.is_floating_point():
        return NotImplemented
    xf = _opmath(x)
    return (torch.ones_like(xf) / (1 + torch.exp(-xf))).to(x.dtype)  # a tensor numerator: IEEE division


def silu_decomposition(x: torch.Tensor) -> torch.Tensor:
    """``x / (1 + exp(-x))`` in FP32 (FP64 stays FP64), one rounding to x's dtype; CUDA only."""
    if x.device.type != "cuda" or not x.is_floating_point():
        return _INDUCTOR_SILU(x) if _INDUCTOR_SILU is not None else NotImplemented
    xf = _opmath(x)
    return (xf / (1 + torch.exp(-xf))).to(x.dtype)


DECOMPOSITIONS = {_aten.sigmoid.default: sigmoid_decomposition, _aten.silu.default: silu_decomposition}
INDUCTORS_OWN = {_aten.sigmoid.default: None, _aten.silu.default: _INDUCTOR_SILU}
"""What Inductor's table holds for these ops without the plugin (None: no entry)."""
