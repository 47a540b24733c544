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
one accumulator with atomics, but **integer** ones: the accumulator is int64 fixed point
``[S, D]`` and integer addition is associative, so the sum (and ``dkv``) is bitwise the same in
any order, run to run. Scaling (:func:`fixed_point_scale`, on the device, no host sync): every
partial sum of a ``dkv`` element is at most

    B = Σ_{t,h} [ |scale| · max_d|q[t,h]| · (2 · d_v · max|dO[t,h]| · max|kv[:, :d_v]| + |dlse[t,h]|)
                 + max|dO[t,h]| ]

in magnitude (``|ds| ≤ |scale| · p · (|dp| + |delta| + |dlse|)`` with ``Σ_j p_j = 1`` over a
row's positions; ``|dp|, |Σ dO·out| ≤ ‖dO‖·max‖v‖ ≤ d_v · max|dO| · max|kv|``; ``Σ_j p_j ≤ 1``
for the value term). The contributions are scaled by ``2^F``, ``F = floor(60 − log2 B)`` (clamped
to [-120, 240]; applied as two exact power-of-two factors), and rounded to the nearest integer
(halves away from zero): the accumulator stays below ``2^60 · (1 + rounding)`` < 2^63, 3 bits of
margin for the bf16 rounding of ds/p and the MMAs' FP32 sums. The quantum ``2^-F`` is ~2^-60 of
the bound, far below an FP32 ulp of any element within ~2^30 of it; each add errs by at most half
a quantum. ``dkv = fp32(acc) · 2^-F`` rounded to kv's dtype (int64 → fp32 → dtype: one extra
round-to-nearest step on the FP32 value).
Non-finite q, dO or dlse make the scale meaningless (dkv then undefined, not NaN).

``deterministic=False`` adds FP32 tiles with FP32 atomics instead (order-dependent rounding, not
bitwise repeatable). H200, T = 8192, H = 64, D = d_v = 512, 2051 causal random ids (CUDA-graph
replay, p50): dq pass 17.5 ms; dkv pass 46.5 ms with int64 atomics, 18.9 ms with FP32 atomics
(26.7 ms at 8 warps with no atomics at all: the int64 conversion and 8-byte atomics cost ~20 ms);
both passes 63.0 ms (int64) / 35.5 ms (FP32 atomics).

Launches: a ``dq`` pass (no atomics, dq in FP32 registers) then a ``dkv`` pass (recomputes s, p, dp;
no dq accumulator, so fewer registers); ``fused=True`` runs one pass doing both (H200: 101.6 ms
against 64.9 ms for the two passes at the geometry above, from register spills).

Memory: the ``[S, D]`` accumulator (8 bytes an element), ``dq``, ``dkv``; nothing ``[T, S]``.
No host synchronisation: CUDA-graph safe.
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

__all__ = ["sparse_mla_bwd", "fixed_point_scale", "bwd_config", "FIXED_POINT_HEADROOM_BITS"]

FIXED_POINT_HEADROOM_BITS = 60  # the bound B is scaled to at most 2^60 (int64 holds 2^63 - 1)


def bwd_config(H: int, D: int, d_v: int) -> dict:
    """Default launch parameters of the two backward kernels (``dq`` pass, ``dkv`` pass)."""
    big = min(64, H) * D >= 64 * 256
    warps = 8 if big else 4
    return {"dq": {"block_n": 32, "num_warps": warps, "num_stages": 2, "prefetch": True},
            "dkv": {"block_n": 64, "num_warps": 4, "num_stages": 1, "prefetch": False}}


