"""Differentiable collectives of context parallelism, traceable by torch.compile (``docs/DESIGN.md`` §8).

Every function here is built on ``torch.distributed._functional_collectives`` (the
``_c10d_functional`` ops): the process group is named by its ``group_name`` string (a constant of
the graph, so Dynamo traces the call instead of breaking on a ``ProcessGroup`` object), the result
is waited on inside the graph, and nothing reads data back to the host. The same code runs on gloo
(CPU tensors) and NCCL (CUDA tensors); with NCCL the collectives are plain stream work, so a
compiled region holding them can be captured into a CUDA graph.

Autograd: ``_c10d_functional.all_gather_into_tensor`` carries its own backward, a sum
reduce-scatter, so a rank's gradient of its contribution is the sum over ranks of the gradients of
the gathered copy. That is the gradient of the global loss when every rank's loss is the sum of its
local terms (sum the per-rank losses, never average them, to keep the single-rank gradient).

Shard order: rank ``r`` holds ``n`` equal shards of the global token axis, its local tensor is the
concatenation of its shards in the order of :attr:`CPContext.shards`. ``gather_shards`` returns all
``world·n`` shards in global order; ``all_gather_tokens`` returns the global token axis.
"""

from __future__ import annotations

import torch
import torch.distributed._functional_collectives as funcol

__all__ = ["all_gather", "gather_shards", "all_gather_tokens"]


def all_gather(x: torch.Tensor, group_name: str) -> torch.Tensor:
    """All-gather along dim 0 in rank order: ``[n, ...]`` → ``[world·n, ...]`` (same dtype/device).

    One ``_c10d_functional.all_gather_into_tensor`` + ``wait_tensor``; differentiable (backward:
    sum reduce-scatter). ``x`` is made contiguous first (the collective needs a dense buffer).
    """
    return funcol.all_gather_single(x.contiguous(), 0, group_name)


def gather_shards(x: torch.Tensor, group_name: str, world: int, order: torch.Tensor | None) -> torch.Tensor:
    """The local shards ``x [n, ...]`` of every rank in global shard order, ``[world·n, ...]``.

    ``order`` (int64 ``[world·n]``, :attr:`CPContext.shard_order`) maps global shard ``j`` to its
    row in the rank-major gather; ``None`` means rank-major already is global order (contiguous
    layout). Bytes received per rank: ``world·x.nbytes``. Differentiable.
    """
    out = all_gather(x, group_name)
    return out if order is None else out.index_select(0, order)


def all_gather_tokens(x: torch.Tensor, group_name: str, world: int, num_shards: int, dim: int = 0) -> torch.Tensor:
    """Local tokens ``x`` (``dim`` of length ``num_shards·L``) of every rank → the global token axis.

    ``num_shards`` = 1 (contiguous: rank r holds global shard r) or 2 (zigzag: rank r holds shards
    r and 2·world−1−r, in that order). The gather is one all-gather along dim 0; the zigzag reorder
    is a static view + flip + cat. Differentiable (backward: reduce-scatter of the gradient in the
    same order). Bytes received per rank: ``world·x.nbytes``.
    """
    if dim != 0:
        return all_gather_tokens(x.movedim(dim, 0), group_name, world, num_shards, 0).movedim(0, dim)
    out = all_gather(x, group_name)  # [world·n·L, ...] rank-major
    if num_shards == 1:
        return out
    L = x.shape[0] // 2
    parts = out.view(world, 2, L, *x.shape[1:])
    # first halves: shards 0..W-1 in rank order; second halves: shard 2W-1-r, so ranks reversed
    return torch.cat([parts[:, 0].reshape(world * L, *x.shape[1:]),
                      parts[:, 1].flip(0).reshape(world * L, *x.shape[1:])], 0)
