"""Zero the entries of a chunk-local ``[B,T,H,64]`` matrix above each chunk's diagonal (CUDA).

flash-linear-attention allocates ``Aqk`` with ``torch.empty`` and writes only its causal part
(column ``j`` <= row ``i`` inside each 64-token chunk); ``glm53::kda_chunk`` returns it as a
residual, so the rest must be defined: zero, as in the CPU reference. The kernel only stores
zeros (no reads): one program per (chunk, batch, block of up to 16 heads) walks the chunk's 64
token rows, each a contiguous run of 16 heads × 64 columns (token-major layout) stored with its
upper-triangle mask; chunks restart at every document start. The H200 timings against the other
forms tried: ``docs/kda.md`` (Aqk zeroing).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["zero_above_chunk_diagonal"]


@triton.jit
def _zero_above_diagonal_kernel(a_ptr, chunk_indices, cu_seqlens, T, H: tl.constexpr, HB: tl.constexpr,
                                BT: tl.constexpr, IS_VARLEN: tl.constexpr):
    i_c, i_bh = tl.program_id(0), tl.program_id(1)
    i_b, h0 = i_bh // (H // HB), (i_bh % (H // HB)) * HB
    if IS_VARLEN:
        i_n = tl.load(chunk_indices + 2 * i_c)
        i_t = tl.load(chunk_indices + 2 * i_c + 1)
        valid = i_n >= 0  # fixed-shape chunk list: unused slots carry i_n = -1
        safe_n = tl.where(valid, i_n, 0)
        start = tl.load(cu_seqlens + safe_n).to(tl.int64) + i_t * BT
        end = tl.where(valid, tl.load(cu_seqlens + safe_n + 1).to(tl.int64), start)
    else:
        start = i_c.to(tl.int64) * BT
        end = T
    j = tl.arange(0, HB * BT)  # head h0 + j // BT, column j % BT
    zeros = tl.zeros([HB * BT], dtype=a_ptr.dtype.element_ty)
    for r in range(BT):
        row = start + r
        ptr = a_ptr + ((i_b * T + row) * H + h0) * BT + j
        tl.store(ptr, zeros, mask=((j % BT) > r) & (row < end))


def _head_block(H: int) -> int:
    hb = 1
    while hb < 16 and H % (2 * hb) == 0:
        hb *= 2
    return hb


def zero_above_chunk_diagonal(a: torch.Tensor, chunk_indices: torch.Tensor | None,
                              cu_seqlens: torch.Tensor | None) -> torch.Tensor:
    """In place on contiguous ``a [B,T,H,BT]``; ``chunk_indices [NT,2]`` (document, chunk) rows of
    the packed layout (-1 = unused slot) with ``cu_seqlens``, or both None for unpacked batches."""
    B, T, H, BT = a.shape
    varlen = cu_seqlens is not None
    n_chunks = chunk_indices.shape[0] if varlen else triton.cdiv(T, BT)
    hb = _head_block(H)
    if n_chunks and B * H:
        _zero_above_diagonal_kernel[(n_chunks, B * (H // hb))](
            a, chunk_indices if varlen else a, cu_seqlens if varlen else a, T, H=H, HB=hb, BT=BT,
            IS_VARLEN=varlen, num_warps=8)
    return a
