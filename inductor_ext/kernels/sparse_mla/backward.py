"""Triton backward of ``glm53::sparse_mla``: ``dq`` and ``dkv``, deterministic.

Imports only torch and triton, so it can be loaded by path on a GPU machine without the package.

One program per (query row ``t``, group of up to 64 heads), the forward's tiling: the row's ``q`` and
``dO`` stay loaded (as ``NC`` column chunks), ``delta = Σ dO·out − dlse`` is computed in the
program, and each block of ``BLOCK_N`` listed ids is one gather of ``[BLOCK_N, D]`` latent rows:

    s  = q · kᵀ,   p = exp2(s · scale · log2 e − lse · log2 e)   (0 at padding)
    dp = dO · vᵀ,  ds = scale · p · (dp − delta)                 [BLOCK_H, BLOCK_N] FP32
    dq += ds · k                                                   FP32 registers, fixed block order
    dk  = dsᵀ · q  (+ pᵀ · dO on the value chunks)                 [BLOCK_N, DC] per chunk

``ds`` and ``p`` enter the MMAs rounded to the input dtype. ``dq`` is rounded once at the end.

Determinism: ``dk`` tiles of different queries hit the same latent rows, so they are added into
one accumulator with atomics, but **integer** ones: int32 fixed point with one scale per latent row,
and integer addition is associative, so the sum (and ``dkv``) is bitwise the same in any order, run
to run. Two elements share one int64 word (column ``c`` of chunks ``2i`` and ``2i + 1``, the
accumulator ``[S, ceil(NC/2), DC]``): the word ``hi · 2^32 + lo`` (lo sign-extended) is added as one
integer, which halves the atomics (Hopper has vector atomics for floats only). The low field's
carries land in the high field; since the low field's sum stays inside int32, the word's low 32 bits
are that sum and ``(word − lo) >> 32`` the high field's.

Each row's scale comes from a bound the ``dq`` pass computes on the way (no host sync): for every
listed slot ``(t, j)`` it has ``p`` and ``ds`` of all heads, so

    c[t, j] = Σ_h |ds[h, j]| · max_d|q[t, h]| + p[h, j] · max_d|dO[t, h]|

(the sum over heads as two small MMAs) bounds that slot's contribution to every element of its row
``s = ids[t, j]``, and ``B_s = Σ_{(t, j) → s} c[t, j]`` bounds every partial sum of row s. The
``c`` are summed into an int64 ``[S]`` accumulator, rounded up, in a fixed point whose scale
(:func:`fixed_point_scale`) comes from a bound on their total, ``Σ_{t,h} |scale| · max|q[t,h]| ·
(2 · d_v · max|dO[t,h]| · max|kv[:, :d_v]| + |dlse[t,h]|) + max|dO[t,h]|`` (``Σ_j p_j = 1`` per
head, ``|dp|, |Σ dO·out| ≤ d_v · max|dO| · max|kv|``), scaled to 2^60: integer again, so ``B_s``
is deterministic too. Row s then scales its contributions by ``2^F_s``, ``F_s = floor(29 −
log2 B_s)`` (clamped to [-250, 250]; two exact power-of-two factors), and rounds them to the
nearest integer (halves away from zero): each field stays below ``2^29 · (1 + rounding)`` < 2^31,
two bits of margin for the bf16 rounding of ds/p, the MMAs' FP32 sums and the two passes' different
tilings. The quantum is ``2^-29 · B_s``; each add errs by at most half of it. ``B_s`` exceeds the
row's elements by the cancellations over heads and queries, so the error is about 2^-15 of an
element at the benchmark geometry (``docs/sparse-mla.md``): coarser than FP32 atomics, far below
the BF16 rounding of ``dkv``. ``dkv = fp32(field) · 2^-F_s`` rounded to kv's dtype. A bound per row
keeps a rarely picked row as precise as a popular one; non-finite q, dO or dlse make the scales
meaningless (dkv then undefined, not NaN).

``deterministic=False`` adds FP32 tiles with FP32 atomics instead (order-dependent rounding, not
bitwise repeatable; no bound).

Launches: a ``dq`` pass (no floating-point atomics; dq in FP32 registers; the row bounds) then a
``dkv`` pass (recomputes s, p, dp; no dq accumulator, so fewer registers). Measurements:
``docs/sparse-mla.md``.

Memory: the accumulator (4 bytes an element, D padded to whole chunk pairs), ``[S]`` bounds and
scales, ``dq``, ``dkv``; nothing ``[T, S]``. No host synchronisation: CUDA-graph safe.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

try:  # loaded by path (no package) on the GPU machine, or as inductor_ext.kernels.sparse_mla.backward
    from .forward import LOG2E, _dot_precision, _idx32, _load_tile, _valid_span, chunking
except ImportError:  # pragma: no cover - standalone load
    import importlib.util as _ilu
    import os as _os
    import sys as _sys

    _name = "_sparse_mla_forward_standalone"
    if _name not in _sys.modules:
        _spec = _ilu.spec_from_file_location(_name, _os.path.join(_os.path.dirname(__file__), "forward.py"))
        _mod = _ilu.module_from_spec(_spec)
        _sys.modules[_name] = _mod
        _spec.loader.exec_module(_mod)
    _fwd = _sys.modules[_name]
    LOG2E, _dot_precision, _idx32, _load_tile, _valid_span, chunking = (
        _fwd.LOG2E, _fwd._dot_precision, _fwd._idx32, _fwd._load_tile, _fwd._valid_span, _fwd.chunking)

__all__ = ["sparse_mla_bwd", "fixed_point_scale", "row_scales", "bwd_config", "softmax_delta"]

BOUND_HEADROOM_BITS = 60  # the total of the slot bounds is scaled to at most 2^60 (int64 holds 2^63 - 1)
ROW_HEADROOM_BITS = 29  # a row's bound B_s is scaled to at most 2^29 (int32 holds 2^31 - 1)
ROW_EXPONENT_LIMIT = 250  # |F_s| clamp: two factors of at most 2^125 each stay FP32 normals


def bwd_config(H: int, D: int, d_v: int) -> dict:
    """Default launch parameters of the two backward kernels (``dq`` pass, ``dkv`` pass)."""
    big = min(64, H) * D >= 64 * 256
    warps = 8 if big else 4
    return {"dq": {"block_n": 32, "num_warps": warps, "num_stages": 2, "prefetch": True},
            "dkv": {"block_n": 64, "num_warps": 4, "num_stages": 1, "prefetch": False}}


@triton.jit
def _to_fixed(dk, fa, fb):
    """``round(dk · fa · fb)`` as int32 (per-row factors ``fa``, ``fb``; halves away from zero)."""
    x = (dk * fa[:, None]) * fb[:, None]
    return tl.where(x >= 0, x + 0.5, x - 0.5).to(tl.int32)


@triton.jit
def _pack(lo, hi):
    """One int64 word holding two int32 fields: ``hi · 2^32 + lo`` (lo sign-extended)."""
    return (hi.to(tl.int64) << 32) + lo.to(tl.int64)


@triton.jit
def _add_words(acc_ptr, rows, valid, pair, w, NP: tl.constexpr, DC: tl.constexpr, SCATTER: tl.constexpr):
    """acc[rows, pair, :] += w (int64 words, the accumulator ``[S, NP, DC]``)."""
    ptrs = acc_ptr + rows[:, None] * (NP * DC) + pair * DC + tl.arange(0, DC)[None, :]
    if SCATTER:
        tl.atomic_add(ptrs, w, mask=valid[:, None], sem="relaxed")
    else:  # benchmark knob: keep the dk MMAs, skip the atomics (a store that never fires)
        tl.store(ptrs, w, mask=valid[:, None] & (w == 12345) & (rows[:, None] < 0))


@triton.jit
def _add_fp32(acc_ptr, rows, valid, cb, dk, D: tl.constexpr, DC: tl.constexpr, SCATTER: tl.constexpr):
    """acc[rows, cb : cb + DC] += dk (FP32 atomics, the accumulator ``[S, D]``)."""
    cols = cb + tl.arange(0, DC)
    ptrs = acc_ptr + rows[:, None] * D + cols[None, :]
    mask = valid[:, None] & (cols < D)[None, :]
    if SCATTER:
        tl.atomic_add(ptrs, dk, mask=mask, sem="relaxed")
    else:
        tl.store(ptrs, dk, mask=mask & (dk != dk) & (rows[:, None] < 0))


@triton.jit
def _sparse_mla_bwd_kernel(
    q_ptr, kv_ptr, ids_ptr, o_ptr, do_ptr, lse_ptr, dlse_ptr, dq_ptr, acc_ptr, qmax_ptr, gmax_ptr,
    bound_ptr, fx_ptr, rowfx_ptr,
    T, H, W, S, qk_scale, scale,
    s_qt, s_qh, s_kv, s_it, s_ot, s_oh, s_dot, s_doh, s_lt, s_dlt, s_dqt, s_dqh,
    D: tl.constexpr, DV: tl.constexpr, DC: tl.constexpr, NC: tl.constexpr, NV: tl.constexpr,
    NUM_HG: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, SCAN: tl.constexpr,
    MASK_COLS: tl.constexpr, MASK_V: tl.constexpr, FIXED: tl.constexpr, DOT_PREC: tl.constexpr,
    SCATTER: tl.constexpr, DQ: tl.constexpr, DKV: tl.constexpr, PREFETCH: tl.constexpr,
    IDX32: tl.constexpr,
):
    """One launch is the ``dq`` pass (``DQ``; with ``FIXED`` it also adds the slot bounds into
    ``bound_ptr``) or the ``dkv`` pass (``DKV``), never both: the dkv pass needs every row's scale."""
    pid = tl.program_id(0)
    t = T - 1 - pid // NUM_HG
    hg = pid % NUM_HG
    heads = hg * BLOCK_H + tl.arange(0, BLOCK_H)
    hmask = heads < H
    t64 = t.to(tl.int64)
    q_row = q_ptr + t64 * s_qt
    o_row = o_ptr + t64 * s_ot
    do_row = do_ptr + t64 * s_dot
    ids_row = ids_ptr + t64 * s_it
    n_lo, n_hi = _valid_span(ids_row, W, S, SCAN, BLOCK_N)

    q0 = _load_tile(q_row, heads, hmask, s_qh, 0, D, DC, MASK_COLS)
    if DQ:
        dq0 = tl.zeros([BLOCK_H, DC], dtype=tl.float32)
    do0 = _load_tile(do_row, heads, hmask, s_doh, 0, DV, DC, MASK_V)
    o0 = _load_tile(o_row, heads, hmask, s_oh, 0, DV, DC, MASK_V)
    delta = tl.sum(do0.to(tl.float32) * o0.to(tl.float32), 1)
    if NC > 1:
        q1 = _load_tile(q_row, heads, hmask, s_qh, DC, D, DC, MASK_COLS)
        if DQ:
            dq1 = tl.zeros([BLOCK_H, DC], dtype=tl.float32)
        if NV > 1:
            do1 = _load_tile(do_row, heads, hmask, s_doh, DC, DV, DC, MASK_V)
            o1 = _load_tile(o_row, heads, hmask, s_oh, DC, DV, DC, MASK_V)
            delta += tl.sum(do1.to(tl.float32) * o1.to(tl.float32), 1)
    if NC > 2:
        q2 = _load_tile(q_row, heads, hmask, s_qh, 2 * DC, D, DC, MASK_COLS)
        if DQ:
            dq2 = tl.zeros([BLOCK_H, DC], dtype=tl.float32)
        if NV > 2:
            do2 = _load_tile(do_row, heads, hmask, s_doh, 2 * DC, DV, DC, MASK_V)
            o2 = _load_tile(o_row, heads, hmask, s_oh, 2 * DC, DV, DC, MASK_V)
            delta += tl.sum(do2.to(tl.float32) * o2.to(tl.float32), 1)
    if NC > 3:
        q3 = _load_tile(q_row, heads, hmask, s_qh, 3 * DC, D, DC, MASK_COLS)
        if DQ:
            dq3 = tl.zeros([BLOCK_H, DC], dtype=tl.float32)
        if NV > 3:
            do3 = _load_tile(do_row, heads, hmask, s_doh, 3 * DC, DV, DC, MASK_V)
            o3 = _load_tile(o_row, heads, hmask, s_oh, 3 * DC, DV, DC, MASK_V)
            delta += tl.sum(do3.to(tl.float32) * o3.to(tl.float32), 1)
    delta -= tl.load(dlse_ptr + t64 * s_dlt + heads, mask=hmask, other=0.0)
    # padded heads: lse = +inf, so p = 0
    lse2 = tl.load(lse_ptr + t64 * s_lt + heads, mask=hmask, other=float("inf")) * 1.4426950408889634
    BOUND: tl.constexpr = DQ and FIXED
    NP: tl.constexpr = (NC + 1) // 2
    if BOUND:  # the per-head maxima as MMA operands (exact in q's dtype: maxima of its values)
        dt_in = q0.dtype
        qmax = tl.load(qmax_ptr + t64 * H + heads, mask=hmask, other=0.0).to(dt_in)
        gmax = tl.load(gmax_ptr + t64 * H + heads, mask=hmask, other=0.0).to(dt_in)
        qm = tl.broadcast_to(qmax[:, None], [BLOCK_H, 16])
        gm = tl.broadcast_to(gmax[:, None], [BLOCK_H, 16])
        fx = tl.load(fx_ptr)
        fx2 = tl.load(fx_ptr + 1)

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
        k0 = _load_tile(kv_ptr, rows, valid, s_kv, 0, D, DC, MASK_COLS)
        s = tl.dot(q0, tl.trans(k0), input_precision=DOT_PREC)
        dp = tl.dot(do0, tl.trans(k0), input_precision=DOT_PREC)
        if NC > 1:
            k1 = _load_tile(kv_ptr, rows, valid, s_kv, DC, D, DC, MASK_COLS)
            s = tl.dot(q1, tl.trans(k1), s, input_precision=DOT_PREC)
            if NV > 1:
                dp = tl.dot(do1, tl.trans(k1), dp, input_precision=DOT_PREC)
        if NC > 2:
            k2 = _load_tile(kv_ptr, rows, valid, s_kv, 2 * DC, D, DC, MASK_COLS)
            s = tl.dot(q2, tl.trans(k2), s, input_precision=DOT_PREC)
            if NV > 2:
                dp = tl.dot(do2, tl.trans(k2), dp, input_precision=DOT_PREC)
        if NC > 3:
            k3 = _load_tile(kv_ptr, rows, valid, s_kv, 3 * DC, D, DC, MASK_COLS)
            s = tl.dot(q3, tl.trans(k3), s, input_precision=DOT_PREC)
            if NV > 3:
                dp = tl.dot(do3, tl.trans(k3), dp, input_precision=DOT_PREC)
        p = tl.exp2(s * qk_scale - lse2[:, None])
        p = tl.where(valid[None, :], p, 0.0)
        ds = p * (dp - delta[:, None]) * scale
        dsb = ds.to(k0.dtype)
        if BOUND:  # c[j] of the module doc (the sum over heads by MMA), rounded up into the row bounds
            cT = tl.dot(tl.trans(tl.abs(dsb)), qm, input_precision=DOT_PREC)
            cT = tl.dot(tl.trans(p.to(dt_in)), gm, cT, input_precision=DOT_PREC)
            c = tl.max(cT, 1)  # the 16 columns are equal
            tl.atomic_add(bound_ptr + rows, tl.ceil((c * fx) * fx2).to(tl.int64), mask=valid, sem="relaxed")
        if DQ:
            dq0 = tl.dot(dsb, k0, dq0, input_precision=DOT_PREC)
            if NC > 1:
                dq1 = tl.dot(dsb, k1, dq1, input_precision=DOT_PREC)
            if NC > 2:
                dq2 = tl.dot(dsb, k2, dq2, input_precision=DOT_PREC)
            if NC > 3:
                dq3 = tl.dot(dsb, k3, dq3, input_precision=DOT_PREC)
        if DKV:
            if FIXED:
                fa = tl.load(rowfx_ptr + rows * 2, mask=valid, other=0.0)
                fb = tl.load(rowfx_ptr + rows * 2 + 1, mask=valid, other=0.0)
            dsT = tl.trans(dsb)
            pT = tl.trans(p.to(k0.dtype))
            dk = tl.dot(dsT, q0, input_precision=DOT_PREC)
            dk = tl.dot(pT, do0, dk, input_precision=DOT_PREC)
            if FIXED:  # chunks 2i and 2i+1 share one int64 word per element pair
                x0 = _to_fixed(dk, fa, fb)
                if NC == 1:
                    _add_words(acc_ptr, rows, valid, 0, x0.to(tl.int64), NP, DC, SCATTER)
            else:
                _add_fp32(acc_ptr, rows, valid, 0, dk, D, DC, SCATTER)
            if NC > 1:
                dk = tl.dot(dsT, q1, input_precision=DOT_PREC)
                if NV > 1:
                    dk = tl.dot(pT, do1, dk, input_precision=DOT_PREC)
                if FIXED:
                    _add_words(acc_ptr, rows, valid, 0, _pack(x0, _to_fixed(dk, fa, fb)), NP, DC, SCATTER)
                else:
                    _add_fp32(acc_ptr, rows, valid, DC, dk, D, DC, SCATTER)
            if NC > 2:
                dk = tl.dot(dsT, q2, input_precision=DOT_PREC)
                if NV > 2:
                    dk = tl.dot(pT, do2, dk, input_precision=DOT_PREC)
                if FIXED:
                    x2 = _to_fixed(dk, fa, fb)
                    if NC == 3:
                        _add_words(acc_ptr, rows, valid, 1, x2.to(tl.int64), NP, DC, SCATTER)
                else:
                    _add_fp32(acc_ptr, rows, valid, 2 * DC, dk, D, DC, SCATTER)
            if NC > 3:
                dk = tl.dot(dsT, q3, input_precision=DOT_PREC)
                if NV > 3:
                    dk = tl.dot(pT, do3, dk, input_precision=DOT_PREC)
                if FIXED:
                    _add_words(acc_ptr, rows, valid, 1, _pack(x2, _to_fixed(dk, fa, fb)), NP, DC, SCATTER)
                else:
                    _add_fp32(acc_ptr, rows, valid, 3 * DC, dk, D, DC, SCATTER)

    if DQ:
        dq_row = dq_ptr + t64 * s_dqt + heads[:, None] * s_dqh
        cols = tl.arange(0, DC)
        dt = dq_ptr.dtype.element_ty
        tl.store(dq_row + cols[None, :], dq0.to(dt), mask=hmask[:, None] & (cols < D)[None, :])
        if NC > 1:
            tl.store(dq_row + (DC + cols)[None, :], dq1.to(dt), mask=hmask[:, None] & (DC + cols < D)[None, :])
        if NC > 2:
            tl.store(dq_row + (2 * DC + cols)[None, :], dq2.to(dt), mask=hmask[:, None] & (2 * DC + cols < D)[None, :])
        if NC > 3:
            tl.store(dq_row + (3 * DC + cols)[None, :], dq3.to(dt), mask=hmask[:, None] & (3 * DC + cols < D)[None, :])


