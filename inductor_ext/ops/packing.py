"""Index arithmetic of packed documents, shared by the layers (``graphs/``) and the reference kernels."""

from __future__ import annotations

import torch

__all__ = ["segment_of", "document_positions"]


def segment_of(bounds: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """Segment of each ``index`` under sorted int64 boundaries ``bounds [N+1]`` (``bounds[0] <= index``):
    the ``i`` with ``bounds[i] <= index < bounds[i+1]``, int64 like ``index``, clamped to ``0 .. N-1``.
    Static shapes, no host sync.

    It searches the whole ``bounds`` tensor, never a slice such as ``cu_seqlens[1:]``: Inductor's
    Triton ``searchsorted`` ignored a sliced boundary tensor's offset before torch 2.12
    (pytorch/pytorch#182343; on torch 2.11 that put every token of the first document of a compiled
    h200 KDA layer at the wrong position on the H200)."""
    return (torch.searchsorted(bounds, index, right=True) - 1).clamp(0, bounds.shape[0] - 2)


def document_positions(cu_seqlens: torch.Tensor | None, num_tokens: int, device) -> torch.Tensor:
    """Position of every packed token inside its document, int64 ``[T]`` (no host sync)."""
    tok = torch.arange(num_tokens, device=device, dtype=torch.int64)
    if cu_seqlens is None:
        return tok
    return tok - cu_seqlens[segment_of(cu_seqlens, tok)]
