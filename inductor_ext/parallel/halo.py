"""Halo exchange for the KDA layer's short causal convolution under context parallelism
(``docs/DESIGN.md`` §8).

The depthwise causal convolution (kernel 4) reads the 3 tokens before each token. The first tokens
of a shard therefore need the last 3 tokens of the previous GLOBAL shard (held by another rank, or
by this rank's other shard in the zigzag layout), unless a document starts in between.
"""

from __future__ import annotations

import torch

from inductor_ext.parallel.context import CPContext

__all__ = ["halo_exchange", "with_halo"]


def halo_exchange(x: torch.Tensor, cp: CPContext, width: int = 3) -> torch.Tensor:
    """The ``width`` tokens before each local shard, ``[n_local, width, ...]`` in x's dtype.

    Args:
        x: local tokens ``[T_local, ...]`` (local shards concatenated, :attr:`CPContext.shards`).
        cp: the context; width: halo length (kernel − 1), at most the shard length.

    Row ``i`` of local shard ``j``'s halo is global token ``start_j − width + i``, taken from the
    tail of global shard ``j − 1``; it is zero when that token lies before the start of the
    document holding shard ``j``'s first token (a document start in between, or ``j = 0``).
    Communication: one all-gather of every shard's last ``width`` rows (each rank receives
    ``S·width`` rows, S = global shard count); differentiable (backward: reduce-scatter). No host
    sync; the result is bitwise the rows the single-rank convolution reads.
    """
    n, L = len(cp.shards), cp.shard_len
    if not 0 < width <= L:
        raise ValueError(f"halo_exchange: width must be in 1..shard_len={L}, got {width}")
    if x.shape[0] != n * L:
        raise ValueError(f"halo_exchange: x must hold T_local={n * L} local tokens, got shape {tuple(x.shape)}")
    rest = x.shape[1:]
    tails = x.reshape(n, L, *rest)[:, L - width:]
    prev = cp.gather_shards(tails).index_select(0, (cp.shard_global - 1).clamp_min(0))
    tok = cp.shard_start[:, None] - width + torch.arange(width, device=cp.shard_start.device)
    valid = (tok >= cp.shard_doc_start[:, None]).view(n, width, *([1] * len(rest)))
    return torch.where(valid, prev, torch.zeros((), dtype=x.dtype, device=x.device))


def with_halo(x: torch.Tensor, halo: torch.Tensor) -> torch.Tensor:
    """``[n_local·(width + L), ...]``: each local shard preceded by its halo rows (so a causal
    window over the result reads the halo where the single-rank window reads the previous shard)."""
    n, width = halo.shape[:2]
    L = x.shape[0] // n
    return torch.cat([halo, x.reshape(n, L, *x.shape[1:])], 1).reshape(n * (width + L), *x.shape[1:])
