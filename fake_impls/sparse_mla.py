"""Fakes of ``glm53::sparse_mla`` and ``glm53::sparse_mla_bwd``: contiguous outputs, no data.

Forward: ``out [T, H, d_v]`` in q's dtype, ``lse [T, H]`` FP32. Backward: ``dq`` like q, ``dkv``
like kv. Plain functions and a ``FAKES`` table; nothing registers on import.
"""

from __future__ import annotations

import torch

__all__ = ["FAKES", "sparse_mla_fake", "sparse_mla_bwd_fake"]


def sparse_mla_fake(q, kv, token_ids, scale, d_v, deterministic):
    """Outputs of ``glm53::sparse_mla`` as empty tensors: shapes, dtypes, strides, no data."""
    T, H, _ = q.shape
    return q.new_empty((T, H, d_v)), q.new_empty((T, H), dtype=torch.float32)


def sparse_mla_bwd_fake(q, kv, token_ids, out, lse, dout, dlse, scale, d_v, deterministic):
    """Outputs of ``glm53::sparse_mla_bwd`` (dq, dkv) as empty tensors."""
    return q.new_empty(q.shape), kv.new_empty(kv.shape)


FAKES = {
    "glm53::sparse_mla": sparse_mla_fake,
    "glm53::sparse_mla_bwd": sparse_mla_bwd_fake,
}
