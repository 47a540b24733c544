"""Inductor decompositions of ``glm53::mhc_pre`` and ``glm53::mhc_post`` (mHC mixing).

Both ops are small-N (4 streams) mixing around one GEMM: as ATen ops, mhc_pre becomes the stream
RMSNorm fused into the producer, one ``mm`` for the coefficient projection, then one kernel for
sigmoid/softmax/Sinkhorn and the weighted stream collapse; mhc_post becomes a single pointwise
kernel ``post[o]·f + Σ_s comb[s,o]·res[s]`` fused with the sublayer's output and whatever reads
the new streams. Rounding points (:mod:`lowerings._rounding`):

- ``mhc_pre``: the reference (:func:`~inductor_ext.ops.mhc_reference.mhc_pre_reference`) on exact FP32
  inputs; ``mixed`` rounded once to x's dtype, post and comb stay FP32.
- ``mhc_post`` ``"fp32"``: the reference's own elementwise chain
  (:func:`~inductor_ext.ops.mhc_reference.mhc_post_fp32`) on the exact inputs, one rounding: bitwise eager.
- ``mhc_post`` ``"bf16"``: transformers' roundings — post and comb to the residual's dtype, the
  product ``post·f``, the stream matmul (FP32 accumulation, one rounding) and the sum.

In ``"bf16"`` the 4-term stream sum is written as a product and a reduction over s instead of
``matmul``, so Inductor fuses it rather than calling ``bmm`` (its products are exact in FP32 and it
rounds once to BF16: bitwise the reference, measured). Backward formulas are
plain torch (``register_autograd``) and fuse likewise.
"""

from __future__ import annotations

import torch

from inductor_ext.ops.mhc_reference import mhc_post_fp32, mhc_pre_reference
from lowerings._rounding import exact, round_to, store

__all__ = ["mhc_pre_decomposition", "mhc_post_decomposition", "DECOMPOSITIONS"]


def mhc_pre_decomposition(x, fn, base, scale, norm_eps, hc_eps, sinkhorn_iters):
    """(mixed in x's dtype, post FP32, comb FP32) as ATen ops."""
    mixed, post, comb = mhc_pre_reference(exact(x), exact(fn), exact(base), exact(scale),
                                          norm_eps, hc_eps, sinkhorn_iters)
    return store(mixed, x.dtype), post, comb


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
    torch.ops.glm53.mhc_pre.default: mhc_pre_decomposition,
    torch.ops.glm53.mhc_post.default: mhc_post_decomposition,
}
