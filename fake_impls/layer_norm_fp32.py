"""Fake of ``glm53::layer_norm_fp32``: x's shape and dtype, contiguous."""

from __future__ import annotations

import torch

import inductor_ext.ops.layer_norm_fp32  # noqa: F401  (defines the op)

__all__ = ["layer_norm_fp32_fake"]


@torch.library.register_fake("glm53::layer_norm_fp32")
def layer_norm_fp32_fake(x, weight, bias, eps):
    """Outputs of ``glm53::layer_norm_fp32`` as empty tensors: shapes, dtypes, strides, no data."""
    return x.new_empty(x.shape)
