"""Fakes of ``glm53::mhc_pre`` and ``glm53::mhc_post`` (all outputs contiguous).

mhc_pre: (mixed ``[..., D]`` in x's dtype, post FP32 ``[..., N]``, comb FP32 ``[..., N, N]``);
mhc_post: residual's shape ``[..., N, D]`` and dtype.
"""

from __future__ import annotations

import torch

__all__ = ["FAKES", "mhc_pre_fake", "mhc_post_fake"]


def mhc_pre_fake(x, fn, base, scale, norm_eps, hc_eps, sinkhorn_iters):
    """Outputs of ``glm53::mhc_pre`` as empty tensors: shapes, dtypes, strides, no data."""
    lead, N, D = x.shape[:-2], x.shape[-2], x.shape[-1]
    return (
        x.new_empty((*lead, D)),
        x.new_empty((*lead, N), dtype=torch.float32),
        x.new_empty((*lead, N, N), dtype=torch.float32),
    )


def mhc_post_fake(f, residual, post, comb, precision):
    """Outputs of ``glm53::mhc_post`` as empty tensors: shapes, dtypes, strides, no data."""
    return residual.new_empty(residual.shape)


FAKES = {
    "glm53::mhc_pre": mhc_pre_fake,
    "glm53::mhc_post": mhc_post_fake,
}
