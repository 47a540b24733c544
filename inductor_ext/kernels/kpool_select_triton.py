"""Triton causal group selection + token expansion of ``glm53::kpool_select`` (CUDA).

One program per query row selects ``nsel = min(K, q_n)`` pools (``K = topk/P``) among the visible
slots ``[q_lo, q_lo + q_n)`` and writes their tokens in ascending slot order. Scores stay fp32
in registers (slots past q_n read as NaN, which no comparison counts); the threshold is searched
over int32 keys whose integer order is the float order (sign-magnitude to two's complement:
``-0.0`` and ``+0.0`` are both 0, as they compare equal).

- ``q_n <= K``: every visible pool is selected; no score is read.
- otherwise the visible scores are read once into registers as ``[B/4, 4]``: a thread holds runs
  of 4 consecutive slots, read as one 16-byte vector from the 16-byte-aligned slot at or before
  q_lo (B = BLOCK = next_pow2(S) capped at MAX_BLOCK, or BLOCK/2 when that holds the row; slots
  past MAX_BLOCK are re-read on every pass):
  1. threshold ``tau`` = the nsel-th largest score, by bisection over the keys of [min, max]: each
     step one compare + select + add per resident score and one block sum; at most 32 steps,
     ending early as soon as exactly nsel scores reach the probe (then those are the answer);
  2. the selected slots (scores > tau, then the lowest slots whose score is tau until nsel are
     taken) go, straight from the registers, to a per-row scratch row at their rank in slot
     order: a prefix sum within each thread's run of 4 and one block scan over the runs (a second
     one when ties at tau straddle the cut).
- the P tokens of each selected pool (document start + P·slot + i) are stored as a ``[pools, P]``
  block, then the visible tail tokens and -1 padding over the remaining columns (``compact``:
  tail right after the pools; ``fixed``: at columns topk .. topk+P-2). A ``compact`` row is
  ascending token ids, then -1.

Cost per selecting row: one read of the q_n visible scores; 11-18 bisection steps on continuous
scores (32 at most), each about 4 instructions per resident score (compare, select, add, and the
step's share of the block sum); one scatter; the write of ``topk + P - 1`` ids. The kernel is
issue-bound (H200, 4096 pools, Nsight Compute: 0.77 instructions issued per scheduler cycle, the
bisection about half of them). Static shapes only, no host sync. NaN scores are not supported.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["kpool_select_fwd"]

ONE_WARP = 2048  # up to 2048 pools per row: one warp, up to 64 register-resident scores per thread
MIN_WARPS_WIDE = 4  # wider rows: at least 4 warps (H200, 4096 pools, top-512: 2 warps 270 us, 4: 238, 8: 285)
MAX_BLOCK = 32768  # wider rows: one warp per 2048 resident pools; slots past MAX_BLOCK are re-read
ONE_WARP_REGS = 128  # measured on the session-7 kernel (2048 pools: 164 us at 128 registers, 188 at 168)
REG_HEADROOM = 24  # wider rows: registers = resident scores per thread + 24 (H200, 4096 pools, 4 warps:
# 238 us at 56 registers, 237 at 72, 272 at 88)
MAX_LEVELS = 2  # resident block sizes compiled per kernel (H200, 4096 pools: 2 sizes 231 us, 3 sizes 241)
OUT_CHUNK = 64  # tail and -1 columns written per pass
VEC = tl.constexpr(4)  # consecutive slots per thread: one 16-byte fp32 load
_SIGN = tl.constexpr(-(2**31))


@triton.jit
def _slots(start, off, R: tl.constexpr):
    """Slots of the ``[R, VEC]`` block at aligned offset ``start`` of the row: element (r, i) is
    slot ``start + VEC·r + i - off``. Each thread holds whole rows of VEC consecutive slots."""
    return start - off + tl.arange(0, R)[:, None] * VEC + tl.arange(0, VEC)[None, :]


@triton.jit
def _block(lrow, stride_ls, start, off, q_n, R: tl.constexpr, WHOLE: tl.constexpr):
    """Scores of the ``[R, VEC]`` block at aligned offset ``start`` (see :func:`_slots`); NaN
    outside the visible slots [0, q_n) (never >=, > or == a threshold). WHOLE: read every
    16-byte vector that holds a visible slot (one vector load; the row's storage extends to a
    multiple of VEC), then blank the rest."""
    r = start + tl.arange(0, R)[:, None] * VEC
    e = r + tl.arange(0, VEC)[None, :]
    ok = (e >= off) & (e < off + q_n)
    if WHOLE:
        x = tl.load(lrow + e * stride_ls, mask=(r + VEC > off) & (r < off + q_n), other=float("nan"))
        return tl.where(ok, x, float("nan"))
    return tl.load(lrow + e * stride_ls, mask=ok, other=float("nan"))


@triton.jit
def _total(v):
    """Sum over an ``[R, VEC]`` block."""
    return tl.sum(tl.sum(v, axis=1), axis=0)


@triton.jit
def _min_max(x):
    """(min, max) of a block's scores, NaN (slots outside the row) ignored."""
    lo = tl.min(tl.min(tl.where(x == x, x, float("inf")), axis=1), axis=0)
    return lo, tl.max(tl.max(tl.where(x == x, x, -float("inf")), axis=1), axis=0)


