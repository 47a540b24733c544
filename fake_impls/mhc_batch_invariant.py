"""Fake of ``glm53::bi_mhc_coefficients``: (pre ``[R, N]``, post ``[R, N]``, comb ``[R, N, N]``) FP32
from proj ``[R, (2+N)·N]``, all contiguous."""

from __future__ import annotations

import torch

from inductor_ext.ops.mhc_reference import streams_from_width

__all__ = ["FAKES", "bi_mhc_coefficients_fake"]


def bi_mhc_coefficients_fake(proj, base, scale, hc_eps, iters):
    """Outputs of ``glm53::bi_mhc_coefficients`` as empty tensors (N from the width (2+N)·N)."""
    R, width = proj.shape
    N = streams_from_width(width)
    return (proj.new_empty((R, N), dtype=torch.float32), proj.new_empty((R, N), dtype=torch.float32),
            proj.new_empty((R, N, N), dtype=torch.float32))


FAKES = {"glm53::bi_mhc_coefficients": bi_mhc_coefficients_fake}