@triton.jit
def _scatter_add(acc_ptr, rows, valid, cb, dk, fx, fx2, D: tl.constexpr, DC: tl.constexpr, FIXED: tl.constexpr,
                 SCATTER: tl.constexpr):
    """acc[rows, cb : cb + DC] += dk (int64 fixed point ``round(dk · fx · fx2)``, or FP32)."""
    cols = cb + tl.arange(0, DC)
    ptrs = acc_ptr + rows[:, None] * D + cols[None, :]
    mask = valid[:, None] & (cols < D)[None, :]
    if not SCATTER:  # benchmark knob: keep the dk MMAs, skip the atomics (a store that never fires)
        tl.store(ptrs, dk.to(acc_ptr.dtype.element_ty), mask=mask & (dk != dk) & (rows[:, None] < 0))
    elif FIXED:
        x = (dk * fx) * fx2
        x = tl.where(x >= 0, x + 0.5, x - 0.5)
        tl.atomic_add(ptrs, x.to(tl.int64), mask=mask, sem="relaxed")
    else:
        tl.atomic_add(ptrs, dk, mask=mask, sem="relaxed")


@triton.jit
def _sparse_mla_bwd_kernel(
    q_ptr, kv_ptr, ids_ptr, o_ptr, do_ptr, lse_ptr, dlse_ptr, dq_ptr, acc_ptr, fx_ptr,
    T, H, W, S, qk_scale, scale,
    s_qt, s_qh, s_kv, s_it, s_ot, s_oh, s_dot, s_doh, s_lt, s_dlt, s_dqt, s_dqh,
    D: tl.constexpr, DV: tl.constexpr, DC: tl.constexpr, NC: tl.constexpr, NV: tl.constexpr,
    NUM_HG: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, SCAN: tl.constexpr,
    MASK_COLS: tl.constexpr, MASK_V: tl.constexpr, FIXED: tl.constexpr, DOT_PREC: tl.constexpr,
    SCATTER: tl.constexpr, DQ: tl.constexpr, DKV: tl.constexpr, PREFETCH: tl.constexpr,
    IDX32: tl.constexpr,
):
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
    if FIXED:
        fx = tl.load(fx_ptr)
        fx2 = tl.load(fx_ptr + 1)
    else:
        fx = 1.0
        fx2 = 1.0

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
        if DQ:
            dq0 = tl.dot(dsb, k0, dq0, input_precision=DOT_PREC)
            if NC > 1:
                dq1 = tl.dot(dsb, k1, dq1, input_precision=DOT_PREC)
            if NC > 2:
                dq2 = tl.dot(dsb, k2, dq2, input_precision=DOT_PREC)
            if NC > 3:
                dq3 = tl.dot(dsb, k3, dq3, input_precision=DOT_PREC)
        if DKV:
            dsT = tl.trans(dsb)
            pT = tl.trans(p.to(k0.dtype))
            dk = tl.dot(dsT, q0, input_precision=DOT_PREC)
            dk = tl.dot(pT, do0, dk, input_precision=DOT_PREC)
            _scatter_add(acc_ptr, rows, valid, 0, dk, fx, fx2, D, DC, FIXED, SCATTER)
            if NC > 1:
                dk = tl.dot(dsT, q1, input_precision=DOT_PREC)
                if NV > 1:
                    dk = tl.dot(pT, do1, dk, input_precision=DOT_PREC)
                _scatter_add(acc_ptr, rows, valid, DC, dk, fx, fx2, D, DC, FIXED, SCATTER)
            if NC > 2:
                dk = tl.dot(dsT, q2, input_precision=DOT_PREC)
                if NV > 2:
                    dk = tl.dot(pT, do2, dk, input_precision=DOT_PREC)
                _scatter_add(acc_ptr, rows, valid, 2 * DC, dk, fx, fx2, D, DC, FIXED, SCATTER)
            if NC > 3:
                dk = tl.dot(dsT, q3, input_precision=DOT_PREC)
                if NV > 3:
                    dk = tl.dot(pT, do3, dk, input_precision=DOT_PREC)
                _scatter_add(acc_ptr, rows, valid, 3 * DC, dk, fx, fx2, D, DC, FIXED, SCATTER)

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
def _fixed_to_float_kernel(acc_ptr, out_ptr, inv_ptr, N, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < N
    acc = tl.load(acc_ptr + offs, mask=mask, other=0)
    x = (acc.to(tl.float32) * tl.load(inv_ptr)) * tl.load(inv_ptr + 1)
    tl.store(out_ptr + offs, x.to(out_ptr.dtype.element_ty), mask=mask)


def _absmax(x: torch.Tensor, dim=None) -> torch.Tensor:
    """max |x| (over ``dim``, or all) in FP64, without an ``abs`` copy of x."""
    if x.numel() == 0:
        return torch.zeros((), dtype=torch.float64, device=x.device)
    lo, hi = torch.aminmax(x) if dim is None else torch.aminmax(x, dim=dim)
    return torch.maximum(-lo.double(), hi.double())


def fixed_point_scale(q, kv, dout, dlse, scale, d_v):
    """``(fx, inv)``: 2-element FP32 tensors whose products are ``2^F`` and ``2^-F`` for the int64
    accumulator (module doc), computed on the device from element-wise maxima (no host
    synchronisation). F is clamped to [-120, 240]; each factor is a power of two within FP32's
    normal range, so scaling by the pair is exact."""
    qmax = _absmax(q, -1)  # [T, H]
    gmax = _absmax(dout, -1)  # [T, H]
    kvmax = _absmax(kv[:, :d_v])
    bound = (abs(float(scale)) * qmax * (2.0 * d_v * gmax * kvmax + dlse.double().abs()) + gmax).sum()
    f = torch.floor(FIXED_POINT_HEADROOM_BITS - torch.log2(bound))
    f = torch.nan_to_num(f, nan=0.0).clamp(-120.0, 240.0)
    half = torch.floor(f / 2)
    parts = torch.stack((half, f - half))
    return torch.exp2(parts).float(), torch.exp2(-parts).float()


def sparse_mla_bwd(q, kv, token_ids, out, lse, dout, dlse, scale, d_v, *, deterministic=True, fused=False,
                   dq_config=None, dkv_config=None, chunk=None, scatter=True, passes=("dq", "dkv")):
    """``(dq [T, H, D] q.dtype, dkv [S, D] kv.dtype)`` of ``glm53::sparse_mla`` given the forward's
    ``out``, ``lse`` and the output gradients ``dout [T, H, d_v]``, ``dlse [T, H]`` (module doc).

    Two launches of one kernel by default: a ``dq`` pass (no atomics) and a ``dkv`` pass (recomputes
    ``s``, ``p``, ``dp``; int64 atomics), each with its own registers and shared memory;
    ``fused=True`` does both in one pass (``dq_config`` sets its launch). ``dq_config`` /
    ``dkv_config`` override :func:`bwd_config` (keys block_n, num_warps, num_stages, prefetch).
    ``scatter=False`` and ``passes`` (a subset of ``("dq", "dkv")``) are benchmark knobs: the dkv
    pass skips its atomics / only the named passes run (the other results are then wrong)."""
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
        acc = torch.zeros((S, D), dtype=torch.int64, device=kv.device)
        fx, inv = fixed_point_scale(q, kv, dout, dlse, scale, d_v)
    else:
        acc = torch.zeros((S, D), dtype=torch.float32, device=kv.device)
        fx = inv = None
    launches = [("dq", True, True)] if fused else [("dq", True, False), ("dkv", False, True)]
    for name, do_dq, do_dkv in launches:
        if not fused and name not in passes:
            continue
        c = cfg[name]
        _sparse_mla_bwd_kernel[(T * num_hg,)](
            q, kv, token_ids, out, dout, lse, dlse, dq, acc, fx if deterministic else acc,
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
        n = acc.numel()
        block = 1024
        _fixed_to_float_kernel[(triton.cdiv(n, block),)](acc, dkv, inv, n, BLOCK=block)
    else:
        dkv.copy_(acc)
    return dq, dkv
