"""Fakes of ``glm53::kda_chunk``, ``glm53::kda_chunk_bwd`` and ``glm53::kda_recurrent``.

Residual dtypes follow the precision: BF16 for qn, kn, Aqk, Akk under ``"bf16"``, FP32 under
``"fp32"``; rstd and g_cumsum are FP32 in both; o takes v's dtype, the final state FP32. Under
``"fp32"`` with K, V ≤ 128 the residuals take the FP32 kernels' layout (``fp32_residual_shapes``).
"""

from __future__ import annotations

import torch

from inductor_ext.ops.kda_reference import CHUNK, returned_residuals

__all__ = ["FAKES", "kda_chunk_fake", "kda_chunk_bwd_fake", "kda_recurrent_fake"]


def _num_states(q, cu_seqlens):
    return q.shape[0] if cu_seqlens is None else cu_seqlens.shape[0] - 1


def _final_state(q, v, cu_seqlens):
    return q.new_empty(_num_states(q, cu_seqlens), q.shape[2], q.shape[3], v.shape[3], dtype=torch.float32)


def kda_chunk_fake(q, k, v, g, beta, scale, initial_state, cu_seqlens, precision, residuals):
    """Outputs of ``glm53::kda_chunk`` as empty tensors: shapes, dtypes, strides, no data."""
    store = torch.bfloat16 if precision == "bf16" else torch.float32
    B, T, H, K = q.shape
    out = (
        v.new_empty(v.shape),
        _final_state(q, v, cu_seqlens),
        q.new_empty(q.shape, dtype=store),
        q.new_empty(q.shape, dtype=store),
        q.new_empty(B, T, H, dtype=torch.float32),
        q.new_empty(B, T, H, dtype=torch.float32),
        g.new_empty(g.shape, dtype=torch.float32),
        q.new_empty(B, T, H, CHUNK, dtype=store),
        q.new_empty(B, T, H, CHUNK, dtype=store),
    )
    return returned_residuals(out, q, v, cu_seqlens, precision, residuals)


def kda_chunk_bwd_fake(q, k, v, g, beta, scale, initial_state, cu_seqlens, precision,
                       qn, kn, q_rstd, k_rstd, g_cumsum, Aqk, Akk, do, dht):
    """Outputs of ``glm53::kda_chunk_bwd`` as empty tensors: shapes, dtypes, strides, no data."""
    return (*(x.new_empty(x.shape) for x in (q, k, v, g, beta)), _final_state(q, v, cu_seqlens))


def kda_recurrent_fake(q, k, v, g, beta, scale, initial_state, cu_seqlens):
    """Outputs of ``glm53::kda_recurrent`` as empty tensors: shapes, dtypes, strides, no data."""
    return v.new_empty(v.shape), _final_state(q, v, cu_seqlens)


FAKES = {
    "glm53::kda_chunk": kda_chunk_fake,
    "glm53::kda_chunk_bwd": kda_chunk_bwd_fake,
    "glm53::kda_recurrent": kda_recurrent_fake,
}
