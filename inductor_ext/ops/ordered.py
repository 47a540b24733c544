"""Reductions over a short dim (mHC streams, top-k slots, Sinkhorn rows) as chains of elementwise
ops in index order.

A reduction kernel may split, vectorize or tree-reduce a dim of 4 or 8 differently by the shape of
the other dims (how many rows share the call); a chain of elementwise adds runs the same roundings
for every row whatever the shape, on every device, eager or under Inductor (which fuses the chain
into one pointwise kernel). Used by the ``batch_invariant`` paths (``docs/DESIGN.md`` §9); plain
torch, differentiable.
"""

from __future__ import annotations

import torch

__all__ = ["ordered_sum", "ordered_max", "ordered_softmax"]


def ordered_sum(t: torch.Tensor, dim: int, keepdim: bool = False) -> torch.Tensor:
    """``t.sum(dim)`` as ``((t₀ + t₁) + t₂) + …`` in index order."""
    parts = t.unbind(dim)
    out = parts[0]
    for part in parts[1:]:
        out = out + part
    return out.unsqueeze(dim) if keepdim else out


def ordered_max(t: torch.Tensor, dim: int, keepdim: bool = False) -> torch.Tensor:
    """``t.amax(dim)`` as a chain of ``torch.maximum`` (exact in any order; a chain for symmetry)."""
    parts = t.unbind(dim)
    out = parts[0]
    for part in parts[1:]:
        out = torch.maximum(out, part)
    return out.unsqueeze(dim) if keepdim else out


def ordered_softmax(t: torch.Tensor) -> torch.Tensor:
    """Softmax over the last (short) dim: ``exp(t − max) / Σ exp(t − max)`` with the ordered max and sum."""
    e = torch.exp(t - ordered_max(t, -1, keepdim=True))
    return e / ordered_sum(e, -1, keepdim=True)
