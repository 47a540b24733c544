"""Fake of ``glm53::fp32_linear``: FP32 ``[..., out_features]``, contiguous."""

from __future__ import annotations

import torch

import inductor_ext.ops.fp32_linear  # noqa: F401  (defines the op)

__all__ = ["fp32_linear_fake"]


@torch.library.register_fake("glm53::fp32_linear")
def fp32_linear_fake(x, weight, bias):
    """Outputs of ``glm53::fp32_linear`` as empty tensors: shapes, dtypes, strides, no data."""
    return x.new_empty((*x.shape[:-1], weight.shape[0]), dtype=torch.float32)