@triton.jit
def _fixed_to_float_kernel(acc_ptr, out_ptr, inv_ptr, N, D: tl.constexpr, DC: tl.constexpr, NP: tl.constexpr,
                           BLOCK: tl.constexpr):
    """out[s, d] = field of acc[s, d // DC // 2, d % DC] (low for even chunks) · 2^-F_s."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < N
    row = offs // D
    chunk = (offs % D) // DC
    w = tl.load(acc_ptr + row * (NP * DC) + (chunk // 2) * DC + offs % DC, mask=mask, other=0)
    lo = w.to(tl.int32)  # the low field's sum stays in int32 range, so the low 32 bits are it
    hi = ((w - lo.to(tl.int64)) >> 32).to(tl.int32)
    acc = tl.where(chunk % 2 == 0, lo, hi)
    x = (acc.to(tl.float32) * tl.load(inv_ptr + row * 2, mask=mask, other=0.0)) * tl.load(
        inv_ptr + row * 2 + 1, mask=mask, other=0.0)
    tl.store(out_ptr + offs, x.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _delta_kernel(o_ptr, do_ptr, dlse_ptr, out_ptr, o_t, o_h, do_t, do_h, H, DV: tl.constexpr,
                  BLOCK: tl.constexpr):
    """out[r] = Σ_d o[t, h, d] · do[t, h, d] − dlse[r] in FP32, one (query, head) row ``r = t·H + h``
    per program (``o_t``, ``o_h``, ``do_t``, ``do_h``: the two tensors' query and head strides)."""
    r = tl.program_id(0).to(tl.int64)
    t, h = r // H, r % H
    cols = tl.arange(0, BLOCK)
    m = cols < DV
    o = tl.load(o_ptr + t * o_t + h * o_h + cols, mask=m, other=0.0).to(tl.float32)
    g = tl.load(do_ptr + t * do_t + h * do_h + cols, mask=m, other=0.0).to(tl.float32)
    tl.store(out_ptr + r, tl.sum(o * g, 0) - tl.load(dlse_ptr + r))


def softmax_delta(out: torch.Tensor, dout: torch.Tensor, dlse: torch.Tensor) -> torch.Tensor:
    """``delta [T, H]`` FP32 ``= Σ_d out · dout − dlse`` (the softmax backward's row term), without
    FP32 copies of ``out`` or ``dout``; any query and head strides (``dout`` head-major, as the
    absorbed layer's per-head GEMM leaves it, is read in place)."""
    T, H, d_v = out.shape
    out, dout = (x if x.stride(-1) == 1 else x.contiguous() for x in (out, dout))
    dlse = dlse.float().contiguous()
    delta = torch.empty((T, H), dtype=torch.float32, device=out.device)
    if T * H:
        _delta_kernel[(T * H,)](out, dout, dlse, delta, out.stride(0), out.stride(1), dout.stride(0), dout.stride(1),
                                H, DV=d_v, BLOCK=triton.next_power_of_2(d_v))
    return delta


def _absmax(x: torch.Tensor, dim=None) -> torch.Tensor:
    """max |x| (over ``dim``, or all) in FP64, without an ``abs`` copy of x."""
    if x.numel() == 0:
        return torch.zeros((), dtype=torch.float64, device=x.device)
    lo, hi = torch.aminmax(x) if dim is None else torch.aminmax(x, dim=dim)
    return torch.maximum(-lo.double(), hi.double())


def _power_pair(f: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(2^f, 2^-f)`` as two FP32 factors each (last dim 2) for integer-valued ``f`` in
    [-250, 250]: each factor is a power of two within FP32's normal range, so scaling by the pair
    is exact."""
    half = torch.floor(f / 2)
    parts = torch.stack((half, f - half), dim=-1)
    return torch.exp2(parts).float(), torch.exp2(-parts).float()


def fixed_point_scale(q, kv, dout, dlse, scale, d_v, qmax=None, gmax=None):
    """``(fx, inv)``: 2-element FP32 tensors whose products are ``2^F`` and ``2^-F`` for the int64
    accumulator of the row bounds (module doc), computed on the device from element-wise maxima
    (no host synchronisation). ``qmax`` / ``gmax``: precomputed ``max_d |q|`` / ``max_d |dO|``
    ``[T, H]``. F is clamped to [-120, 240]."""
    qmax = _absmax(q, -1) if qmax is None else qmax.double()
    gmax = _absmax(dout, -1) if gmax is None else gmax.double()
    kvmax = _absmax(kv[:, :d_v])
    bound = (abs(float(scale)) * qmax * (2.0 * d_v * gmax * kvmax + dlse.double().abs()) + gmax).sum()
    f = torch.floor(BOUND_HEADROOM_BITS - torch.log2(bound))
    return _power_pair(torch.nan_to_num(f, nan=0.0).clamp(-120.0, 240.0))


def row_scales(bound_acc: torch.Tensor, inv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(fx, inv)`` ``[S, 2]`` FP32: per latent row the factors ``2^F_s`` and ``2^-F_s`` of its
    int32 accumulator, from the int64 row bounds and their scale's inverse ``inv`` (module doc)."""
    b = bound_acc.double() * inv.double().prod()
    f = torch.floor(ROW_HEADROOM_BITS - torch.log2(b))
    f = torch.nan_to_num(f, nan=0.0, posinf=ROW_EXPONENT_LIMIT).clamp(-ROW_EXPONENT_LIMIT, ROW_EXPONENT_LIMIT)
    return _power_pair(f)


def sparse_mla_bwd(q, kv, token_ids, out, lse, dout, dlse, scale, d_v, *, deterministic=True,
                   dq_config=None, dkv_config=None, chunk=None, scatter=True, passes=("dq", "dkv")):
    """``(dq [T, H, D] q.dtype, dkv [S, D] kv.dtype)`` of ``glm53::sparse_mla`` given the forward's
    ``out``, ``lse`` and the output gradients ``dout [T, H, d_v]``, ``dlse [T, H]`` (module doc).

    Two launches of one kernel: a ``dq`` pass (no floating-point atomics; the row bounds) and a
    ``dkv`` pass (recomputes ``s``, ``p``, ``dp``; int64 atomics of packed int32 pairs), each with its own registers and
    shared memory. ``dq_config`` / ``dkv_config`` override :func:`bwd_config` (keys block_n,
    num_warps, num_stages, prefetch, idx32). ``scatter=False`` and ``passes`` (a subset of
    ``("dq", "dkv")``) are benchmark knobs: the dkv pass skips its atomics / only the named passes
    run (the other results are then wrong)."""
    T, H, D = q.shape
    S, W = kv.shape[0], token_ids.shape[1]
    d_v = int(d_v)
    q, kv, token_ids, out, dout = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, kv, token_ids, out, dout))
    lse, dlse = lse.float(), dlse.float()
    dq = torch.empty((T, H, D), dtype=q.dtype, device=q.device)
    dkv = torch.empty((S, D), dtype=kv.dtype, device=kv.device)
    if T == 0:
        return dq, dkv.zero_()
    cfg = bwd_config(H, D, d_v)
    cfg["dq"].update(dq_config or {})
    cfg["dkv"].update(dkv_config or {})
    dc, nc = chunking(D, chunk)
    nv = triton.cdiv(d_v, dc)
    block_h = min(64, max(16, triton.next_power_of_2(H)))
    num_hg = triton.cdiv(H, block_h)
    if deterministic:
        acc = torch.zeros((S, triton.cdiv(nc, 2), dc), dtype=torch.int64, device=kv.device)
        qmax, gmax = _absmax(q, -1).float(), _absmax(dout, -1).float()
        fx, inv = fixed_point_scale(q, kv, dout, dlse, scale, d_v, qmax, gmax)
        bound = torch.zeros((S,), dtype=torch.int64, device=kv.device)
    else:
        acc = torch.zeros((S, D), dtype=torch.float32, device=kv.device)
        qmax = gmax = fx = inv = bound = acc
    rowfx = acc
    for name, do_dq, do_dkv in (("dq", True, False), ("dkv", False, True)):
        if do_dkv and deterministic:
            rowfx, rowinv = row_scales(bound, inv)
        if name not in passes:
            continue
        c = cfg[name]
        _sparse_mla_bwd_kernel[(T * num_hg,)](
            q, kv, token_ids, out, dout, lse, dlse, dq, acc, qmax, gmax, bound, fx, rowfx,
            T, H, W, S, float(scale) * LOG2E, float(scale),
            q.stride(0), q.stride(1), kv.stride(0), token_ids.stride(0), out.stride(0), out.stride(1),
            dout.stride(0), dout.stride(1), lse.stride(0), dlse.stride(0), dq.stride(0), dq.stride(1),
            D=D, DV=d_v, DC=dc, NC=nc, NV=nv, NUM_HG=num_hg, BLOCK_H=block_h, BLOCK_N=int(c["block_n"]),
            SCAN=min(1024, max(16, triton.next_power_of_2(W))), MASK_COLS=D % dc != 0, MASK_V=d_v % dc != 0,
            FIXED=bool(deterministic), DOT_PREC=_dot_precision(q.dtype), SCATTER=bool(scatter),
            DQ=do_dq, DKV=do_dkv, PREFETCH=bool(c["prefetch"]),
            IDX32=_idx32(kv) if c.get("idx32") is None else bool(c["idx32"]),
            num_warps=int(c["num_warps"]), num_stages=int(c["num_stages"]),
        )
    if deterministic:
        n = dkv.numel()
        block = 1024
        _fixed_to_float_kernel[(triton.cdiv(n, block),)](acc, dkv, rowinv, n, D=D, DC=dc, NP=acc.shape[1],
                                                         BLOCK=block)
    else:
        dkv.copy_(acc)
    return dq, dkv
