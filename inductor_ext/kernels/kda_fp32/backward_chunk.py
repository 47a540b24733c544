"""Within-chunk gradients of the FP32 KDA backward: the WY backward and the chunk-gradient kernels.

- :func:`chunk_bwd_wy_kernel`, one program per (chunk, head): dv, the decay products' cotangents,
  d(β k̂ e^{gc}) and dβ's share from u and A;
- :func:`chunk_bwd_kernel`, one program per (chunk, head, K-slice): d q̂, d k̂, d gc into scratch with
  the decay products' whole-chunk path, flagging a slice whose span check fails; the slice's row
  sums (dβ's share, q̂·d q̂, k̂·d k̂);
- :func:`chunk_bwd_blocks_kernel`, the same grid, idle but for flagged slices: their decay products'
  backward by 16-column blocks (or exact), added into d q̂, d k̂, d gc and the row sums;
- :func:`chunk_bwd_finish_kernel`, one program per (chunk, head), one pass: dg (reverse cumsum), dq
  and dk (through the L2 norms), dβ.

The decay products ``P_ij = Σ_k x_ik k̂_jk e^{gc_ik − gc_jk}`` are differentiated with the forward's
factors (:mod:`.chunk`: whole chunk at row 32 where the span check passes, else 16-column blocks, else
exact). Every product is :func:`.primitives.dot3`.
"""

from __future__ import annotations

import triton
import triton.language as tl

from inductor_ext.kernels.kda_fp32.chunk import block_rows, chunk_exponents, exact_column, k_slice
from inductor_ext.kernels.kda_fp32.chunk_list import chunk_slot
from inductor_ext.kernels.kda_fp32.primitives import dot3

