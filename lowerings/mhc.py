"""Inductor decomposition of ``glm53::mhc_post`` (mHC stream mixing).

As ATen ops, mhc_post becomes a single pointwise kernel ``post[o]·f + Σ_s comb[s,o]·res[s]``
fused with the sublayer's output and whatever reads the new streams. Rounding points
(:mod:`lowerings._rounding`):

- ``"fp32"``: the reference's own elementwise chain (:func:`~inductor_ext.ops.mhc_reference.mhc_post_fp32`)
  on the exact inputs, one rounding: bitwise eager.
- ``"bf16"``: transformers' roundings — post and comb to the residual's dtype, the product
  ``post·f``, the stream matmul (FP32 accumulation, one rounding) and the sum. The 4-term stream
  sum is written as a product and a reduction over s instead of ``matmul``, so Inductor fuses it
  rather than calling ``bmm`` (its products are exact in FP32 and it rounds once to BF16:
  bitwise the reference, measured).

``glm53::mhc_pre`` has no decomposition: its stream RMS is a row reduction over N·D, which
Inductor sums in its own order (ATen's eager kernel, another), so decomposed it could not give
eager's bits (measured with torch 2.13: mixed within 1 BF16 ULP, post and comb within 8 FP32 ULPs).
Opaque, Inductor calls its kernel. Backward formulas are plain torch (``register_autograd``) and
fuse like any ATen code.
"""

from __future__ import annotations

import torch

from inductor_ext.ops.mhc_reference import mhc_post_fp32
from lowerings._rounding import exact, round_to, store

__all__ = ["mhc_post_decomposition", "DECOMPOSITIONS"]


def _stream_mix(comb, residual):
    """Σ_s comb[..., s, o] · residual[..., s, :] → ``[..., o, D]`` (FP32, pointwise + reduction)."""
    return (comb.unsqueeze(-1) * residual.unsqueeze(-2)).sum(-3)


def mhc_post_decomposition(f, residual, post, comb, precision):
    """``[..., N, D]`` in residual's dtype as ATen ops."""
    dtype = residual.dtype
    f, residual, post, comb = exact(f), exact(residual), exact(post), exact(comb)
    with torch.autocast(f.device.type, enabled=False):
        if precision == "fp32":
            return store(mhc_post_fp32(f, residual, post, comb), dtype)
        post, comb = round_to(post, dtype), round_to(comb, dtype)  # the reference's .to(dtype)
        scaled = store(post.unsqueeze(-1) * f.unsqueeze(-2), dtype).float()
        mixed = store(_stream_mix(comb, residual), dtype).float()
        return store(scaled + mixed, dtype)


DECOMPOSITIONS = {
    torch.ops.glm53.mhc_post.default: mhc_post_decomposition,
}
