"""Triton causal group selection + token expansion of ``glm53::kpool_select`` (CUDA).

One program per query row picks the top ``nsel = min(K, q_n)`` pools (``K = topk/P``) among the
visible slots ``[q_lo, q_lo + q_n)``. A score becomes an int32 key whose integer order is the float
order (sign-magnitude to two's complement: ``-0.0`` and ``+0.0`` are both 0); a pool's sort key is
the exact float64 integer ``key·2^21 + 2^21-1-slot``, so sorting descending lists pools by
descending score and, among equal scores, lower slot first.

- ``q_n <= K``: every visible pool is selected; its sort keys go straight to the sort.
- otherwise the visible scores are read once into registers, an ``[L, B/L]`` block of the L threads
  (B = the resident block that holds q_n: BLOCK = next_pow2(S) capped at MAX_BLOCK, or BLOCK/2;
  slots past MAX_BLOCK are re-read on every pass):
  1. threshold ``tau`` = the nsel-th largest key, by bisection of [min key, max key]: each step one
     compare + select + add per resident key and one block sum; at most 32 steps, ending early as
     soon as exactly nsel keys reach the probe (then those are the answer);
  2. the slots of the keys >= tau (or > tau when ties at tau straddle the cut) go to a per-row
     scratch row at distinct ranks: running counts along each thread's registers plus one scan
     over the threads. Ranks need not follow slot order, the sort fixes the order;
  3. only when ties straddle the cut, one more pass over the row appends the lowest slots whose key
     is tau (a prefix scan in slot order) until nsel are taken.
- the <= KP = next_pow2(K) sort keys (gathered again by slot) are sorted by ``tl.sort``; each pool
  expands to its P tokens, then the tail tokens and -1 padding (``compact``: tail right after the
  pools; ``fixed``: at columns topk .. topk+P-2).

Cost per row: one read of the q_n visible scores (from L2 again for the sort keys and the rare tie
pass); 11-18 bisection steps on continuous scores, 32 at most, each about 3 instructions per key
row of a thread and one block reduction (one warp per row up to 2048 pools; 4 warps from 2049 to
8192, 32-64 keys per thread; one per 2048 resident pools beyond, and more when KP > 512); one scatter
pass; a bitonic sort of KP keys (log2(KP)·(log2(KP)+1)/2 compare-exchange steps: on the H200 at
KP = 512 and 4096 pools, 35 % of the kernel at 4 warps, 37 % at one); the write of
``topk + P - 1`` ids. A row is a chain of dependent steps, so the kernel is latency-bound: the
register cap (:func:`_register_cap`) sets how many rows share an SM (H200, 4096 pools: 481 µs at
168 registers, 387 µs at 56). Static shapes only, no host sync; S <= 2^21 pools.

The CPU reference (``torch.topk``) leaves the order among equal scores unspecified: token sets
agree unless the nsel-th and (nsel+1)-th best scores tie, and then both pick pools of the same
scores. NaN scores are not supported.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["kpool_select_fwd"]

ONE_WARP = 2048  # up to 2048 pools per row: one warp, up to 64 register-resident keys per thread
MIN_WARPS_WIDE = 4  # wider rows: at least 4 warps (H200, 4096 pools, top-512: 1 warp 653 us, 2: 551, 4: 481, 8: 726)
MAX_BLOCK = 32768  # wider rows: one warp per 2048 resident pools; slots past MAX_BLOCK are re-read
ONE_WARP_REGS = 128  # H200, 2048 pools: 164 us at 128 registers per thread, 188 at 168, 172-181 at 80-104
REG_HEADROOM = 24  # wider rows: registers = resident keys per thread + 24 (H200: 4096 pools, 4 warps: 481 us
# at 168 registers, 387 at 56; 8192 pools, 4 warps: 1751 us at 168, 1313 at 88, 1301-1303 at 80 and 96)
_NONE = tl.constexpr(-(2**31))  # key of slots past q_n (no score has it)
_I32_MAX = tl.constexpr(2**31 - 1)
_SLOTS = tl.constexpr(2**21)  # sort keys: exact float64 integers key·2^21 + 2^21-1-slot


@triton.jit
def _load_keys(lrow, stride_ls, j, q_n):
    """int32 keys of slots j: integer order = float order, -0.0 = +0.0 = 0; _NONE past q_n."""
    ok = j < q_n
    b = tl.load(lrow + j * stride_ls, mask=ok, other=0.0).to(tl.int32, bitcast=True)
    return tl.where(ok, tl.where(b < 0, -(b & 0x7FFFFFFF), b), _NONE)


@triton.jit
def _block_keys(lrow, stride_ls, start, q_n, B: tl.constexpr, L: tl.constexpr):
    """Keys and slots ``start + lane + L·r`` as ``[L, B/L]`` tensors: L = 32·num_warps threads
    along dim 0 (coalesced loads), each holding B/L keys along dim 1."""
    j = start + tl.arange(0, L)[:, None] + tl.arange(0, B // L)[None, :] * L
    return _load_keys(lrow, stride_ls, j, q_n), j


@triton.jit
def _sort_key(key, slot):
    """float64 integer ordered by (score, then lower slot): one compare per bitonic step."""
    return key.to(tl.float64) * _SLOTS - slot.to(tl.float64) + (_SLOTS - 1)


@triton.jit
def _count_ge(keys, t, one, lrow, stride_ls, q_n, B: tl.constexpr, C: tl.constexpr, L: tl.constexpr,
              LONG: tl.constexpr):
    """#(visible keys >= t), t > _NONE; keys = slots [0, B), slots >= B re-read C at a time if LONG.
    ``one`` is a runtime 1: summing it, not the bool, compiles to compare + select + add."""
    c = tl.sum(tl.where(keys >= t, one, 0))
    if LONG:
        for start in range(B, q_n, C):
            more, _ = _block_keys(lrow, stride_ls, start, q_n, C, L)
            c += tl.sum(tl.where(more >= t, one, 0))
    return c


@triton.jit
def _scatter(keys, j, t, srow, n0, nsel):
    """Write the slots j of ``keys >= t`` to srow[n0 + rank], ranks distinct but not in slot
    order: running count along dim 1 (a thread's registers), then across the threads."""
    sel = (keys >= t).to(tl.int32)
    lane_n = tl.sum(sel, axis=1)
    pos = n0 + (tl.cumsum(lane_n, axis=0) - lane_n)[:, None] + tl.cumsum(sel, axis=1) - 1
    tl.store(srow + pos, j, mask=(sel != 0) & (pos < nsel))
    return n0 + tl.sum(lane_n, axis=0)


@triton.jit
def _select_top(lrow, stride_ls, q_n, nsel, srow, one, B: tl.constexpr, C: tl.constexpr, L: tl.constexpr,
                LONG: tl.constexpr):
    """Steps 1-2 for q_n > nsel visible slots (resident block B, the rest re-read C at a time if
    LONG). Returns (tau, #keys > tau, whether ties at tau straddle the cut: then only the keys >
    tau were written)."""
    keys, j = _block_keys(lrow, stride_ls, 0, q_n, B, L)
    lo = tl.min(tl.where(keys == _NONE, _I32_MAX, keys))
    hi = tl.max(keys)
    if LONG:
        for start in range(B, q_n, C):
            more, _ = _block_keys(lrow, stride_ls, start, q_n, C, L)
            lo = tl.minimum(lo, tl.min(tl.where(more == _NONE, _I32_MAX, more)))
            hi = tl.maximum(hi, tl.max(more))
    # invariant: tau in [lo, hi], c_lo = #(keys >= lo), n_above = #(keys > hi); int64: no overflow
    lo = lo.to(tl.int64)
    hi = hi.to(tl.int64)
    c_lo = q_n
    n_above = q_n * 0
    while lo < hi:
        mid = lo + ((hi - lo + 1) >> 1)
        c = _count_ge(keys, mid.to(tl.int32), one, lrow, stride_ls, q_n, B, C, L, LONG)
        up = c >= nsel  # on an exact hit the keys >= mid are the answer: stop there
        lo = tl.where(up, mid, lo)
        c_lo = tl.where(up, c, c_lo)
        hi = tl.where(c == nsel, mid, tl.where(up, hi, mid - 1))
        n_above = tl.where(up, n_above, c)
    tau = lo.to(tl.int32)
    straddle = c_lo > nsel
    t = tau + straddle.to(tl.int32)  # straddle: keys > tau only (|key| < 2^31 - 1 without NaN)
    n = _scatter(keys, j, t, srow, q_n * 0, nsel)
    if LONG:
        for start in range(B, q_n, C):
            more, jj = _block_keys(lrow, stride_ls, start, q_n, C, L)
            n = _scatter(more, jj, t, srow, n, nsel)
    return tau, n_above, straddle


@triton.jit
def _append_ties(lrow, stride_ls, q_n, nsel, tau, n_above, srow, C: tl.constexpr):
    """srow[n_above:nsel] <- the lowest slots whose key is tau (in slot order)."""
    n_eq = n_above * 0
    for start in range(0, q_n, C):
        j = start + tl.arange(0, C)
        keys = _load_keys(lrow, stride_ls, j, q_n)
        eq = (keys == tau).to(tl.int32)
        pos = n_above + n_eq + tl.cumsum(eq, axis=0) - 1
        tl.store(srow + pos, j, mask=(eq != 0) & (pos < nsel))
        n_eq += tl.sum(eq, axis=0)


@triton.jit
def _kpool_select_kernel(
    logits_ptr, stride_lm, stride_ls, q_lo_ptr, q_n_ptr, tail_start_ptr, tail_len_ptr,
    out_ptr, scratch_ptr, W, K, TOPK,
    P: tl.constexpr, PP: tl.constexpr, TP: tl.constexpr, KP: tl.constexpr,
    COMPACT: tl.constexpr, BLOCK: tl.constexpr, LEVELS: tl.constexpr, LONG: tl.constexpr,
    CHUNK: tl.constexpr, LANES: tl.constexpr, PAD: tl.constexpr, PAD_CHUNKS,
):
    row = tl.program_id(0).to(tl.int64)
    q_lo = tl.load(q_lo_ptr + row)
    q_n = tl.load(q_n_ptr + row).to(tl.int32)
    t_start = tl.load(tail_start_ptr + row)
    t_len = tl.load(tail_len_ptr + row)
    nsel = tl.minimum(q_n, K)
    lrow = logits_ptr + row * stride_lm + q_lo * stride_ls
    srow = scratch_ptr + row * KP
    kj = tl.arange(0, KP)
    slot = kj
    if q_n > K:
        level = 0  # the smallest block BLOCK >> level that holds q_n (level < LEVELS)
        for lv in tl.static_range(1, LEVELS):
            level += (q_n <= (BLOCK >> lv)).to(tl.int32)
        tau = nsel * 0
        n_above = nsel * 0
        straddle = nsel < 0
        one = (q_lo >= 0).to(tl.int32)  # 1, opaque to the compiler (see _count_ge)
        for lv in tl.static_range(LEVELS):
            if level == lv:
                tau, n_above, straddle = _select_top(lrow, stride_ls, q_n, nsel, srow, one,
                                                     BLOCK >> lv, CHUNK, LANES, LONG and lv == 0)
        if straddle:
            _append_ties(lrow, stride_ls, q_n, nsel, tau, n_above, srow, CHUNK)
        tl.debug_barrier()  # the scratch row is read back by other threads
        slot = tl.load(srow + kj, mask=kj < nsel, other=0)
    # else every visible pool is selected
    packed = tl.where(kj < nsel, _sort_key(_load_keys(lrow, stride_ls, slot, q_n), slot), -2.0**53)
    packed = tl.sort(packed, descending=True)
    # expand each pool to its P tokens: document start + P·slot + i
    slot = ((packed.to(tl.int64) & (_SLOTS - 1)) ^ (_SLOTS - 1)).to(tl.int32)
    first = (t_start - P * q_n).to(tl.int32) + P * slot
    i = tl.arange(0, PP)
    orow = out_ptr + row * W
    tokens = first[:, None] + i[None, :]
    tl.store(orow + kj[:, None] * P + i[None, :], tokens, mask=(kj < nsel)[:, None] & (i < P)[None, :])
    # tail tokens (or -1) at base .. base+P-2, -1 everywhere else
    if COMPACT:
        base = nsel * P
    else:
        base = nsel * 0 + TOPK
    jt = tl.arange(0, TP)
    tail = tl.where(jt < t_len, t_start + jt, -1)
    tl.store(orow + base + jt, tail.to(tl.int32), mask=jt < P - 1)
    offs = tl.arange(0, PAD)
    for c in range(nsel * P // PAD, PAD_CHUNKS):
        col = c * PAD + offs
        pad = (col < W) & (col >= nsel * P) & ((col < base) | (col >= base + P - 1))
        tl.store(orow + col, tl.full((PAD,), -1, tl.int32), mask=pad)


def _register_cap(block: int, kp: int, warps: int) -> int:
    """Registers per thread: few enough for many rows per SM (each row is a chain of dependent
    reductions, so rows in flight hide its latency), enough for the resident keys (int32) and
    the sort keys (float64) without spills."""
    if warps == 1:
        return ONE_WARP_REGS
    lanes = 32 * warps
    return min(255, max(block // lanes, 2 * kp // lanes) + REG_HEADROOM)


def kpool_select_fwd(logits, q_lo, q_n, tail_start, tail_len, topk: int, pool_size: int, tail: str,
                     block: int = 256):
    """Selected token ids int32 ``[M, topk + P - 1]`` (see :func:`inductor_ext.ops.kpool.kpool_select`).

    Args:
        logits: ``[M, S]`` fp32, any strides (the scorer's padded workspace view).
        q_lo, q_n, tail_start, tail_len: ``[M]`` int64 rows of ``kpool_layout``.
        topk, pool_size, tail: as the op.
        block: columns per store of the -1 padding.

    A scratch ``[M, next_pow2(min(topk/P, S))]`` int32 buffer is allocated from static shapes.
    """
    M, S = logits.shape
    if S > _SLOTS.value:
        raise ValueError(f"kpool_select: {S} pool slots, the Triton kernel takes at most {_SLOTS.value}")
    P = pool_size
    W = topk + P - 1
    K = min(topk // P, S)
    KP = max(16, triton.next_power_of_2(K))
    out = torch.empty(M, W, dtype=torch.int32, device=logits.device)
    if M == 0:
        return out
    scratch = torch.empty(M, KP, dtype=torch.int32, device=logits.device)
    BLOCK = min(max(32, triton.next_power_of_2(S)), MAX_BLOCK)
    levels = 2 if BLOCK // 2 > K and BLOCK >= 64 else 1  # resident blocks BLOCK (, BLOCK/2)
    warps = min(32, max(1 if BLOCK <= ONE_WARP else max(MIN_WARPS_WIDE, BLOCK // 2048), KP // 512))
    pad = min(block, max(16, triton.next_power_of_2(W)))
    q_lo, q_n, tail_start, tail_len = (t.contiguous() for t in (q_lo, q_n, tail_start, tail_len))
    _kpool_select_kernel[(M,)](
        logits, logits.stride(0), logits.stride(1), q_lo, q_n, tail_start, tail_len, out, scratch,
        W, K, topk, P=P, PP=triton.next_power_of_2(P), TP=triton.next_power_of_2(max(P - 1, 1)), KP=KP,
        COMPACT=tail == "compact", BLOCK=BLOCK, LEVELS=levels, LONG=S > BLOCK,
        CHUNK=min(BLOCK, 512 * warps), LANES=32 * warps, PAD=pad, PAD_CHUNKS=triton.cdiv(W, pad),
        num_warps=warps, maxnreg=_register_cap(BLOCK, KP, warps))
    return out
