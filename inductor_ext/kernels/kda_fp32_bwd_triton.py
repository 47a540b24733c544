"""FP32-accurate KDA chunk backward in Triton: ``kda_fp32_bwd``, the VJP of ``kda_fp32_fwd``.

Gradients of (o, final state) w.r.t. q, k, v, g, beta and the initial state, recomputed from the
inputs, or from the inputs and the forward's Aqk and A⁻¹ (``given_a``). Per chunk (rows i, j;
``T = A⁻¹``, ``h`` the state entering the chunk, ``h'`` the one leaving it, ``dh'`` its gradient)::

    forward:  v_new = u − w·h,  o = qg·h + Aqk·v_new,  h' = e^{gc_last}·h + kgᵀ·v_new
    backward: dv_new = Aqkᵀ·do + kg·dh',  dh = e^{gc_last}·dh' + qgᵀ·do − wᵀ·dv_new

then, inside the chunk, through ``w = T(β k̂ e^{gc})``, ``u = T(β v)``, ``A = I + β_i·KK`` and the decay
products ``Σ_k x_ik k̂_jk e^{gc_ik − gc_jk}`` (the forward's factors: whole chunk at row 32 where the span
check passes, else 16-column blocks, else exact), the FP64 chunk cumulative gate (a reverse cumsum)
and the L2 norms.

Seven steps, no host synchronisation:

1. the forward's ``_chunk_kernel`` (two launches) and ``_solve_kernel``, which also store A⁻¹, the
   k̂–k̂ products and the rows' inverse norms, or, given A⁻¹ and Aqk from the forward (``given_a``),
   only recompute qg, kgᵀ, w, u (the chunk kernel then in one launch);
2. the forward's ``_state_kernel`` with ``SPLIT``: the state entering every chunk and v_new;
3. ``_state_bwd_kernel``, one program per (V block, head, document), backwards over chunks with dh
   in registers: stores dv_new and the dh' of every chunk, and dh0;
4. ``_chunk_bwd_wy_kernel``, one program per (chunk, head): dv, the decay products' cotangents,
   d(β k̂ e^{gc}) and dβ's share from u and A;
5. ``_chunk_bwd_kernel``, one program per (chunk, head, K-slice): d q̂, d k̂, d gc into scratch with
   the decay products' whole-chunk path, flagging a slice whose span check fails; the slice's row
   sums (dβ's share, q̂·d q̂, k̂·d k̂);
6. ``_chunk_bwd_blocks_kernel``, the same grid, idle but for flagged slices: their decay products'
   backward by 16-column blocks (or exact), added into d q̂, d k̂, d gc and the row sums;
7. ``_chunk_bwd_finish_kernel``, one program per (chunk, head), one pass: dg (reverse cumsum), dq
   and dk (through the L2 norms), dβ.

Every dot here is ``_dot3`` (three TF32 MMAs on split operands). Scratch at T = 16384, H = 64, K = V = 128:
about 9 GB of FP32 intermediates. H200 times and the versions tried: ``notes/kda-fp32-kernels.md``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from inductor_ext.kernels import kda_fp32_triton
from inductor_ext.kernels.kda_fp32_triton import (
    _block_rows,
    _check,
    _chunk_exponents,
    _check_blocks,
    _doc_tiles,
    _dot3,
    _exact_column,
    _k_slice,
    _load_state,
    _slot,
    _store_state,
    chunk_pass,
    contiguous_inputs,
    state_pass,
)

__all__ = ["kda_fp32_bwd"]

# the backward state pass is not software-pipelined: H200, T = 16384, H = 64, K = V = 128, block_v 64:
# 3.95 ms at 1 stage against 6.06 ms at 2 (its loop carries five dots and 196 KB of staged loads)
STATE_BWD_STAGES = 1
# nor is the WY backward's loop (same geometry: 2.96 ms at 1 stage, 3.38 at 2); the per-slice chunk-gradient
# kernel's is, 3 deep (its V loop's loads of HS, dh', do and v_new in flight: 8.57 / 7.47 / 7.36 ms at 1 / 2 / 3)
CHUNK_BWD_WY_STAGES = 1
CHUNK_BWD_STAGES = 3


# ---------------------------------------------------------------------------------------------
# kernel 3: the state pass backwards, one program per (V block, head, document)
# ---------------------------------------------------------------------------------------------


@triton.jit
def _tile_t(ptr, rows, cols, ld: tl.constexpr):
    """The transpose of the row-major tile ``ptr[rows, cols]`` (leading dimension ld)."""
    return tl.trans(tl.load(ptr + rows[:, None] * ld + cols[None, :]))


@triton.jit
def _state_bwd_kernel(QG, KGT, W, AQK, DEC, do, dht, dh0, cu, first_slot, DHS, DVN,
                      H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                      BVT: tl.constexpr, HAS_DHT: tl.constexpr):
    # dh [K, BVT] held as one or two [≤64, BVT] tiles (K rows 0-63, 64-127), as the forward state
    KS: tl.constexpr = BK if BK < 64 else 64
    TWO: tl.constexpr = BK > 64
    i_h = tl.program_id(1)
    bos, length, slot0, ck, cv, off_a, off_b, m_a, m_b = _doc_tiles(
        cu, first_slot, tl.program_id(0), i_h, tl.program_id(2), H, K, V, KS, BVT)
    r = tl.arange(0, 64)
    da, db = _load_state(dht, off_a, off_b, m_a, m_b, HAS_DHT, KS, BVT)
    n_chunks = tl.cdiv(length, 64).to(tl.int32)
    for i in range(n_chunks):
        it = n_chunks - 1 - i
        slot = (slot0 + it).to(tl.int64) * H + i_h
        p_h = DHS + slot * (BK * BV) + ck[:, None] * BV + cv[None, :]
        tl.store(p_h, da)  # dh' of this chunk: the gradient of the state leaving it
        if TWO:
            tl.store(p_h + 64 * BV, db)
        tok = bos + it * 64 + r
        m_o = (r < length - it * 64)[:, None] & (cv < V)[None, :]
        d_o = tl.load(do + tok[:, None] * (H * V) + i_h * V + cv[None, :], mask=m_o, other=0.0).to(tl.float32)
        base = slot * (64 * BK)
        # dv_new = Aqkᵀ·do + kg·dh'   (kg = KGTᵀ)
        dvn = _dot3(_tile_t(AQK + slot * 4096, r, r, 64), d_o)
        dvn += _dot3(_tile_t(KGT + slot * (BK * 64), ck, r, 64), da)
        if TWO:
            dvn += _dot3(_tile_t(KGT + slot * (BK * 64) + 64 * 64, ck, r, 64), db)
        tl.store(DVN + slot * (64 * BV) + r[:, None] * BV + cv[None, :], dvn)
        # dh = e^{gc_last}·dh' + qgᵀ·do − wᵀ·dv_new
        p_d = DEC + slot * BK + ck
        da = da * tl.load(p_d)[:, None] + _dot3(_tile_t(QG + base, r, ck, BK), d_o) \
            - _dot3(_tile_t(W + base, r, ck, BK), dvn)
        if TWO:
            db = db * tl.load(p_d + 64)[:, None] + _dot3(_tile_t(QG + base + 64, r, ck, BK), d_o) \
                - _dot3(_tile_t(W + base + 64, r, ck, BK), dvn)
    _store_state(dh0, da, db, off_a, off_b, m_a, m_b, TWO)


# ---------------------------------------------------------------------------------------------
# kernel 4: within-chunk gradients, one program per (chunk slot, head)
# ---------------------------------------------------------------------------------------------


@triton.jit
def _right_rows(sel, kJ, dkJ, BKB: tl.constexpr):
    """The right factor's rows (block J) back in place: d k̂_j and d gc_j = −k̂_j·d k̂_j, [64, BKB]."""
    return (tl.reshape(tl.where(sel, dkJ[None, :, :], 0.0), [64, BKB]),
            tl.reshape(tl.where(sel, (-kJ * dkJ)[None, :, :], 0.0), [64, BKB]))


