"""Fakes of the KPool indexer ops (``glm53::kpool_*``): shapes, dtypes and strides, no data.

``kpool_logits`` returns a strided view of the padded MQA workspace: rows padded to
``bq = 128 / H`` and a layout-dependent row stride (:mod:`inductor_ext.workspace`); the fake
builds the same view so compiled graphs see the real strides.
"""

from __future__ import annotations

import torch

from inductor_ext import workspace

__all__ = ["FAKES",
    "kpool_project_fake",
    "kpool_compress_fake",
    "kpool_quant_query_fake",
    "kpool_logits_fake",
    "kpool_select_fake",
]


def kpool_project_fake(x, wk, k_norm_weight, k_norm_bias, weights_proj, compress_gate, eps, head_proj):
    """Outputs of ``glm53::kpool_project`` as empty tensors: shapes, dtypes, strides, no data."""
    T = x.shape[0]
    return (
        x.new_empty(T, wk.shape[0]),
        x.new_empty(T, compress_gate.shape[0]),
        x.new_empty(T, weights_proj.shape[0], dtype=torch.float32),
    )


def kpool_compress_fake(k, gate, ape, pool_token, mode):
    """Outputs of ``glm53::kpool_compress`` as empty tensors: shapes, dtypes, strides, no data."""
    dtype = torch.float8_e4m3fn if mode.startswith("fp8") else k.dtype
    S = pool_token.shape[0]
    return k.new_empty(S, k.shape[1], dtype=dtype), k.new_empty(S, dtype=torch.float32)


def kpool_quant_query_fake(q, w, scale_fmt):
    """Outputs of ``glm53::kpool_quant_query`` as empty tensors: shapes, dtypes, strides, no data."""
    return q.new_empty(q.shape, dtype=torch.float8_e4m3fn), w.new_empty(w.shape, dtype=torch.float32)


def kpool_logits_fake(q, w, pool, pool_scale, precision, layout):
    """Outputs of ``glm53::kpool_logits`` as empty tensors: shapes, dtypes, strides, no data."""
    return workspace.logits_view(q.shape[0], pool.shape[0], q.shape[1], layout, q.device)


def kpool_select_fake(logits, q_lo, q_n, tail_start, tail_len, topk, pool_size, tail):
    """Outputs of ``glm53::kpool_select`` as empty tensors: shapes, dtypes, strides, no data."""
    return logits.new_empty(logits.shape[0], topk + pool_size - 1, dtype=torch.int32)


def kpool_score_select_fake(q, w, pool, pool_scale, q_lo, q_n, tail_start, tail_len, kpool, layout, budget_mb,
                            topk, pool_size, tail, batch_invariant, num_tokens):
    """Output of ``glm53::kpool_score_select``: int32 ``[M, topk + P - 1]``, no data."""
    return q.new_empty(q.shape[0], topk + pool_size - 1, dtype=torch.int32)


FAKES = {
    "glm53::kpool_project": kpool_project_fake,
    "glm53::kpool_compress": kpool_compress_fake,
    "glm53::kpool_quant_query": kpool_quant_query_fake,
    "glm53::kpool_logits": kpool_logits_fake,
    "glm53::kpool_select": kpool_select_fake,
    "glm53::kpool_score_select": kpool_score_select_fake,
}
