"""Fake of ``glm53::round_to``: x's shape, FP32, contiguous."""

from __future__ import annotations

import torch

import inductor_ext.ops.round_to  # noqa: F401  (defines the op)

__all__ = ["round_to_fake"]


@torch.library.register_fake("glm53::round_to")
def round_to_fake(x, dtype):
    """Output of ``glm53::round_to`` as an empty tensor: x's shape, FP32."""
    return torch.empty(x.shape, dtype=torch.float32, device=x.device)
