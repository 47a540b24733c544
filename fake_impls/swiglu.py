"""Fake of ``glm53::swiglu``: gate's shape and dtype, contiguous."""

from __future__ import annotations

import torch

import inductor_ext.ops.swiglu  # noqa: F401  (defines the op)

__all__ = ["swiglu_fake"]


@torch.library.register_fake("glm53::swiglu")
def swiglu_fake(gate, up, limit, mode):
    """Outputs of ``glm53::swiglu`` as empty tensors: shapes, dtypes, strides, no data."""
    return gate.new_empty(gate.shape)