@triton.jit
def _decay_products_bwd(dp, qh, kh, gc, ref, r, SPAN: tl.constexpr):
    """One K-slice's gradients through the decay products ``P_ij = Σ_k x_ik k̂_jk e^{gc_ik − gc_jk}``,
    whole chunk at once with the forward's factors at row 32: x = q̂ with cotangent dP_q at ``dp``,
    x = k̂ with dP_k at ``dp + 4096`` ([64,64] row-major each, masked). Returns d q̂, d k̂, d gc
    ([64, BKB] FP32) and ok = no exponent exceeds SPAN; if not, the slice contributes nothing here
    and ``_chunk_bwd_blocks_kernel`` takes it by 16-column blocks (a branch here would cost every
    slice: session 11's exact-path branch cost 8 ms of that kernel's 30 at T = 16384 on the H200)."""
    x = _chunk_exponents(gc, ref)
    ok = tl.max(tl.abs(x)) <= SPAN
    el = tl.exp(tl.where(ok, x, -float("inf")))  # both zero unless ok
    er = tl.exp(tl.where(ok, -x, -float("inf")))
    kr = kh * er
    c64 = tl.arange(0, 64)
    off = r[:, None] * 64 + c64[None, :]
    off_t = c64[:, None] + r[None, :] * 64  # the transpose, read from memory
    gq = el * _dot3(tl.load(dp + off), kr)
    gk = el * _dot3(tl.load(dp + 4096 + off), kr)
    dk_right = er * (_dot3(tl.load(dp + off_t), qh * el) + _dot3(tl.load(dp + 4096 + off_t), kh * el))
    return gq, gk + dk_right, qh * gq + kh * gk - kh * dk_right, ok


