"""Triton causal group selection + token expansion of ``glm53::kpool_select`` (CUDA).

One program per query row: the top ``nsel = min(topk/P, q_n)`` pools among the visible slots
``[q_lo, q_lo + q_n)``, found without sorting the row:

1. threshold: the nsel-th largest score, as an order-preserving 32-bit key, built 4 bits at a time
   (8 counting passes over the visible slots; skipped when every visible pool is selected);
2. collection: slots above the threshold, plus the first (lowest-index) slots equal to it until
   nsel are taken, are compacted into a per-row scratch row of 64-bit keys
   ``(score key << 32) | (2^32 - 1 - slot)``;
3. the scratch row is sorted descending (``tl.sort``), so the output lists pools by descending
   score and, among equal scores, lower pool index first. ``-0.0`` counts as ``+0.0``.

The CPU reference uses ``torch.topk``, whose order among exactly equal scores is unspecified: token
sets agree whenever the nsel-th and (nsel+1)-th best visible scores differ; with an exact tie at
that boundary both pick pools of the same scores (the tests check both properties).
Cost: 10 passes over the q_n visible scores per row; fine for the 2K–16K pools of current contexts, not tuned further.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["kpool_select_fwd"]

_I64_MIN = tl.constexpr(-(2**63))


@triton.jit
def _score_key(v):
    """Order-preserving int64 key in [0, 2^32) of FP32 scores (integer order = float order)."""
    b = v.to(tl.int32, bitcast=True)
    k = tl.where(b < 0, b ^ 0x7FFFFFFF, b)
    k = tl.where(v == 0.0, 0, k)
    return k.to(tl.int64) + 0x80000000


@triton.jit
def _kpool_select_kernel(
    logits_ptr, stride_lm, stride_ls, q_lo_ptr, q_n_ptr, tail_start_ptr, tail_len_ptr,
    out_ptr, scratch_ptr, W, K, TOPK,
    P: tl.constexpr, PP: tl.constexpr, TP: tl.constexpr, KP: tl.constexpr,
    COMPACT: tl.constexpr, BLOCK: tl.constexpr, W_CHUNKS,
):
    row = tl.program_id(0).to(tl.int64)
    q_lo = tl.load(q_lo_ptr + row)
    q_n = tl.load(q_n_ptr + row)
    t_start = tl.load(tail_start_ptr + row)
    t_len = tl.load(tail_len_ptr + row)
    nsel = tl.minimum(q_n, K)
    lrow = logits_ptr + row * stride_lm + q_lo * stride_ls
    offs = tl.arange(0, BLOCK)
    n_chunks = (q_n + BLOCK - 1) // BLOCK  # visible slots only

    # 1. threshold key tau: the largest t with #(key >= t) >= nsel; -1 takes every visible slot
    tau = tl.zeros((), tl.int64) - 1
    if q_n > K:
        tau = tau + 1
        digit = tl.arange(0, 16).to(tl.int64)
        for level in range(8):  # 4 bits per pass, counting all 16 candidates at once
            cand = tau | (digit << (28 - 4 * level))
            cnt = tl.zeros((16,), tl.int32)
            for c in range(n_chunks):
                j = c * BLOCK + offs
                ok = j < q_n
                key = _score_key(tl.load(lrow + j * stride_ls, mask=ok, other=0.0))
                cnt += tl.sum((ok[:, None] & (key[:, None] >= cand[None, :])).to(tl.int32), axis=0)
            # counts fall with the digit; take the largest digit still keeping >= nsel slots
            best = tl.sum((cnt >= nsel).to(tl.int64), axis=0) - 1
            tau = tau | (best << (28 - 4 * level))
    # 2. compact the selected slots; ties at tau go to the lowest slots
    n_gt = tl.zeros((), tl.int32)
    for c in range(n_chunks):
        j = c * BLOCK + offs
        ok = j < q_n
        key = _score_key(tl.load(lrow + j * stride_ls, mask=ok, other=0.0))
        n_gt += tl.sum((ok & (key > tau)).to(tl.int32), axis=0)
    need_eq = nsel - n_gt
    seen_eq = tl.zeros((), tl.int32)
    taken = tl.zeros((), tl.int32)
    for c in range(n_chunks):
        j = c * BLOCK + offs
        ok = j < q_n
        key = _score_key(tl.load(lrow + j * stride_ls, mask=ok, other=0.0))
        eq = (ok & (key == tau)).to(tl.int32)
        sel = (ok & (key > tau)) | ((eq != 0) & (seen_eq + tl.cumsum(eq, axis=0) <= need_eq))
        pos = taken + tl.cumsum(sel.to(tl.int32), axis=0) - 1
        # signed 64-bit order = (score, then lower slot) descending
        packed = ((key - 0x80000000) << 32) | (0xFFFFFFFF - j.to(tl.int64))
        tl.store(scratch_ptr + row * KP + pos, packed, mask=sel)
        seen_eq += tl.sum(eq, axis=0)
        taken += tl.sum(sel.to(tl.int32), axis=0)
    tl.debug_barrier()
    # 3. sort the nsel packed keys, expand each pool to its P tokens
    kj = tl.arange(0, KP)
    packed = tl.load(scratch_ptr + row * KP + kj, mask=kj < nsel, other=_I64_MIN)
    packed = tl.sort(packed, descending=True)
    slot = 0xFFFFFFFF - (packed & 0xFFFFFFFF)
    first = (t_start - P * q_n) + P * slot  # document start + P·pool index
    i = tl.arange(0, PP)
    orow = out_ptr + row * W
    tokens = first[:, None] + i[None, :]
    tl.store(orow + kj[:, None] * P + i[None, :], tokens.to(tl.int32),
             mask=(kj < nsel)[:, None] & (i < P)[None, :])
    # tail tokens (or -1) at base .. base+P-2, -1 everywhere else
    if COMPACT:
        base = nsel * P
    else:
        base = nsel * 0 + TOPK
    jt = tl.arange(0, TP)
    tail = tl.where(jt < t_len, t_start + jt, -1)
    tl.store(orow + base + jt, tail.to(tl.int32), mask=jt < P - 1)
    for c in range(W_CHUNKS):
        col = c * BLOCK + offs
        pad = (col < W) & (col >= nsel * P) & ((col < base) | (col >= base + P - 1))
        tl.store(orow + col, tl.full((BLOCK,), -1, tl.int32), mask=pad)


def kpool_select_fwd(logits, q_lo, q_n, tail_start, tail_len, topk: int, pool_size: int, tail: str,
                     block: int = 256):
    """Selected token ids int32 ``[M, topk + P - 1]`` (see :func:`inductor_ext.ops.kpool.kpool_select`).

    Args:
        logits: ``[M, S]`` fp32, any strides (the scorer's padded workspace view).
        q_lo, q_n, tail_start, tail_len: ``[M]`` int64 rows of ``kpool_layout``.
        topk, pool_size, tail: as the op. A scratch ``[M, next_pow2(min(topk/P, S))]`` int64 buffer
        is allocated from static shapes.
    """
    M, S = logits.shape
    P = pool_size
    W = topk + P - 1
    K = min(topk // P, S)
    KP = max(16, triton.next_power_of_2(K))
    out = torch.empty(M, W, dtype=torch.int32, device=logits.device)
    if M == 0:
        return out
    scratch = torch.empty(M, KP, dtype=torch.int64, device=logits.device)
    block = min(block, max(16, triton.next_power_of_2(max(S, W))))
    q_lo, q_n, tail_start, tail_len = (t.contiguous() for t in (q_lo, q_n, tail_start, tail_len))
    _kpool_select_kernel[(M,)](
        logits, logits.stride(0), logits.stride(1), q_lo, q_n, tail_start, tail_len, out, scratch,
        W, K, topk, P=P, PP=triton.next_power_of_2(P), TP=triton.next_power_of_2(max(P - 1, 1)), KP=KP,
        COMPACT=tail == "compact", BLOCK=block, W_CHUNKS=triton.cdiv(W, block), num_warps=4)
    return out
