"""Fake of ``glm53::fp32_linear``: FP32 ``[..., out_features]``, contiguous."""

from __future__ import annotations

import torch

__all__ = ["FAKES", "fp32_linear_fake"]


def fp32_linear_fake(x, weight, bias):
    """Outputs of ``glm53::fp32_linear`` as empty tensors: shapes, dtypes, strides, no data."""
    return x.new_empty((*x.shape[:-1], weight.shape[0]), dtype=torch.float32)


FAKES = {
    "glm53::fp32_linear": fp32_linear_fake,
}
