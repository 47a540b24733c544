"""CUDA kernels of ``glm53::kda_chunk`` / ``kda_chunk_bwd`` under precision ``"fp32"`` (K, V ≤ 128):
the own FP32-grade Triton kernels, :func:`kda_fp32_fwd` and :func:`kda_fp32_bwd`.

They keep nothing between forward and backward: the backward recomputes every intermediate from
the inputs, so the op's seven residual outputs are empty under this precision (on every device,
see :func:`inductor_ext.ops.kda.fp32_kernels_apply`).
"""

from __future__ import annotations

import torch

from inductor_ext.kernels.kda_fp32_bwd_triton import kda_fp32_bwd
from inductor_ext.kernels.kda_fp32_triton import kda_fp32_fwd

__all__ = ["kda_chunk_fwd", "kda_chunk_bwd"]


def _residuals(q: torch.Tensor) -> tuple:
    return tuple(q.new_empty(0, dtype=torch.float32) for _ in range(7))


def kda_chunk_fwd(q, k, v, g, beta, scale, initial_state, cu_seqlens, precision, residuals):
    """(o in v's dtype, FP32 final state, seven empty FP32 residuals)."""
    o, final = kda_fp32_fwd(q, k, v, g, beta, scale, initial_state, cu_seqlens)
    return (o, final, *_residuals(q))


def kda_chunk_bwd(q, k, v, g, beta, scale, initial_state, cu_seqlens, precision,
                  qn, kn, q_rstd, k_rstd, g_cumsum, Aqk, Akk, do, dht):
    """(dq, dk, dv, dg, dbeta, dh0), recomputed from the inputs (the residuals are empty)."""
    return kda_fp32_bwd(q, k, v, g, beta, scale, initial_state, cu_seqlens, do, dht)