@triton.jit
def _col_block_bwd(dp, qh, kh, gc, r, J: tl.constexpr, BKB: tl.constexpr, SPAN: tl.constexpr):
    """One K-slice's gradients through column block J (columns 16J..16J+15) of the decay products
    ``P_ij = Σ_k x_ik k̂_jk e^{gc_ik − gc_jk}``: x = q̂ with cotangent dP_q at ``dp``, x = k̂ with dP_k
    at ``dp + 4096`` ([64,64] row-major each, masked). Factors as in the forward's ``_col_block``
    (reference row 16J+8, each factor ≤ e^{SPAN}). Returns d q̂, d k̂, d gc ([64, BKB] FP32) and
    ok = the span check passed; if not, the block contributes nothing (the caller takes the exact
    path for it)."""
    a16 = tl.arange(0, 16)
    sel, kJ, gJ = _block_rows(kh, gc, J, BKB)
    ref = tl.sum(tl.where((a16 == 8)[:, None], gJ, 0.0), 0)  # gc at row 16J+8
    below = r[:, None] >= 16 * J
    left = tl.where(below, gc - ref[None, :], 0.0).to(tl.float32)
    right = (ref[None, :] - gJ).to(tl.float32)
    ok = tl.maximum(tl.max(left), tl.max(right)) <= SPAN
    el = tl.exp(tl.where(ok, left, -float("inf")))  # all zero unless ok
    er = tl.exp(tl.where(ok, right, -float("inf")))
    kr = kJ * er  # [16, BKB]
    off = r[:, None] * 64 + 16 * J + a16[None, :]  # the [64,16] block of dP
    off_t = (16 * J + a16)[:, None] + r[None, :] * 64  # and its transpose, read from memory
    gq = el * _dot3(tl.load(dp + off), kr)
    gk = el * _dot3(tl.load(dp + 4096 + off), kr)
    dkJ = er * (_dot3(tl.load(dp + off_t), qh * el) + _dot3(tl.load(dp + 4096 + off_t), kh * el))
    dk_right, g_right = _right_rows(sel, kJ, dkJ, BKB)
    return gq, gk + dk_right, qh * gq + kh * gk + g_right, ok


