"""Triton causal group selection + token expansion of ``glm53::kpool_select`` (CUDA).

One program per query row selects ``nsel = min(K, q_n)`` pools (``K = topk/P``) among the visible
slots ``[q_lo, q_lo + q_n)`` and writes their tokens in ascending slot order. Scores stay fp32
in registers (slots past q_n read as NaN, which no count includes); the threshold is searched
over uint32 keys whose order is the float order (sign-magnitude to biased: ``-0.0`` and ``+0.0``
share a key, as they compare equal).

- ``q_n <= K``: every visible pool is selected; no score is read.
- otherwise the visible scores are read once into registers as a ``[T, J, 4]`` block: thread t
  holds the J·4 consecutive slots of run t, read as 16-byte vectors from the 16-byte-aligned slot
  at or before q_lo (block = next_pow2(S) capped at MAX_BLOCK, or half that when it holds the
  row; slots past MAX_BLOCK are re-read on every pass):
  1. threshold ``tau`` = the nsel-th largest score. The key bracket starts at [min, max]; each
     pass counts the scores at or above one probe key (one subtract and one shift-add per
     resident score: the sign bits of ``probe - x``; then one block sum) and ends early when
     exactly nsel reach it. Probes: the score a normal distribution with the row's mean and
     deviation ranks nsel-th (a sum over heads is close to normal), then one Newton step of
     that normal model from the first count (NEWTON_OVERSHOOT times over, so it tends to land
     past the threshold and bracket it), then the key where the count, interpolated over the
     bracket, reaches nsel, with a key bisection after each interpolation that did not halve
     the bracket's count (so at most 2 + log2(q_n) + 2·32 passes: interpolations that halve
     the count, the others each paired with a bisection);
  2. the selected slots (scores > tau, then the lowest slots whose score is tau until nsel are
     taken) go, straight from the registers, to a per-row scratch row at their rank in slot
     order. Without ties at tau to split and with at most 32 slots per thread (up to 4096
     pools on 4 warps): each thread's picks as a bit mask, one block scan of their counts,
     then one store per pick in rounds (as many as the fullest thread has picks). Otherwise:
     prefix sums within each thread's run and one block scan over the runs (a second one for
     the ties).
- the P tokens of each selected pool (document start + P·slot + i) are stored as a ``[pools, P]``
  block, then the visible tail tokens and -1 padding over the remaining columns (``compact``:
  tail right after the pools; ``fixed``: at columns topk .. topk+P-2). A ``compact`` row is
  ascending token ids, then -1.

Cost per selecting row: one read of the q_n visible scores; one pass for min, max and moments
(one block reduction for the four); the counting passes (at most 2 + log2(q_n) + 2·32; about 5 on
sum-of-heads scores, where key bisection alone takes 12-15: the simulated counts per score
distribution are in ``docs/kpool-indexer.md``); one scatter; the write of ``topk + P - 1`` ids.
The kernel is issue-bound, so its time follows its instruction count.
Static shapes only, no host sync. NaN scores are not supported.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["kpool_select_fwd"]

# launch geometry; the H200 measurements behind each value: docs/kpool-indexer.md
ONE_WARP = 512  # up to 512 pools per row: one warp
MIN_WARPS_WIDE = 4  # wider rows: at least 4 warps
MAX_BLOCK = 32768  # wider rows: one warp per 2048 resident pools; slots past MAX_BLOCK are re-read
ONE_WARP_REGS = 128  # registers per thread on one warp
REG_HEADROOM = 32  # wider rows: registers = resident scores per thread + 32
MAX_LEVELS = 2  # resident block sizes compiled per kernel
OUT_CHUNK = 64  # tail and -1 columns written per pass
VEC = tl.constexpr(4)  # consecutive slots per thread: one 16-byte fp32 load
_SIGN = tl.constexpr(-(2**31))
NEWTON_OVERSHOOT = tl.constexpr(0.2)  # second probe: the normal model's Newton step, 1.2 times over


@triton.jit
def _grid(start, T: tl.constexpr, J: tl.constexpr):
    """Positions, from the aligned row start, of the ``[T, J, VEC]`` block at aligned offset
    ``start``: (vector starts, elements), element (t, j, i) at ``start + VEC·(J·t + j) + i``. A
    thread holds one t: J·VEC consecutive slots, so slot order needs a block scan over T only."""
    v = start + (tl.arange(0, T)[:, None, None] * J + tl.arange(0, J)[None, :, None]) * VEC
    return v, v + tl.arange(0, VEC)[None, None, :]


@triton.jit
def _block(lrow, stride_ls, start, off, q_n, T: tl.constexpr, J: tl.constexpr, WHOLE: tl.constexpr):
    """Scores of the block at ``start`` (see :func:`_grid`); NaN outside the visible slots
    [0, q_n) (never >=, > or == a threshold). WHOLE: read every 16-byte vector that holds a
    visible slot (one vector load; the row's storage extends to a multiple of VEC), then blank
    the rest."""
    r, e = _grid(start, T, J)
    ok = _grid(start - off, T, J)[1].to(tl.uint32) < q_n.to(tl.uint32)  # slot in [0, q_n)
    if WHOLE:
        x = tl.load(lrow + e * stride_ls, mask=(r + VEC > off) & (r < off + q_n))  # no fill: blanked next
        return tl.where(ok, x, float("nan"))
    return tl.load(lrow + e * stride_ls, mask=ok, other=float("nan"))


@triton.jit
def _total(v):
    """Sum over a ``[T, J, VEC]`` block."""
    return tl.sum(tl.sum(tl.sum(v, axis=2), axis=1), axis=0)


@triton.jit
def _stats_combine(lo, hi, s1, s2, more_lo, more_hi, more_s1, more_s2):
    return tl.minimum(lo, more_lo), tl.maximum(hi, more_hi), s1 + more_s1, s2 + more_s2


@triton.jit
def _stats(x):
    """(min, max, sum, sum of squares) of a block's scores, NaN (slots outside the row) ignored
    (tl.minimum / tl.maximum return the non-NaN operand); one block reduction for all four."""
    v = tl.where(x == x, x, 0.0)
    stats = (x, x, v, v * v)
    for axis in tl.static_range(2, -1, -1):
        stats = tl.reduce(stats, axis, _stats_combine)
    return stats


@triton.jit
def _upper_normal_quantile(p):
    """z with P(N(0,1) > z) = p, 0 < p < 1 (Abramowitz & Stegun 26.2.23, |error| < 4.5e-4): the
    first probe's z-score. Only the probe sequence depends on it, never the result."""
    t = tl.sqrt(-2.0 * tl.log(tl.minimum(p, 1.0 - p)))
    z = t - (2.515517 + t * (0.802853 + t * 0.010328)) / (1.0 + t * (1.432788 + t * (0.189269 + t * 0.001308)))
    return tl.where(p < 0.5, z, -z)


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
def _above(x, t, one):
    """#(scores of a block > t), NaN (blanked slots) never counted. For t > -inf: the sign bits of
    ``t - x`` (one subtract + one shift-add per score; the sign of a nonzero difference survives
    rounding, x == t gives +0.0, t - NaN is a positive NaN). At t = -inf, -inf - -inf is NaN of
    either sign, so compare there (``one``: a runtime 1, see _kpool_select_kernel)."""
    if t > float("-inf"):
        c = _total((t - x).to(tl.uint32, bitcast=True) >> 31)
    else:
        c = _total(tl.where(x > t, one, 0)).to(tl.uint32)
    return c.to(tl.int32)


@triton.jit
def _count_above(x, t, one, lrow, stride_ls, off, q_n, B: tl.constexpr, C: tl.constexpr, TC: tl.constexpr,
                 JC: tl.constexpr, LONG: tl.constexpr, WHOLE: tl.constexpr):
    """#(visible scores > t); x = the resident block, the rest re-read C = TC·JC·VEC at a time if LONG."""
    c = _above(x, t, one)
    if LONG:
        for start in range(B, q_n + off, C):
            c += _above(_block(lrow, stride_ls, start, off, q_n, TC, JC, WHOLE), t, one)
    return c


@triton.jit
def _exclusive_prefix(flags):
    """Per element of a ``[T, J, VEC]`` block, how many earlier elements (slot order: row-major)
    are set: one block scan over the T runs, the rest within each thread."""
    n = flags.to(tl.int32)
    per_run = tl.sum(tl.sum(n, axis=2), axis=1)
    in_run = tl.sum(tl.cumsum(n, axis=1) - n, axis=2)  # set in the run's earlier vectors
    before = (tl.cumsum(per_run, axis=0) - per_run)[:, None] + in_run
    return before[:, :, None] + tl.cumsum(n, axis=2) - n


@triton.jit
def _or(a, b):
    return a | b


@triton.jit
def _popcount(m):
    """Set bits of each uint32, as int32 (SWAR)."""
    m = m - ((m >> 1) & 0x55555555)
    m = (m & 0x33333333) + ((m >> 2) & 0x33333333)
    m = (m + (m >> 4)) & 0x0F0F0F0F
    return ((m * 0x01010101) >> 24).to(tl.int32)


@triton.jit
def _scatter_runs(x, start, tau, srow, n0, T: tl.constexpr, J: tl.constexpr):
    """:func:`_scatter` without ties to split (every score >= tau is selected) and at most 32 slots
    per thread: each run's picks as a bit mask, one block scan of their counts, then one store per
    pick, lowest bit first (as many rounds as the fullest run has picks)."""
    bit = tl.arange(0, J)[None, :, None] * VEC + tl.arange(0, VEC)[None, None, :]
    m = tl.reduce(tl.reduce(tl.where(x >= tau, 1 << bit, 0), 2, _or), 1, _or)
    n = _popcount(m.to(tl.uint32, bitcast=True))
    dst = srow + (n0 + tl.cumsum(n, 0) - n)
    pos = start + tl.arange(0, T) * (J * VEC) - 127  # each run's first slot + off, less the fp32 exponent bias
    for k in range(0, tl.max(n, 0)):
        low = m & -m  # the lowest set bit: 2^j
        j_biased = low.to(tl.uint32, bitcast=True).to(tl.float32).to(tl.int32, bitcast=True) >> 23
        tl.store(dst + k, pos + j_biased, mask=m != 0)
        m ^= low
    return n0 + tl.sum(n, 0)


@triton.jit
def _scatter_ranked(x, pos, tau, straddle, need, srow, n0, e0, nsel):
    """:func:`_scatter` for any block: each selected score's rank from prefix sums over its run and
    one block scan over the runs."""
    sel = x >= tau
    if straddle:
        eq = x == tau
        sel = (x > tau) | (eq & (e0 + _exclusive_prefix(eq) < need))
        e0 += _total(eq.to(tl.int32))
    rank = n0 + _exclusive_prefix(sel)
    tl.store(srow + rank, pos, mask=sel & (rank < nsel))  # rank < nsel holds; the mask keeps it in the row
    return n0 + _total(sel.to(tl.int32)), e0


@triton.jit
def _scatter(x, start, tau, straddle, need, srow, n0, e0, nsel, T: tl.constexpr, J: tl.constexpr):
    """Write the positions (slot + off) of the selected scores of the ``[T, J, VEC]`` block at
    ``start`` to srow at their rank in slot order, after n0 earlier ones: scores > tau, and scores
    == tau while fewer than ``need`` (e0 taken before) when ties at tau straddle the cut (else
    every score >= tau). Returns (n0, e0) updated."""
    if J * VEC <= 32:
        if straddle:
            n0, e0 = _scatter_ranked(x, _grid(start, T, J)[1], tau, straddle, need, srow, n0, e0, nsel)
        else:
            n0 = _scatter_runs(x, start, tau, srow, n0, T, J)
    else:
        n0, e0 = _scatter_ranked(x, _grid(start, T, J)[1], tau, straddle, need, srow, n0, e0, nsel)
    return n0, e0


@triton.jit
def _select_top(lrow, stride_ls, off, q_n, nsel, srow, one, B: tl.constexpr, C: tl.constexpr, LONG: tl.constexpr,
                WHOLE: tl.constexpr, LANES: tl.constexpr):
    """Steps 1-2 for q_n > nsel visible slots (resident block of B elements from the aligned row
    start, ``off`` slots before q_lo; the rest re-read C at a time if LONG): the nsel selected
    slots to srow[0:nsel], in slot order."""
    TB: tl.constexpr = min(LANES, B // VEC)  # [TB, JB, VEC] resident block, [TC, JC, VEC] re-read chunks
    JB: tl.constexpr = B // (VEC * TB)
    TC: tl.constexpr = min(LANES, C // VEC)
    JC: tl.constexpr = C // (VEC * TC)
    x = _block(lrow, stride_ls, 0, off, q_n, TB, JB, WHOLE)
    lo, hi, s1, s2 = _stats(x)
    if LONG:
        for start in range(B, q_n + off, C):
            more_lo, more_hi, more_s1, more_s2 = _stats(_block(lrow, stride_ls, start, off, q_n, TC, JC, WHOLE))
            lo, hi, s1, s2 = _stats_combine(lo, hi, s1, s2, more_lo, more_hi, more_s1, more_s2)
    # probes (module docstring): the normal guess from the row's mean and deviation, a Newton step
    # of the normal model from its count, then count-interpolated keys, a key bisection after
    # every interpolation that did not halve the bracket's count
    mean = s1 / q_n
    dev = tl.sqrt(tl.maximum(s2 / q_n - mean * mean, 0.0))
    z = _upper_normal_quantile((nsel - 0.5) / q_n)
    guess = mean + dev * z
    # the normal model's scores per count near the guess: dev / (q_n · density at z)
    slope = (1.0 + NEWTON_OVERSHOOT) * 2.5066283 * dev * tl.exp(0.5 * z * z) / q_n  # sqrt(2 pi) dev / (q_n e^(-z²/2))
    # over keys: tau in [lo, hi], c_lo = #(keys >= lo), n_above = #(keys > hi); finite scores'
    # keys span less than 2^32 - 1, so hi - lo + 1 does not wrap
    lo = _key(lo)
    hi = _key(hi)
    c_lo = q_n
    n_above = q_n * 0
    probe = tl.minimum(tl.maximum(_key(guess), lo + 1), hi)
    step = 0
    halved = True
    while lo < hi:
        c = _count_above(x, _score(probe - 1), one, lrow, stride_ls, off, q_n, B, C, TC, JC, LONG, WHOLE)  # >= probe
        was = c_lo - n_above
        up = c >= nsel  # on an exact hit the keys >= probe are the answer: stop there
        lo = tl.where(up, probe, lo)
        c_lo = tl.where(up, c, c_lo)
        hi = tl.where(c == nsel, probe, tl.where(up, hi, probe - 1))
        n_above = tl.where(up, n_above, c)
        if step == 0:
            nxt = _key(guess + (c - nsel + tl.where(up, 0.5, -0.5)) * slope)
        elif halved:
            frac = (c_lo - nsel) / (c_lo - n_above)  # where the count reaches nsel
            nxt = lo + ((hi - lo).to(tl.float32) * frac).to(tl.uint32)
        else:
            nxt = lo + ((hi - lo + 1) >> 1)
        halved = (step == 0) | (not halved) | (2 * (c_lo - n_above) <= was)
        probe = tl.minimum(tl.maximum(nxt, lo + 1), hi)
        step += 1
    tau = _score(lo)
    straddle = c_lo > nsel  # then n_above = #(keys > tau) and nsel - n_above ties are taken
    need = nsel - n_above
    n, e = _scatter(x, 0, tau, straddle, need, srow, q_n * 0, q_n * 0, nsel, TB, JB)
    if LONG:
        for start in range(B, q_n + off, C):
            more = _block(lrow, stride_ls, start, off, q_n, TC, JC, WHOLE)
            n, e = _scatter(more, start, tau, straddle, need, srow, n, e, nsel, TC, JC)


@triton.jit
def _kpool_select_kernel(
    logits_ptr, stride_lm, stride_ls, q_lo_ptr, q_n_ptr, tail_start_ptr, tail_len_ptr,
    out_ptr, scratch_ptr, W, K, TOPK,
    P: tl.constexpr, PP: tl.constexpr, KP: tl.constexpr, COMPACT: tl.constexpr, BLOCK: tl.constexpr,
    LEVELS: tl.constexpr, LONG: tl.constexpr, CHUNK: tl.constexpr, OUT: tl.constexpr, WHOLE: tl.constexpr,
    LANES: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    q_lo = tl.load(q_lo_ptr + row)
    q_n = tl.load(q_n_ptr + row).to(tl.int32)
    t_start = tl.load(tail_start_ptr + row)
    t_len = tl.load(tail_len_ptr + row).to(tl.int32)
    nsel = tl.minimum(q_n, K)
    srow = scratch_ptr + row * K
    pick = q_n > K
    q_al = (q_lo // VEC) * VEC  # aligned start: 16-byte loads when the row and stride allow
    off = (q_lo - q_al).to(tl.int32)
    if pick:
        lrow = logits_ptr + row * stride_lm + q_al * stride_ls
        level = 0  # the smallest block BLOCK >> level that holds off + q_n (level < LEVELS)
        for lv in tl.static_range(1, LEVELS):
            level += (q_n + off <= (BLOCK >> lv)).to(tl.int32)
        one = (q_lo >= 0).to(tl.int32)  # 1, opaque to the compiler: summed, it compiles to select + add
        for lv in tl.static_range(LEVELS):
            if level == lv:
                _select_top(lrow, stride_ls, off, q_n, nsel, srow, one, BLOCK >> lv, CHUNK, LONG and lv == 0,
                            WHOLE, LANES)
        tl.debug_barrier()  # the scratch row is read back by other threads
    # the P tokens of each selected pool (else of every visible one: slot = kj)
    kj = tl.arange(0, KP)
    slot = tl.load(srow + kj, mask=(kj < nsel) & pick, other=0) - off  # scratch: positions slot + off
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
        OUT=min(OUT_CHUNK, triton.next_power_of_2(W)), WHOLE=_whole_vectors(logits), LANES=32 * warps, num_warps=warps,
        maxnreg=_register_cap(BLOCK, warps))
    return out
