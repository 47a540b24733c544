"""Fake of ``glm53::round_to``: x's shape, FP32, contiguous."""

from __future__ import annotations

import torch

from inductor_ext.ops.round_to_reference import validate_round_to_inputs

__all__ = ["FAKES", "round_to_fake"]


def round_to_fake(x, dtype):
    """Output of ``glm53::round_to`` as an empty tensor: x's shape, FP32. Validates like the
    kernel: under Inductor only the fake and the lowering run."""
    validate_round_to_inputs(x, dtype)
    return torch.empty(x.shape, dtype=torch.float32, device=x.device)


FAKES = {
    "glm53::round_to": round_to_fake,
}
