"""Fake of ``glm53::fp8_qdq``: (x's shape and dtype, FP32 scales ``[..., D/128]``), contiguous."""

from __future__ import annotations

import torch

from inductor_ext.ops.fp8_qdq_reference import GROUP

__all__ = ["FAKES", "fp8_qdq_fake"]


def fp8_qdq_fake(x, scale_fmt):
    """Outputs of ``glm53::fp8_qdq`` as empty tensors: shapes, dtypes, strides, no data."""
    return x.new_empty(x.shape), x.new_empty((*x.shape[:-1], x.shape[-1] // GROUP), dtype=torch.float32)


FAKES = {
    "glm53::fp8_qdq": fp8_qdq_fake,
}
