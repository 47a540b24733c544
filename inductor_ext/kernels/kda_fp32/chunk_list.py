"""The chunk list of the FP32 KDA kernels: which (document, chunk) each chunk slot holds.

Chunks of ``CHUNK`` = 64 tokens restart at every document start. The list's length comes from static
shapes: the kernels run :func:`inductor_ext.ops.kda_reference.chunk_count` programs per head
(``ceil(T/64) + N − 1`` when cu_seqlens packs N documents, an upper bound; ``B·ceil(T/64)``
otherwise) over ``chunk_slots`` = max(that, 1) slots of scratch. It is filled on the device, so nothing
synchronises with the host and the kernels capture into a CUDA graph; unused trailing slots carry
document -1. Slot s of head h is row block ``s·H + h`` of every chunk-major intermediate
``[slot, H, ...]``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from inductor_ext.ops.kda_reference import CHUNK

__all__ = ["chunk_list", "chunk_slot", "pow2"]


def pow2(n: int) -> int:
    """The power of two ≥ n, at least 16: a padded block size."""
    return max(16, triton.next_power_of_2(n))


@triton.jit
def chunk_slot(chunk_map, cu, i_s, i_h, H: tl.constexpr):
    """Chunk slot i_s of head i_h: rows r, valid rows, token indices, and the slot's scratch index."""
    doc = tl.load(chunk_map + 2 * i_s)
    i_t = tl.load(chunk_map + 2 * i_s + 1)
    live = doc >= 0  # unused trailing slots of the fixed-length chunk list carry doc = -1
    doc = tl.maximum(doc, 0)
    start = tl.load(cu + doc) + i_t.to(tl.int64) * 64
    n = tl.where(live, tl.minimum(tl.load(cu + doc + 1) - start, 64), 0)
    r = tl.arange(0, 64)
    return r, r < n, n, start + r.to(tl.int64), i_s.to(tl.int64) * H + i_h


@triton.jit
def _chunk_list_kernel(cu, chunk_map, first, N, n_slots, steps, C: tl.constexpr, BN: tl.constexpr,
                       BS: tl.constexpr):
    # one program: each document's first slot (a running prefix sum of its chunk counts of C tokens,
    # BN documents at a time), then per slot its document (the last one whose first slot is at most
    # the slot, by binary search over ``first``, which the program has just written) and its chunk
    total = tl.full([], 0, tl.int64)
    for d0 in range(0, N, BN):
        d = d0 + tl.arange(0, BN)
        m = d < N
        nch = tl.where(m, (tl.load(cu + d + 1, mask=m, other=0) - tl.load(cu + d, mask=m, other=0) + C - 1) // C, 0)
        tl.store(first + d, (total + tl.cumsum(nch, 0) - nch).to(tl.int32), mask=m)
        total += tl.sum(nch, 0)
    tl.debug_barrier()
    for s0 in range(0, n_slots, BS):
        s = s0 + tl.arange(0, BS)
        lo = tl.zeros([BS], dtype=tl.int32)
        hi = tl.zeros([BS], dtype=tl.int32) + N
        for _ in range(steps):
            mid = (lo + hi) // 2
            act = hi - lo > 1
            go = tl.load(first + mid, mask=act, other=0) <= s
            lo = tl.where(act & go, mid, lo)
            hi = tl.where(act & ~go, mid, hi)
        live = s < total
        m = s < n_slots
        tl.store(chunk_map + 2 * s, tl.where(live, lo, -1), mask=m)
        tl.store(chunk_map + 2 * s + 1, tl.where(live, s - tl.load(first + lo, mask=m & live, other=0), 0), mask=m)


def chunk_list(cu: torch.Tensor, n_slots: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Device-side, fixed length: (document, chunk) per slot ``[n_slots, 2]`` int32 (document -1 =
    unused slot) and each document's first slot ``[N]`` int32, for documents at the int64 offsets
    ``cu`` ``[N+1]``. One kernel, no host synchronisation."""
    N = cu.numel() - 1
    chunk_map = torch.empty(n_slots, 2, device=cu.device, dtype=torch.int32)
    first = torch.empty(N, device=cu.device, dtype=torch.int32)
    _chunk_list_kernel[(1,)](cu, chunk_map, first, N, n_slots, max(N - 1, 0).bit_length(), C=CHUNK,
                             BN=min(pow2(N), 1024), BS=min(pow2(n_slots), 1024), num_warps=4)
    return chunk_map, first