@triton.jit
def _key(x):
    """uint32 key of a (scalar) score: unsigned order = float order, -0.0 and +0.0 both 2^31
    (sign-magnitude to two's complement, then biased by 2^31)."""
    b = x.to(tl.int32, bitcast=True)
    return (tl.where(b < 0, -(b & 0x7FFFFFFF), b) ^ _SIGN).to(tl.uint32, bitcast=True)


@triton.jit
def _score(u):
    """The score of a uint32 key (2^31: +0.0); inverse of :func:`_key`."""
    k = u.to(tl.int32, bitcast=True) ^ _SIGN
    return tl.where(k < 0, (-k) | _SIGN, k).to(tl.float32, bitcast=True)


@triton.jit
def _count_ge(x, t, one, lrow, stride_ls, off, q_n, B: tl.constexpr, C: tl.constexpr, LONG: tl.constexpr,
              WHOLE: tl.constexpr):
    """#(visible scores >= t); x = the resident block, the rest re-read C at a time if LONG.
    ``one`` is a runtime 1: summing it, not the bool, compiles to compare + select + add."""
    c = _total(tl.where(x >= t, one, 0))
    if LONG:
        for start in range(B, q_n + off, C):
            more = _block(lrow, stride_ls, start, off, q_n, C // VEC, WHOLE)
            c += _total(tl.where(more >= t, one, 0))
    return c


@triton.jit
def _exclusive_prefix(flags):
    """Per element of an ``[R, VEC]`` block, how many earlier elements (slot order: row-major)
    are set. The VEC elements of a row share a thread: one block scan over the R row counts."""
    n = flags.to(tl.int32)
    per_row = tl.sum(n, axis=1)
    return (tl.cumsum(per_row, axis=0) - per_row)[:, None] + tl.cumsum(n, axis=1) - n


@triton.jit
def _scatter(x, slot, tau, straddle, need, srow, n0, e0, nsel):
    """Write the slots of the selected scores of a block to srow at their rank in slot order,
    after n0 earlier ones: scores > tau, and scores == tau while fewer than ``need`` (e0 taken
    before) when ties at tau straddle the cut (else every score >= tau). Returns (n0, e0) updated."""
    sel = x >= tau
    if straddle:
        eq = x == tau
        sel = (x > tau) | (eq & (e0 + _exclusive_prefix(eq) < need))
        e0 += _total(eq.to(tl.int32))
    rank = n0 + _exclusive_prefix(sel)
    tl.store(srow + rank, slot, mask=sel & (rank < nsel))  # rank < nsel holds; the mask keeps it in the row
    return n0 + _total(sel.to(tl.int32)), e0


@triton.jit
def _select_top(lrow, stride_ls, off, q_n, nsel, srow, one, B: tl.constexpr, C: tl.constexpr, LONG: tl.constexpr,
                WHOLE: tl.constexpr):
    """Steps 1-2 for q_n > nsel visible slots (resident block of B elements from the aligned row
    start, ``off`` slots before q_lo; the rest re-read C at a time if LONG): the nsel selected
    slots to srow[0:nsel], in slot order."""
    x = _block(lrow, stride_ls, 0, off, q_n, B // VEC, WHOLE)
    lo, hi = _min_max(x)
    if LONG:
        for start in range(B, q_n + off, C):
            more_lo, more_hi = _min_max(_block(lrow, stride_ls, start, off, q_n, C // VEC, WHOLE))
            lo = tl.minimum(lo, more_lo)
            hi = tl.maximum(hi, more_hi)
    # over keys: tau in [lo, hi], c_lo = #(keys >= lo), n_above = #(keys > hi); finite scores'
    # keys span less than 2^32 - 1, so hi - lo + 1 does not wrap
    lo = _key(lo)
    hi = _key(hi)
    c_lo = q_n
    n_above = q_n * 0
    while lo < hi:
        mid = lo + ((hi - lo + 1) >> 1)
        c = _count_ge(x, _score(mid), one, lrow, stride_ls, off, q_n, B, C, LONG, WHOLE)
        up = c >= nsel  # on an exact hit the keys >= mid are the answer: stop there
        lo = tl.where(up, mid, lo)
        c_lo = tl.where(up, c, c_lo)
        hi = tl.where(c == nsel, mid, tl.where(up, hi, mid - 1))
        n_above = tl.where(up, n_above, c)
    tau = _score(lo)
    straddle = c_lo > nsel  # then n_above = #(keys > tau) and nsel - n_above ties are taken
    need = nsel - n_above
    n, e = _scatter(x, _slots(0, off, B // VEC), tau, straddle, need, srow, q_n * 0, q_n * 0, nsel)
    if LONG:
        for start in range(B, q_n + off, C):
            more = _block(lrow, stride_ls, start, off, q_n, C // VEC, WHOLE)
            n, e = _scatter(more, _slots(start, off, C // VEC), tau, straddle, need, srow, n, e, nsel)


@triton.jit
def _kpool_select_kernel(
    logits_ptr, stride_lm, stride_ls, q_lo_ptr, q_n_ptr, tail_start_ptr, tail_len_ptr,
    out_ptr, scratch_ptr, W, K, TOPK,
    P: tl.constexpr, PP: tl.constexpr, KP: tl.constexpr, COMPACT: tl.constexpr, BLOCK: tl.constexpr,
    LEVELS: tl.constexpr, LONG: tl.constexpr, CHUNK: tl.constexpr, OUT: tl.constexpr, WHOLE: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    q_lo = tl.load(q_lo_ptr + row)
    q_n = tl.load(q_n_ptr + row).to(tl.int32)
    t_start = tl.load(tail_start_ptr + row)
    t_len = tl.load(tail_len_ptr + row).to(tl.int32)
    nsel = tl.minimum(q_n, K)
    srow = scratch_ptr + row * K
    pick = q_n > K
    if pick:
        q_al = (q_lo // VEC) * VEC  # aligned start: 16-byte loads when the row and stride allow
        off = (q_lo - q_al).to(tl.int32)
        lrow = logits_ptr + row * stride_lm + q_al * stride_ls
        level = 0  # the smallest block BLOCK >> level that holds off + q_n (level < LEVELS)
        for lv in tl.static_range(1, LEVELS):
            level += (q_n + off <= (BLOCK >> lv)).to(tl.int32)
        one = (q_lo >= 0).to(tl.int32)  # 1, opaque to the compiler (see _count_ge)
        for lv in tl.static_range(LEVELS):
            if level == lv:
                _select_top(lrow, stride_ls, off, q_n, nsel, srow, one, BLOCK >> lv, CHUNK, LONG and lv == 0,
                            WHOLE)
        tl.debug_barrier()  # the scratch row is read back by other threads
    # the P tokens of each selected pool (else of every visible one: slot = kj)
    kj = tl.arange(0, KP)
    slot = tl.load(srow + kj, mask=(kj < nsel) & pick, other=0)
    slot = tl.where(pick, slot, kj)
    i = tl.arange(0, PP)
    first = (t_start - P * q_n).to(tl.int32) + P * slot  # document start + P·slot
    orow = out_ptr + row * W
    tl.store(orow + kj[:, None] * P + i[None, :], first[:, None] + i[None, :],
             mask=(kj < nsel)[:, None] & (i < P)[None, :])
    # then the tail tokens and -1 over the remaining columns
    n_tok = nsel * P
    base = n_tok if COMPACT else TOPK + 0 * n_tok
    for c0 in range(n_tok, W, OUT):
        col = c0 + tl.arange(0, OUT)
        jt = col - base
        tail = tl.where((jt >= 0) & (jt < t_len), t_start.to(tl.int32) + jt, -1)
        tl.store(orow + col, tail, mask=col < W)


def _whole_vectors(logits) -> bool:
    """Whether every row may be read in whole 16-byte vectors: unit column stride, and the storage
    extends past the last row's columns rounded up to a multiple of VEC (the scorer's padded
    workspace always does). Reads past a row's S columns land in the next row or the padding."""
    M, S = logits.shape
    end = logits.storage_offset() + (M - 1) * logits.stride(0) + triton.cdiv(S, VEC.value) * VEC.value
    return logits.stride(1) == 1 and end * logits.element_size() <= logits.untyped_storage().nbytes()


def _register_cap(block: int, warps: int) -> int:
    """Registers per thread: few enough for many rows per SM, enough for the resident fp32 scores
    (a few spill at 4096 pools: measured no slower than more registers and fewer rows)."""
    if warps == 1:
        return ONE_WARP_REGS
    return min(255, block // (32 * warps) + REG_HEADROOM)


def kpool_select_fwd(logits, q_lo, q_n, tail_start, tail_len, topk: int, pool_size: int, tail: str):
    """Selected token ids int32 ``[M, topk + P - 1]`` (see :func:`inductor_ext.ops.kpool.kpool_select`).

    Args:
        logits: ``[M, S]`` fp32, any strides (the scorer's padded workspace view).
        q_lo, q_n, tail_start, tail_len: ``[M]`` int64 rows of ``kpool_layout``.
        topk, pool_size, tail: as the op.

    A scratch ``[M, min(topk/P, S)]`` int32 buffer is allocated from static shapes.
    """
    M, S = logits.shape
    P = pool_size
    W = topk + P - 1
    K = min(topk // P, S)
    out = torch.empty(M, W, dtype=torch.int32, device=logits.device)
    if M == 0:
        return out
    scratch = torch.empty(M, max(K, 1), dtype=torch.int32, device=logits.device)
    BLOCK = min(max(32, triton.next_power_of_2(S)), MAX_BLOCK)
    levels = 1  # resident blocks BLOCK, BLOCK/2, ... (up to MAX_LEVELS) that still exceed K
    while levels < MAX_LEVELS and BLOCK >> levels > K and BLOCK >> levels >= 32:
        levels += 1
    warps = 1 if BLOCK <= ONE_WARP else max(MIN_WARPS_WIDE, BLOCK // 2048)
    q_lo, q_n, tail_start, tail_len = (t.contiguous() for t in (q_lo, q_n, tail_start, tail_len))
    _kpool_select_kernel[(M,)](
        logits, logits.stride(0), logits.stride(1), q_lo, q_n, tail_start, tail_len, out, scratch,
        W, K, topk, P=P, PP=triton.next_power_of_2(P), KP=max(16, triton.next_power_of_2(K)),
        COMPACT=tail == "compact", BLOCK=BLOCK, LEVELS=levels, LONG=S > BLOCK, CHUNK=min(BLOCK, 512 * warps),
        OUT=min(OUT_CHUNK, triton.next_power_of_2(W)), WHOLE=_whole_vectors(logits), num_warps=warps,
        maxnreg=_register_cap(BLOCK, warps))
    return out
