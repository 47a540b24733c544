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

__all__ = ["ordered_sum", "ordered_max", "ordered_softmax", "positionwise"]

_CPU_LOOP = 64  # floats: a multiple of any CPU vector loop's step (2 x 16 lanes with AVX-512)
_CPU_GRAIN = 32768  # elements: at most this many run as one serial loop (torch's GRAIN_SIZE)


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
    """Softmax over the last (short) dim: ``exp(t − max) / Σ exp(t − max)`` with the ordered max and
    sum, the exp :func:`positionwise`."""
    e = positionwise(torch.exp, t - ordered_max(t, -1, keepdim=True))
    return e / ordered_sum(e, -1, keepdim=True)


def positionwise(fn, t: torch.Tensor) -> torch.Tensor:
    """``fn(t)`` for an elementwise torch function, each element's result independent of where it
    sits in ``t``. On the CPU torch's vectorized loops finish a tensor (or a thread's share of it)
    with a scalar loop, whose exp / sigmoid round differently from the vector lanes, so a row's
    result could depend on how many rows share the call. Here each last-dim row is zero-padded to a
    multiple of the vector step and the rows go in serial slices: every element takes the vector
    path. Other devices: ``fn(t)``."""
    if t.device.type != "cpu" or t.numel() == 0:
        return fn(t)
    n = t.shape[-1]
    rows = torch.nn.functional.pad(t.reshape(-1, n), (0, (-n) % _CPU_LOOP))
    step = max(1, _CPU_GRAIN // rows.shape[1])
    return torch.cat([fn(part) for part in rows.split(step)])[:, :n].reshape(t.shape)