@triton.jit
def _col_block_bwd_exact(dp, qh, kh, gc, r, J: tl.constexpr, BKB: tl.constexpr):
    """:func:`_col_block_bwd` for steep gates: one column j at a time with the exact
    e^{gc_i − gc_j} (every exponent ≤ 0 after masking when the gates are decays)."""
    a16 = tl.arange(0, 16)
    sel, kJ, gJ = _block_rows(kh, gc, J, BKB)
    gq = tl.zeros([64, BKB], dtype=tl.float32)
    gk = tl.zeros([64, BKB], dtype=tl.float32)
    g_left = tl.zeros([64, BKB], dtype=tl.float32)
    dkJ = tl.zeros([16, BKB], dtype=tl.float32)
    for jj in range(16):
        kj, dec = _exact_column(kJ, gJ, gc, r, J, jj)
        pq = tl.load(dp + r * 64 + 16 * J + jj)[:, None]  # column j of dP
        pk = tl.load(dp + 4096 + r * 64 + 16 * J + jj)[:, None]
        kd = kj[None, :] * dec
        gq += pq * kd
        gk += pk * kd
        t = (pq * qh + pk * kh) * dec  # dP_ij x_ik e^{gc_ik − gc_jk}
        g_left += t * kj[None, :]
        dkJ = tl.where((a16 == jj)[:, None], tl.sum(t, 0)[None, :], dkJ)
    dk_right, g_right = _right_rows(sel, kJ, dkJ, BKB)
    return gq, gk + dk_right, g_left + g_right


@triton.jit
def _load_norms(NRM, slot, r):
    """1/‖q‖ and 1/‖k‖ of the chunk's rows, as the chunk kernel stored them."""
    return tl.load(NRM + slot * 128 + r), tl.load(NRM + slot * 128 + 64 + r)


