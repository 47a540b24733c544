"""Fake of ``glm53::swiglu``: gate's shape and dtype, contiguous."""

from __future__ import annotations

__all__ = ["FAKES", "swiglu_fake"]


def swiglu_fake(gate, up, limit, mode):
    """Outputs of ``glm53::swiglu`` as empty tensors: shapes, dtypes, strides, no data."""
    return gate.new_empty(gate.shape)


FAKES = {
    "glm53::swiglu": swiglu_fake,
}
