"""Triton forward of ``glm53::sparse_mla`` (DSA sparse attention, absorbed MLA form).

Imports only torch and triton, so it can be loaded by path on a GPU machine without the package.

One program per (query row ``t``, group of up to 64 heads). The heads of a query share every
gathered latent row, so each block of ``BLOCK_N`` listed ids is one gather of ``[BLOCK_N, D]`` rows
and MMAs with M = heads (padded to >= 16):

    s   = q[t, heads] · kv[ids]ᵀ                  [BLOCK_H, BLOCK_N] FP32 (D summed as NC column chunks)
    online softmax in FP32 (base 2, ``scale · log2 e`` folded into the scores)
    acc = acc · α + p · kv[ids, :d_v]             FP32 accumulators, one [BLOCK_H, DC] tile per value chunk

``p`` enters the value MMA rounded to the input dtype (the usual flash-attention trade).
``out = acc / l`` is rounded once; ``lse = (m + log2 l) · ln 2``.

D is held as ``NC <= 4`` column chunks of ``DC`` (a power of two, 16..256; D <= 1024), so a chunk
can be a value tile and a key tile at once and nothing is sliced in registers. ``d_v`` may end
inside a chunk (the store is masked).

Padding: before the loop the program finds the first and last valid position of its id row (one
pass over ``W`` ids), so leading and trailing ``-1`` blocks cost nothing; ``-1`` inside that span
is masked (its rows are not read; its MMA work is spent). A row without valid ids gives
``out = 0`` and ``lse = -inf``. Ids outside ``[0, S)`` are treated as padding (never read).
Queries are scheduled last row first (causal selections give late rows the most ids).
No host synchronisation: CUDA-graph safe.

H200 (T = 8192, H = 64, D = d_v = 512, 2051 causal random ids, 1.93 TFLOP visible): 7.9 ms p50,
~244 TFLOP/s, with the defaults (BLOCK_N 64, 8 warps, 2 stages, ids prefetched one block ahead:
8.4 ms without; 255 registers, ~50 spilled). Tried and slower: BLOCK_N 32 with 3-4 stages (9.1 ms,
no spills), column chunks of 256 (8.2-8.4), two programs per query each owning half of the value
columns (11.7-13.6), 16 warps (18.9), BLOCK_N 128 (10.9); p entering the value MMA as two BF16 terms
doubles the value MMAs (20.0 ms). The program is one 8-warp CTA per SM (196 KB shared memory), so
gathers, the score MMA, the softmax and the value MMA mostly serialise.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["sparse_mla_fwd", "chunking", "fwd_config"]

LOG2E = 1.4426950408889634


def chunking(D: int, chunk: int | None = None) -> tuple[int, int]:
    """``(DC, NC)``: D as NC <= 4 column chunks of DC (a power of two >= 16)."""
    if chunk is None:
        dc = max(16, min(128, triton.next_power_of_2(D)))
        if triton.cdiv(D, dc) > 4:
            dc = triton.next_power_of_2(triton.cdiv(D, 4))
    else:
        dc = int(chunk)
    nc = triton.cdiv(D, dc)
    if dc < 16 or dc & (dc - 1) or nc > 4 or dc > 256:
        raise ValueError(f"sparse_mla kernels: D={D} with column chunk {dc} needs <= 4 chunks of 16..256 (D <= 1024)")
    return dc, nc


def fwd_config(H: int, D: int, d_v: int) -> dict:
    """Default launch parameters of the forward for a geometry."""
    big = min(64, H) * D >= 64 * 256
    return {"block_n": 64, "num_warps": 8 if big else 4, "num_stages": 2, "chunk": None, "prefetch": True}


@triton.jit
def _load_tile(base, rows, row_mask, row_stride, cb, limit, DC: tl.constexpr, MASK_COLS: tl.constexpr):
    """``base[rows, cb : cb + DC]`` as a [R, DC] tile (0 where ``row_mask`` is false or col >= limit)."""
    cols = cb + tl.arange(0, DC)
    ptrs = base + rows[:, None] * row_stride + cols[None, :]
    if MASK_COLS:
        mask = row_mask[:, None] & (cols < limit)[None, :]
    else:
        mask = row_mask[:, None]
    return tl.load(ptrs, mask=mask, other=0.0)


@triton.jit
def _valid_span(ids_row, W, S, SCAN: tl.constexpr, BLOCK_N: tl.constexpr):
    """``[lo, hi)``: from the block holding the first valid id to just past the last one
    (``lo >= hi`` when the row has none)."""
    lo = tl.zeros([], dtype=tl.int32) + W
    hi = tl.zeros([], dtype=tl.int32)
    for w0 in range(0, W, SCAN):
        offs = w0 + tl.arange(0, SCAN)
        ids = tl.load(ids_row + offs, mask=offs < W, other=-1)
        ok = (ids >= 0) & (ids < S)
        lo = tl.minimum(lo, tl.min(tl.where(ok, offs, W), 0))
        hi = tl.maximum(hi, tl.max(tl.where(ok, offs + 1, 0), 0))
    return (lo // BLOCK_N) * BLOCK_N, hi


@triton.jit
def _sparse_mla_fwd_kernel(
    q_ptr, kv_ptr, ids_ptr, out_ptr, lse_ptr,
    T, H, W, S, qk_scale,
    s_qt, s_qh, s_kv, s_it, s_ot, s_oh, s_lt,
    D: tl.constexpr, DV: tl.constexpr, DC: tl.constexpr, NC: tl.constexpr, NV: tl.constexpr,
    NUM_HG: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, SCAN: tl.constexpr,
    MASK_COLS: tl.constexpr, DOT_PREC: tl.constexpr, PREFETCH: tl.constexpr, IDX32: tl.constexpr,
):
    pid = tl.program_id(0)
    t = T - 1 - pid // NUM_HG
    hg = pid % NUM_HG
    heads = hg * BLOCK_H + tl.arange(0, BLOCK_H)
    hmask = heads < H
    q_row = q_ptr + t.to(tl.int64) * s_qt
    ids_row = ids_ptr + t.to(tl.int64) * s_it
    n_lo, n_hi = _valid_span(ids_row, W, S, SCAN, BLOCK_N)

    # column chunks: the first NV hold the value columns too
    cb0 = 0
    q0 = _load_tile(q_row, heads, hmask, s_qh, cb0, D, DC, MASK_COLS)
    acc0 = tl.zeros([BLOCK_H, DC], dtype=tl.float32)
    if NC > 1:
        cb1 = DC
        q1 = _load_tile(q_row, heads, hmask, s_qh, cb1, D, DC, MASK_COLS)
        if NV > 1:
            acc1 = tl.zeros([BLOCK_H, DC], dtype=tl.float32)
    if NC > 2:
        cb2 = 2 * DC
        q2 = _load_tile(q_row, heads, hmask, s_qh, cb2, D, DC, MASK_COLS)
        if NV > 2:
            acc2 = tl.zeros([BLOCK_H, DC], dtype=tl.float32)
    if NC > 3:
        cb3 = 3 * DC
        q3 = _load_tile(q_row, heads, hmask, s_qh, cb3, D, DC, MASK_COLS)
        if NV > 3:
            acc3 = tl.zeros([BLOCK_H, DC], dtype=tl.float32)

    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    if PREFETCH:
        offs = n_lo + tl.arange(0, BLOCK_N)
        ids_next = tl.load(ids_row + offs, mask=offs < W, other=-1)
    for n0 in range(n_lo, n_hi, BLOCK_N):
        if PREFETCH:  # ids of this block were loaded one iteration ahead: the gather can start at once
            ids = ids_next
            offs = n0 + BLOCK_N + tl.arange(0, BLOCK_N)
            ids_next = tl.load(ids_row + offs, mask=offs < W, other=-1)
        else:
            offs = n0 + tl.arange(0, BLOCK_N)
            ids = tl.load(ids_row + offs, mask=offs < W, other=-1)
        valid = (ids >= 0) & (ids < S)
        if IDX32:  # int32 offsets: half the live registers of int64 pointers per gathered element
            rows = tl.where(valid, ids, 0).to(tl.int32)
        else:
            rows = tl.where(valid, ids, 0).to(tl.int64)
        k0 = _load_tile(kv_ptr, rows, valid, s_kv, cb0, D, DC, MASK_COLS)
        s = tl.dot(q0, tl.trans(k0), input_precision=DOT_PREC)
        if NC > 1:
            k1 = _load_tile(kv_ptr, rows, valid, s_kv, cb1, D, DC, MASK_COLS)
            s = tl.dot(q1, tl.trans(k1), s, input_precision=DOT_PREC)
        if NC > 2:
            k2 = _load_tile(kv_ptr, rows, valid, s_kv, cb2, D, DC, MASK_COLS)
            s = tl.dot(q2, tl.trans(k2), s, input_precision=DOT_PREC)
        if NC > 3:
            k3 = _load_tile(kv_ptr, rows, valid, s_kv, cb3, D, DC, MASK_COLS)
            s = tl.dot(q3, tl.trans(k3), s, input_precision=DOT_PREC)
        s = tl.where(valid[None, :], s * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_use)
        p = tl.exp2(s - m_use[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        m_i = m_new
        pb = p.to(k0.dtype)
        acc0 = acc0 * alpha[:, None]
        acc0 = tl.dot(pb, k0, acc0, input_precision=DOT_PREC)
        if NV > 1:
            acc1 = acc1 * alpha[:, None]
            acc1 = tl.dot(pb, k1, acc1, input_precision=DOT_PREC)
        if NV > 2:
            acc2 = acc2 * alpha[:, None]
            acc2 = tl.dot(pb, k2, acc2, input_precision=DOT_PREC)
        if NV > 3:
            acc3 = acc3 * alpha[:, None]
            acc3 = tl.dot(pb, k3, acc3, input_precision=DOT_PREC)

    # no valid id: l = 0 → out 0, lse -inf; NaN (from q or kv) stays NaN: never `l_i > 0` (the reference's rule)
    l_safe = tl.where(l_i == 0, 1.0, l_i)
    o_row = out_ptr + t.to(tl.int64) * s_ot + heads[:, None] * s_oh
    cols = tl.arange(0, DC)
    omask = hmask[:, None] & (cb0 + cols < DV)[None, :]
    tl.store(o_row + (cb0 + cols)[None, :], (acc0 / l_safe[:, None]).to(out_ptr.dtype.element_ty), mask=omask)
    if NV > 1:
        omask = hmask[:, None] & (cb1 + cols < DV)[None, :]
        tl.store(o_row + (cb1 + cols)[None, :], (acc1 / l_safe[:, None]).to(out_ptr.dtype.element_ty), mask=omask)
    if NV > 2:
        omask = hmask[:, None] & (cb2 + cols < DV)[None, :]
        tl.store(o_row + (cb2 + cols)[None, :], (acc2 / l_safe[:, None]).to(out_ptr.dtype.element_ty), mask=omask)
    if NV > 3:
        omask = hmask[:, None] & (cb3 + cols < DV)[None, :]
        tl.store(o_row + (cb3 + cols)[None, :], (acc3 / l_safe[:, None]).to(out_ptr.dtype.element_ty), mask=omask)
    lse = tl.where(l_i == 0, float("-inf"), (m_i + tl.log2(l_safe)) * 0.6931471805599453)
    tl.store(lse_ptr + t.to(tl.int64) * s_lt + heads, lse, mask=hmask)


def _idx32(kv: torch.Tensor) -> bool:
    """Whether every element offset of kv fits int32 (then the gathers and atomics use int32 offsets)."""
    return kv.shape[0] * max(kv.stride(0), kv.shape[1]) < 2**31


def _dot_precision(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"


def sparse_mla_fwd(q, kv, token_ids, scale, d_v, *, block_n=None, num_warps=None, num_stages=None,
                   chunk=None, prefetch=None, idx32=None):
    """``(out [T, H, d_v] q.dtype, lse [T, H] fp32)`` of ``glm53::sparse_mla`` (see the module doc).

    q ``[T, H, D]``, kv ``[S, D]`` (one float dtype), token_ids ``[T, W]`` int32/int64 with -1
    padding; any strides. Keyword arguments override :func:`fwd_config` (benchmarks, tests)."""
    T, H, D = q.shape
    S, W = kv.shape[0], token_ids.shape[1]
    d_v = int(d_v)
    q, kv, token_ids = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, kv, token_ids))
    out = torch.empty((T, H, d_v), dtype=q.dtype, device=q.device)
    lse = torch.empty((T, H), dtype=torch.float32, device=q.device)
    if T == 0:
        return out, lse
    cfg = fwd_config(H, D, d_v)
    for key, val in (("block_n", block_n), ("num_warps", num_warps), ("num_stages", num_stages),
                     ("chunk", chunk), ("prefetch", prefetch), ("idx32", idx32)):
        if val is not None:
            cfg[key] = val
    dc, nc = chunking(D, cfg["chunk"])
    nv = triton.cdiv(d_v, dc)
    block_h = min(64, max(16, triton.next_power_of_2(H)))
    num_hg = triton.cdiv(H, block_h)
    grid = (T * num_hg,)
    _sparse_mla_fwd_kernel[grid](
        q, kv, token_ids, out, lse,
        T, H, W, S, float(scale) * LOG2E,
        q.stride(0), q.stride(1), kv.stride(0), token_ids.stride(0), out.stride(0), out.stride(1), lse.stride(0),
        D=D, DV=d_v, DC=dc, NC=nc, NV=nv, NUM_HG=num_hg, BLOCK_H=block_h,
        BLOCK_N=int(cfg["block_n"]), SCAN=min(1024, max(16, triton.next_power_of_2(W))),
        MASK_COLS=D % dc != 0, DOT_PREC=_dot_precision(q.dtype),
        PREFETCH=bool(cfg["prefetch"]), IDX32=_idx32(kv) if cfg.get("idx32") is None else bool(cfg["idx32"]),
        num_warps=int(cfg["num_warps"]), num_stages=int(cfg["num_stages"]),
    )
    return out, lse