@triton.jit
def _slice_sums(SUMS, slot, kb, r, BK: tl.constexpr, BKB: tl.constexpr):
    """Where K-slice kb's three row sums go in SUMS ``[S, H, BK // BKB, 3, 64]``: dβ's share at +0,
    q̂·d q̂ at +64, k̂·d k̂ at +128."""
    return SUMS + (slot * (BK // BKB) + kb) * 192 + r


@triton.jit
def _chunk_bwd_wy_kernel(v, beta, do, chunk_map, cu, W, U, AI, HS, VN, DVN, DP, DBW, DB0, dv, scale,
                         H: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                         BKB: tl.constexpr, BVB: tl.constexpr):
    # one program per (chunk slot, head): the WY backward: dv, the cotangents of the decay products
    # (DP), of β k̂ e^{gc} (DBW) and dβ's share from u and A (DB0)
    i_h = tl.program_id(1)
    r, rows, n, tok, slot = _slot(chunk_map, cu, tl.program_id(0), i_h, H)
    b = tl.load(beta + tok * H + i_h, mask=rows, other=0.0).to(tl.float32)
    c64 = tl.arange(0, 64)
    t_inv = tl.trans(tl.load(AI + slot * 8192 + r[:, None] * 64 + c64[None, :]))  # Tᵀ
    u_base = slot * (64 * BV)
    k_base = slot * (64 * BK)
    h_base = slot * (BK * BV)

    # (a) over V: dv = β·Tᵀdu (du = dv_new), dβ, dA −= Tᵀdu·uᵀ, dAqk = do·v_newᵀ
    d_aqk = tl.zeros([64, 64], dtype=tl.float32)
    d_a = tl.zeros([64, 64], dtype=tl.float32)
    db = tl.zeros([64], dtype=tl.float32)
    for vb in range(BV // BVB):
        c = vb * BVB + tl.arange(0, BVB)
        m = rows[:, None] & (c < V)[None, :]
        t_off = tok[:, None] * (H * V) + i_h * V + c[None, :]
        p_u = u_base + r[:, None] * BV + c[None, :]
        dbu = _dot3(t_inv, tl.load(DVN + p_u))
        vx = tl.load(v + t_off, mask=m, other=0.0).to(tl.float32)
        tl.store(dv + t_off, (dbu * b[:, None]).to(dv.dtype.element_ty), mask=m)
        db += tl.sum(dbu * vx, 1)
        d_a -= _dot3(dbu, tl.trans(tl.load(U + p_u)))
        d_aqk += _dot3(tl.load(do + t_off, mask=m, other=0.0).to(tl.float32), tl.trans(tl.load(VN + p_u)))

    # (b) over K: dw = −dv_new·hᵀ, d(βk̂e^{gc}) = Tᵀdw (kept in DBW), dA −= Tᵀdw·wᵀ
    for kb in range(BK // BKB):
        c = kb * BKB + tl.arange(0, BKB)
        dw = tl.zeros([64, BKB], dtype=tl.float32)
        for vb in range(BV // BVB):
            cv = vb * BVB + tl.arange(0, BVB)
            hx = tl.load(HS + h_base + c[:, None] * BV + cv[None, :])
            dw -= _dot3(tl.load(DVN + u_base + r[:, None] * BV + cv[None, :]), tl.trans(hx))
        dbw = _dot3(t_inv, dw)
        p_k = k_base + r[:, None] * BK + c[None, :]
        tl.store(DBW + p_k, dbw)
        d_a -= _dot3(dbw, tl.trans(tl.load(W + p_k)))

    # (c) the decay products' cotangents, masked: scale·dAqk (j ≤ i) and β_i·dA (j < i); dβ from A
    akk = tl.load(AI + slot * 8192 + 4096 + r[:, None] * 64 + c64[None, :])
    d_a = tl.where(r[:, None] > c64[None, :], d_a, 0.0)
    dp = DP + slot * 8192
    tl.store(dp + r[:, None] * 64 + c64[None, :], tl.where(r[:, None] >= c64[None, :], d_aqk * scale, 0.0))
    tl.store(dp + 4096 + r[:, None] * 64 + c64[None, :], d_a * b[:, None])
    tl.store(DB0 + slot * 64 + r, db + tl.sum(d_a * akk, 1))


@triton.jit
def _chunk_bwd_kernel(q, k, g, beta, do, chunk_map, cu, HS, DHS, VN, NRM, DP, DBW, DQK, DGC, SUMS, FLAG,
                      scale, H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr,
                      BV: tl.constexpr, BKB: tl.constexpr, BVB: tl.constexpr, SPAN: tl.constexpr):
    # one program per (chunk slot, head, K-slice): from qg, kg, βk̂e^{gc}, e^{gc_last} and the decay
    # products (whole-chunk factors; a slice failing their span check is flagged for
    # _chunk_bwd_blocks_kernel): the slice's d q̂, d k̂ (DQK) and d gc (DGC) for the finish kernel, and
    # its row sums (SUMS: dβ's share, q̂·d q̂, k̂·d k̂)
    i_s, i_h, kb = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    r, rows, n, tok, slot = _slot(chunk_map, cu, i_s, i_h, H)
    rq, rk = _load_norms(NRM, slot, r)
    b = tl.load(beta + tok * H + i_h, mask=rows, other=0.0).to(tl.float32)
    u_base = slot * (64 * BV)
    k_base = slot * (64 * BK)
    h_base = slot * (BK * BV)
    c, qh, kh, gc, gl, ref = _k_slice(q, k, g, tok, rows, r, n, rq, rk, i_h, kb, H, K, BKB)
    eg = tl.exp(gc.to(tl.float32))
    el = tl.exp((gl[None, :] - gc).to(tl.float32))
    kg = kh * el
    dqg = tl.zeros([64, BKB], dtype=tl.float32)
    dkg = tl.zeros([64, BKB], dtype=tl.float32)
    ddec = tl.zeros([BKB], dtype=tl.float32)
    for vb in range(BV // BVB):
        cv = vb * BVB + tl.arange(0, BVB)
        m = rows[:, None] & (cv < V)[None, :]
        p_h = h_base + c[:, None] * BV + cv[None, :]
        hx = tl.load(HS + p_h)
        dhx = tl.load(DHS + p_h)
        d_o = tl.load(do + tok[:, None] * (H * V) + i_h * V + cv[None, :], mask=m, other=0.0).to(tl.float32)
        dqg += _dot3(d_o, tl.trans(hx))
        dkg += _dot3(tl.load(VN + u_base + r[:, None] * BV + cv[None, :]), tl.trans(dhx))
        ddec += tl.sum(hx * dhx, 1)
    p_k = k_base + r[:, None] * BK + c[None, :]
    dbw = tl.load(DBW + p_k)
    dqh = scale * eg * dqg
    dkh = el * dkg + b[:, None] * eg * dbw
    dgc = scale * qh * eg * dqg - kg * dkg + b[:, None] * kh * eg * dbw
    p_s = _slice_sums(SUMS, slot, kb, r, BK, BKB)
    tl.store(p_s, tl.sum(kh * eg * dbw, 1))
    gq, gk, gg, ok = _decay_products_bwd(DP + slot * 8192, qh, kh, gc, ref, r, SPAN)
    dqh += gq
    dkh += gk
    dgc += gg
    tl.store(FLAG + slot * (BK // BKB) + kb, tl.where(ok, 0, 1))
    # d gc_last reaches every row ≤ n-1 through the reverse cumsum: add it at row n-1
    dgl = ddec * tl.exp(gl.to(tl.float32)) + tl.sum(kg * dkg, 0)
    dgc = tl.where(rows[:, None], dgc, 0.0) + tl.where((r == n - 1)[:, None], dgl[None, :], 0.0)
    tl.store(DGC + p_k, dgc)
    tl.store(DQK + 2 * k_base + r[:, None] * BK + c[None, :], dqh)
    tl.store(DQK + 2 * k_base + 64 * BK + r[:, None] * BK + c[None, :], dkh)
    tl.store(p_s + 64, tl.sum(qh * dqh, 1))
    tl.store(p_s + 128, tl.sum(kh * dkh, 1))


@triton.jit
def _chunk_bwd_blocks_kernel(q, k, g, chunk_map, cu, NRM, DP, DQK, DGC, SUMS, FLAG,
                             H: tl.constexpr, K: tl.constexpr, BK: tl.constexpr, BKB: tl.constexpr,
                             SPAN: tl.constexpr):
    # one program per (chunk slot, head, K-slice); only the slices flagged by _chunk_bwd_kernel (their
    # whole-chunk factors failed the span check) do work: the decay products' backward by 16-column
    # blocks (each factored at its middle row, or exact), added into d q̂, d k̂ (and their row sums)
    # and d gc
    i_s, i_h, kb = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    if tl.load(FLAG + (i_s.to(tl.int64) * H + i_h) * (BK // BKB) + kb) != 0:
        r, rows, n, tok, slot = _slot(chunk_map, cu, i_s, i_h, H)
        rq, rk = _load_norms(NRM, slot, r)
        c, qh, kh, gc, gl, ref = _k_slice(q, k, g, tok, rows, r, n, rq, rk, i_h, kb, H, K, BKB)
        dp = DP + slot * 8192
        dqh = tl.zeros([64, BKB], dtype=tl.float32)
        dkh = tl.zeros([64, BKB], dtype=tl.float32)
        dgc = tl.zeros([64, BKB], dtype=tl.float32)
        for J in tl.static_range(4):
            gq, gk, gg, ok = _col_block_bwd(dp, qh, kh, gc, r, J, BKB, SPAN)
            if not ok:
                gq, gk, gg = _col_block_bwd_exact(dp, qh, kh, gc, r, J, BKB)
            dqh += gq
            dkh += gk
            dgc += gg
        p_q = 2 * slot * (64 * BK) + r[:, None] * BK + c[None, :]
        dqh += tl.load(DQK + p_q)
        dkh += tl.load(DQK + p_q + 64 * BK)
        tl.store(DQK + p_q, dqh)
        tl.store(DQK + p_q + 64 * BK, dkh)
        p_s = _slice_sums(SUMS, slot, kb, r, BK, BKB)
        tl.store(p_s + 64, tl.sum(qh * dqh, 1))
        tl.store(p_s + 128, tl.sum(kh * dkh, 1))
        p_k = slot * (64 * BK) + r[:, None] * BK + c[None, :]
        tl.store(DGC + p_k, tl.load(DGC + p_k) + tl.where(rows[:, None], dgc, 0.0))


@triton.jit
def _chunk_bwd_finish_kernel(q, k, chunk_map, cu, NRM, DQK, DGC, DB0, SUMS, dq, dk, dg, dbeta,
                             H: tl.constexpr, K: tl.constexpr, BK: tl.constexpr, BKB: tl.constexpr):
    # one program per (chunk slot, head), one pass over the K-slices: dβ from its shares, dg = reverse
    # cumsum of d gc, dq and dk through the L2 norms: dx = (d x̂ − x̂ (x̂·d x̂)) / ‖x‖, the row sums
    # x̂·d x̂ from the per-slice ones in SUMS
    i_h = tl.program_id(1)
    r, rows, n, tok, slot = _slot(chunk_map, cu, tl.program_id(0), i_h, H)
    rq, rk = _load_norms(NRM, slot, r)
    db = tl.load(DB0 + slot * 64 + r)
    sq = tl.zeros([64], dtype=tl.float32)
    sk = tl.zeros([64], dtype=tl.float32)
    for kb in range(BK // BKB):
        p_s = _slice_sums(SUMS, slot, kb, r, BK, BKB)
        db += tl.load(p_s)
        sq += tl.load(p_s + 64)
        sk += tl.load(p_s + 128)
    tl.store(dbeta + tok * H + i_h, db.to(dbeta.dtype.element_ty), mask=rows)
    for kb in range(BK // BKB):
        c = kb * BKB + tl.arange(0, BKB)
        m = rows[:, None] & (c < K)[None, :]
        t_off = tok[:, None] * (H * K) + i_h * K + c[None, :]
        p_q = 2 * slot * (64 * BK) + r[:, None] * BK + c[None, :]
        qh = tl.load(q + t_off, mask=m, other=0.0).to(tl.float32) * rq[:, None]
        kh = tl.load(k + t_off, mask=m, other=0.0).to(tl.float32) * rk[:, None]
        dqx = rq[:, None] * (tl.load(DQK + p_q) - qh * sq[:, None])
        dkx = rk[:, None] * (tl.load(DQK + p_q + 64 * BK) - kh * sk[:, None])
        tl.store(dq + t_off, dqx.to(dq.dtype.element_ty), mask=m)
        tl.store(dk + t_off, dkx.to(dk.dtype.element_ty), mask=m)
        dgc = tl.load(DGC + slot * (64 * BK) + r[:, None] * BK + c[None, :])
        tl.store(dg + t_off, tl.cumsum(dgc, 0, reverse=True).to(dg.dtype.element_ty), mask=m)


# ---------------------------------------------------------------------------------------------
# host wrapper
# ---------------------------------------------------------------------------------------------


def kda_fp32_bwd(q, k, v, g, beta, scale, initial_state, cu_seqlens, do, dht=None, *,
                 block_k: int = 32, block_v: int = 32, warps: tuple[int, int, int, int] = (4, 4, 4, 4),
                 chunk_maxnreg: int | None = 168, chunk_bwd_maxnreg: int | None = None,
                 chunk_bwd_wy_maxnreg: int | None = 168, given_a: tuple | None = None):
    """Gradients (dq, dk, dv, dg, dbeta, dh0) of ``kda_fp32_fwd(q, k, v, g, beta, scale,
    initial_state, cu_seqlens)`` for the cotangents ``do`` (o's shape, any float dtype) and
    ``dht`` (FP32 ``[N,H,K,V]`` or None: zero). Each gradient in its input's dtype, dh0 FP32 (zeros'
    gradient when there is no initial state). Inputs as for ``kda_fp32_fwd``; ``warps`` per kernel
    (chunk, state, state backward, the two chunk-gradient kernels), ``chunk_bwd_maxnreg`` the register
    cap of the per-slice chunk-gradient kernel, ``chunk_bwd_wy_maxnreg`` the WY backward's (168: on BF16 v,
    beta, do or dv ptxas would take it to 174-210 registers on sm_90, one program per SM fewer; H200, same
    size, BF16 inputs: 2901 against 3579 us), the other knobs as there. ``block_v`` 32 by default
    (H200, T = 16384, H = 64, K = V = 128: state pass 1.31 / backward state pass 2.91 ms against
    1.51 / 3.96 at 64).
    ``given_a``: the (Aqk, AI) that ``kda_fp32_fwd(..., keep_a=True)`` returned for these inputs;
    the chunk kernel then skips the decay products and the inverse."""
    _check(q, k, v, g, beta, initial_state, cu_seqlens)
    _check_blocks("kda_fp32_bwd", block_k, block_v, chunk_maxnreg=chunk_maxnreg,
                  chunk_bwd_maxnreg=chunk_bwd_maxnreg, chunk_bwd_wy_maxnreg=chunk_bwd_wy_maxnreg)
    if do.shape != v.shape:
        raise ValueError(f"kda_fp32_bwd: do must have o's shape {tuple(v.shape)}, got {tuple(do.shape)}")
    # the gradients in their inputs' dtypes: the kernels store them so, no conversion pass on BF16 inputs
    dq, dk, dv, dg, dbeta = (torch.empty(x.shape, device=x.device, dtype=x.dtype) for x in (q, k, v, g, beta))
    q, k, v, g, beta, do = contiguous_inputs(q, k, v, g, beta, do)
    cp = chunk_pass(q, k, v, g, beta, scale, cu_seqlens, block_k=block_k, block_v=block_v, warps=warps[0],
                    chunk_maxnreg=chunk_maxnreg, keep_a=True, given_a=given_a)
    N, H, K, V, BK, BV = cp.N, cp.H, cp.K, cp.V, cp.BK, cp.BV
    if dht is not None and (dht.dtype != torch.float32 or tuple(dht.shape) != (N, H, K, V)):
        raise ValueError(f"kda_fp32_bwd: dht must be float32 [N,H,K,V] = {(N, H, K, V)}, got "
                         f"{dht.dtype} {tuple(dht.shape)}")
    f32 = dict(device=q.device, dtype=torch.float32)
    S = cp.QG.shape[0]
    HS = torch.empty(S, H, BK, BV, **f32)
    VN = torch.empty_like(cp.U)
    final = torch.empty(N, H, K, V, **f32)
    state_pass(cp, None, initial_state, final, warps=warps[1], split_output=True, HS=HS, VN=VN)
    DHS, DVN = torch.empty_like(HS), torch.empty_like(VN)
    dh0 = torch.empty(N, H, K, V, **f32)
    if N > 0 and H > 0:
        _state_bwd_kernel[(BV // cp.BVT, H, N)](
            cp.QG, cp.KGT, cp.W, cp.AQK, cp.DEC, do, dht.contiguous() if dht is not None else dh0, dh0,
            cp.cu, cp.first_slot, DHS, DVN, H=H, K=K, V=V, BK=BK, BV=BV, BVT=cp.BVT, HAS_DHT=dht is not None,
            num_warps=warps[2], num_stages=STATE_BWD_STAGES)
    if cp.n_slots > 0 and H > 0:
        DP = torch.empty(S, H, 2, 64, 64, **f32)
        DBW, DGC = torch.empty_like(cp.W), torch.empty_like(cp.W)
        DQK = torch.empty(S, H, 2, 64, BK, **f32)
        NKB = BK // cp.BKB
        DB0, SUMS = torch.empty(S, H, 64, **f32), torch.empty(S, H, NKB, 3, 64, **f32)
        FLAG = torch.empty(S, H, NKB, device=q.device, dtype=torch.int32)
        geometry = dict(H=H, BK=BK, BKB=cp.BKB)
        _chunk_bwd_wy_kernel[(cp.n_slots, H)](
            v, beta, do, cp.chunk_map, cp.cu, cp.W, cp.U, cp.AI, HS, VN, DVN, DP, DBW, DB0, dv, float(scale),
            V=V, BV=BV, BVB=cp.BVB, **geometry, num_warps=warps[3], num_stages=CHUNK_BWD_WY_STAGES,
            maxnreg=chunk_bwd_wy_maxnreg)
        _chunk_bwd_kernel[(cp.n_slots, H, NKB)](
            q, k, g, beta, do, cp.chunk_map, cp.cu, HS, DHS, VN, cp.NRM, DP, DBW, DQK, DGC, SUMS, FLAG,
            float(scale), K=K, V=V, BV=BV, BVB=cp.BVB, SPAN=kda_fp32_triton.SPAN, **geometry,
            num_warps=warps[3], num_stages=CHUNK_BWD_STAGES, maxnreg=chunk_bwd_maxnreg)
        _chunk_bwd_blocks_kernel[(cp.n_slots, H, NKB)](
            q, k, g, cp.chunk_map, cp.cu, cp.NRM, DP, DQK, DGC, SUMS, FLAG, K=K, SPAN=kda_fp32_triton.SPAN, **geometry,
            num_warps=4)
        _chunk_bwd_finish_kernel[(cp.n_slots, H)](
            q, k, cp.chunk_map, cp.cu, cp.NRM, DQK, DGC, DB0, SUMS, dq, dk, dg, dbeta, K=K, **geometry, num_warps=4)
    return dq, dk, dv, dg, dbeta, dh0
