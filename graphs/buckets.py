"""Length buckets for CUDA-graph capture: a packed batch padded to a multiple of a token count.

A compiled model serves every length with one graph (``docs/DESIGN.md`` §11), but a CUDA graph is
captured for one set of shapes. :func:`pad_to_bucket` rounds a packed batch up to the next multiple
of ``multiple`` tokens by appending one padding document, so a capturing run sees few lengths.
Documents never read each other (every layer restarts at a document start), so the real tokens'
logits are the unpadded batch's; bitwise under ``PrecisionConfig.batch_invariant`` (every reduction
independent of the row count), within the kernels' row-count dependence otherwise. Host-side, before
the compiled call: it reads the token count as a Python int.
"""

from __future__ import annotations

import torch

__all__ = ["pad_to_bucket"]


def pad_to_bucket(input_ids: torch.Tensor, cu_seqlens: torch.Tensor | None, multiple: int, *,
                  pad_id: int = 0) -> tuple[torch.Tensor, torch.Tensor, int]:
    """``(input_ids, cu_seqlens, num_tokens)``: the batch padded to ``ceil(T / multiple) · multiple``
    tokens with one extra document of ``pad_id`` tokens (none when T is a multiple already), and the
    real token count T. Drop the padding with ``logits[..., :num_tokens, :]``.

    Args:
        input_ids: int64 ``[T]`` or ``[1, T]``.
        cu_seqlens: int ``[N+1]`` document offsets (0 … T), or None for one document.
        multiple: bucket size in tokens, an int >= 1.
        pad_id: token id of the padding (any valid id: its logits are dropped).
    """
    if isinstance(multiple, bool) or not isinstance(multiple, int) or multiple < 1:
        raise ValueError(f"pad_to_bucket: multiple must be an int >= 1, got {multiple!r}")
    if not isinstance(input_ids, torch.Tensor) or input_ids.dtype != torch.int64 or input_ids.dim() not in (1, 2) \
            or (input_ids.dim() == 2 and input_ids.shape[0] != 1):
        raise ValueError("pad_to_bucket: input_ids must be an int64 tensor [T] or [1, T]")
    T = input_ids.shape[-1]
    if cu_seqlens is None:
        cu_seqlens = torch.tensor([0, T], device=input_ids.device)
    if not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.dim() != 1 or cu_seqlens.dtype not in (
            torch.int32, torch.int64):
        raise ValueError("pad_to_bucket: cu_seqlens must be an int32 or int64 tensor [N+1]")
    cu = cu_seqlens.to(torch.int64)
    padded = -(-T // multiple) * multiple
    if padded == T:
        return input_ids, cu, T
    pad = torch.full((*input_ids.shape[:-1], padded - T), pad_id, dtype=input_ids.dtype, device=input_ids.device)
    end = torch.tensor([padded], dtype=torch.int64, device=cu.device)
    return torch.cat([input_ids, pad], -1), torch.cat([cu, end]), T