__all__ = ["chunk_bwd_wy_kernel", "chunk_bwd_kernel", "chunk_bwd_blocks_kernel", "chunk_bwd_finish_kernel"]


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
    and ``chunk_bwd_blocks_kernel`` takes it by 16-column blocks (no branch here: a branch would cost
    every slice)."""
    x = chunk_exponents(gc, ref)
    ok = tl.max(tl.abs(x)) <= SPAN
    el = tl.exp(tl.where(ok, x, -float("inf")))  # both zero unless ok
    er = tl.exp(tl.where(ok, -x, -float("inf")))
    kr = kh * er
    c64 = tl.arange(0, 64)
    off = r[:, None] * 64 + c64[None, :]
    off_t = c64[:, None] + r[None, :] * 64  # the transpose, read from memory
    gq = el * dot3(tl.load(dp + off), kr)
    gk = el * dot3(tl.load(dp + 4096 + off), kr)
    dk_right = er * (dot3(tl.load(dp + off_t), qh * el) + dot3(tl.load(dp + 4096 + off_t), kh * el))
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
    sel, kJ, gJ = block_rows(kh, gc, J, BKB)
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
    gq = el * dot3(tl.load(dp + off), kr)
    gk = el * dot3(tl.load(dp + 4096 + off), kr)
    dkJ = er * (dot3(tl.load(dp + off_t), qh * el) + dot3(tl.load(dp + 4096 + off_t), kh * el))
    dk_right, g_right = _right_rows(sel, kJ, dkJ, BKB)
    return gq, gk + dk_right, qh * gq + kh * gk + g_right, ok


@triton.jit
def _col_block_bwd_exact(dp, qh, kh, gc, r, J: tl.constexpr, BKB: tl.constexpr):
    """:func:`_col_block_bwd` for steep gates: one column j at a time with the exact
    e^{gc_i − gc_j} (every exponent ≤ 0 after masking when the gates are decays)."""
    a16 = tl.arange(0, 16)
    sel, kJ, gJ = block_rows(kh, gc, J, BKB)
    gq = tl.zeros([64, BKB], dtype=tl.float32)
    gk = tl.zeros([64, BKB], dtype=tl.float32)
    g_left = tl.zeros([64, BKB], dtype=tl.float32)
    dkJ = tl.zeros([16, BKB], dtype=tl.float32)
    for jj in range(16):
        kj, dec = exact_column(kJ, gJ, gc, r, J, jj)
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
def chunk_bwd_wy_kernel(v, beta, do, chunk_map, cu, W, U, AI, HS, VN, DVN, DP, DBW, DB0, dv, scale,
                        H: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                        BKB: tl.constexpr, BVB: tl.constexpr):
    """One program per (chunk slot, head): the WY backward: dv, the cotangents of the decay products
    (DP), of β k̂ e^{gc} (DBW) and dβ's share from u and A (DB0)."""
    i_h = tl.program_id(1)
    r, rows, n, tok, slot = chunk_slot(chunk_map, cu, tl.program_id(0), i_h, H)
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
        dbu = dot3(t_inv, tl.load(DVN + p_u))
        vx = tl.load(v + t_off, mask=m, other=0.0).to(tl.float32)
        tl.store(dv + t_off, (dbu * b[:, None]).to(dv.dtype.element_ty), mask=m)
        db += tl.sum(dbu * vx, 1)
        d_a -= dot3(dbu, tl.trans(tl.load(U + p_u)))
        d_aqk += dot3(tl.load(do + t_off, mask=m, other=0.0).to(tl.float32), tl.trans(tl.load(VN + p_u)))

    # (b) over K: dw = −dv_new·hᵀ, d(βk̂e^{gc}) = Tᵀdw (kept in DBW), dA −= Tᵀdw·wᵀ
    for kb in range(BK // BKB):
        c = kb * BKB + tl.arange(0, BKB)
        dw = tl.zeros([64, BKB], dtype=tl.float32)
        for vb in range(BV // BVB):
            cv = vb * BVB + tl.arange(0, BVB)
            hx = tl.load(HS + h_base + c[:, None] * BV + cv[None, :])
            dw -= dot3(tl.load(DVN + u_base + r[:, None] * BV + cv[None, :]), tl.trans(hx))
        dbw = dot3(t_inv, dw)
        p_k = k_base + r[:, None] * BK + c[None, :]
        tl.store(DBW + p_k, dbw)
        d_a -= dot3(dbw, tl.trans(tl.load(W + p_k)))

    # (c) the decay products' cotangents, masked: scale·dAqk (j ≤ i) and β_i·dA (j < i); dβ from A
    akk = tl.load(AI + slot * 8192 + 4096 + r[:, None] * 64 + c64[None, :])
    d_a = tl.where(r[:, None] > c64[None, :], d_a, 0.0)
    dp = DP + slot * 8192
    tl.store(dp + r[:, None] * 64 + c64[None, :], tl.where(r[:, None] >= c64[None, :], d_aqk * scale, 0.0))
    tl.store(dp + 4096 + r[:, None] * 64 + c64[None, :], d_a * b[:, None])
    tl.store(DB0 + slot * 64 + r, db + tl.sum(d_a * akk, 1))


@triton.jit
def chunk_bwd_kernel(q, k, g, beta, do, chunk_map, cu, HS, DHS, VN, NRM, DP, DBW, DQK, DGC, SUMS, FLAG,
                     scale, H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr,
                     BV: tl.constexpr, BKB: tl.constexpr, BVB: tl.constexpr, SPAN: tl.constexpr):
    """One program per (chunk slot, head, K-slice): from qg, kg, βk̂e^{gc}, e^{gc_last} and the decay
    products (whole-chunk factors; a slice failing their span check is flagged for
    chunk_bwd_blocks_kernel): the slice's d q̂, d k̂ (DQK) and d gc (DGC) for the finish kernel, and
    its row sums (SUMS: dβ's share, q̂·d q̂, k̂·d k̂)."""
    i_s, i_h, kb = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    r, rows, n, tok, slot = chunk_slot(chunk_map, cu, i_s, i_h, H)
    rq, rk = _load_norms(NRM, slot, r)
    b = tl.load(beta + tok * H + i_h, mask=rows, other=0.0).to(tl.float32)
    u_base = slot * (64 * BV)
    k_base = slot * (64 * BK)
    h_base = slot * (BK * BV)
    c, qh, kh, gc, gl, ref = k_slice(q, k, g, tok, rows, r, n, rq, rk, i_h, kb, H, K, BKB)
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
        dqg += dot3(d_o, tl.trans(hx))
        dkg += dot3(tl.load(VN + u_base + r[:, None] * BV + cv[None, :]), tl.trans(dhx))
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
def chunk_bwd_blocks_kernel(q, k, g, chunk_map, cu, NRM, DP, DQK, DGC, SUMS, FLAG,
                            H: tl.constexpr, K: tl.constexpr, BK: tl.constexpr, BKB: tl.constexpr,
                            SPAN: tl.constexpr):
    """One program per (chunk slot, head, K-slice); only the slices flagged by chunk_bwd_kernel (their
    whole-chunk factors failed the span check) do work: the decay products' backward by 16-column
    blocks (each factored at its middle row, or exact), added into d q̂, d k̂ (and their row sums)
    and d gc."""
    i_s, i_h, kb = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    if tl.load(FLAG + (i_s.to(tl.int64) * H + i_h) * (BK // BKB) + kb) != 0:
        r, rows, n, tok, slot = chunk_slot(chunk_map, cu, i_s, i_h, H)
        rq, rk = _load_norms(NRM, slot, r)
        c, qh, kh, gc, gl, ref = k_slice(q, k, g, tok, rows, r, n, rq, rk, i_h, kb, H, K, BKB)
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
def chunk_bwd_finish_kernel(q, k, chunk_map, cu, NRM, DQK, DGC, DB0, SUMS, dq, dk, dg, dbeta,
                            H: tl.constexpr, K: tl.constexpr, BK: tl.constexpr, BKB: tl.constexpr):
    """One program per (chunk slot, head), one pass over the K-slices: dβ from its shares, dg = reverse
    cumsum of d gc, dq and dk through the L2 norms: dx = (d x̂ − x̂ (x̂·d x̂)) / ‖x‖, the row sums
    x̂·d x̂ from the per-slice ones in SUMS."""
    i_h = tl.program_id(1)
    r, rows, n, tok, slot = chunk_slot(chunk_map, cu, tl.program_id(0), i_h, H)
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
