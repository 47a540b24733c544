"""The chunk kernel of the FP32 KDA forward and of the backward's recompute: :func:`chunk_kernel`.

One program per (chunk slot, head), fully parallel. Reads q, k, g, beta (q and k a second time after
their norms; FP32 or BF16, converted to FP32 on load) and writes, chunk-major FP32 ``[slot, H, ...]``:
``qg = scale·q̂·e^{gc}``, ``kgᵀ = (k̂·e^{gc_last−gc})ᵀ``, Aqk (scale·masked q̂–k̂ decay products, j ≤ i),
A⁻¹ with ``A = I + strict_lower(β_i k̂_i·k̂_j e^{gc_i−gc_j})`` (:func:`.solve.inverse_to`), w's
right-hand side ``β k̂ e^{gc}``, ``e^{gc_last}`` per chunk, and each row's 1/‖q‖ and 1/‖k‖ for the
backward. With ``STORE_A`` it also keeps the k̂–k̂ products (no β) beside A⁻¹.

Decay products: tensor-core dots (:func:`.primitives.dot3`) over each K-slice, the decay split into two
factors at a reference row r of the chunk cumulative gate, ``(x_i e^{gc_i − gc_r})·(k̂_j e^{gc_r − gc_j})``.
First the whole chunk at r = 32 (one [64,64] dot per product); a K-slice where some factor would
exceed e^{SPAN} goes by 16-column blocks J instead, r = 16J+8 (off the diagonal block both factors
are ≤ 1, inside it ≤ e^{8|g|}: any gate ≥ -5 per token passes); a block that fails that check too
takes an exact elementwise path (CUDA cores, every exponent ≤ 0).

Two launches: without ``BLOCKS`` a program computes its chunk while the whole-chunk exponents of
every slice stay within SPAN, checked slice by slice (it stops at the first slice that fails), and
flags the chunk otherwise; with ``BLOCKS``, the only launch compiled with the 16-column-block and
exact paths, a program computes only a flagged chunk. With ``LOAD_A`` (Aqk and A⁻¹ of an earlier
call on the same inputs) one launch recomputes only qg, kgᵀ, w's right-hand side and e^{gc_last}.

Row-causal (``CAUSAL``, one launch: what the batch-invariant decode needs): the reference row 32 and
the whole-chunk check make a row's bits depend on its chunk's later rows. Instead each 16-row block
is factored at its own first row, each column of the block itself checked alone and taken exactly
when it fails (:func:`_causal_products`): a row reads only itself and the earlier rows of its chunk.

Precision: the cumulative gate is scanned in FP64 and every exponent is a difference of two of its
rows rounded once to FP32, so a steep gate early in a chunk does not cost the later tokens ulp(|gc|)
of absolute exponent error.
"""

from __future__ import annotations

import triton
import triton.language as tl

from inductor_ext.kernels.kda_fp32.chunk_list import chunk_slot
from inductor_ext.kernels.kda_fp32.primitives import dot3
from inductor_ext.kernels.kda_fp32.solve import inverse_to

__all__ = ["SPAN", "chunk_kernel", "block_rows", "exact_column", "chunk_exponents", "k_slice"]

# Largest exponent a factor of the blocked Aqk / A dots may carry (e^42 ≈ 1.7e18): the products of
# masked-out pairs (up to e^84 · Σ|q̂||k̂| ≤ e^84) stay finite and the low TF32 half of the smaller
# factor of any product ≥ 1e-12 stays a normal FP32 number. A 16-column block (8 rows either side of
# its reference) passes for gates ≥ -5 per token; the whole chunk (32 rows) for gates ≥ -1.3. The
# forward and the backward read it at launch time, as ``chunk.SPAN``.
SPAN = 42.0


@triton.jit
def block_rows(kh, gc, J: tl.constexpr, BKB: tl.constexpr):
    """Rows 16J..16J+15 of k̂ and of the FP64 cumulative gate (a select over the four row blocks
    adds three zeros: exact), and the selector."""
    sel = (tl.arange(0, 4) == J)[:, None, None]
    kJ = tl.sum(tl.where(sel, tl.reshape(kh, [4, 16, BKB]), 0.0), 0)
    gJ = tl.sum(tl.where(sel, tl.reshape(gc, [4, 16, BKB]), 0.0), 0)
    return sel, kJ, gJ


@triton.jit
def exact_column(kJ, gJ, gc, r, J: tl.constexpr, jj):
    """Column j = 16J + jj of the exact path: k̂_j ([BKB]) and e^{gc_i − gc_j} for i ≥ j, else 0
    ([64, BKB]; every exponent ≤ 0 after masking when the gates are decays)."""
    pick = (tl.arange(0, 16) == jj)[:, None]
    kj = tl.sum(tl.where(pick, kJ, 0.0), 0)
    gj = tl.sum(tl.where(pick, gJ, 0.0), 0)
    keep = r[:, None] >= 16 * J + jj
    return kj, tl.where(keep, tl.exp(tl.where(keep, gc - gj[None, :], 0.0).to(tl.float32)), 0.0)


@triton.jit
def _col_block_exact(qh, kh, gc, kJ, gJ, r, J: tl.constexpr):
    """Column block J of the q̂–k̂ and k̂–k̂ decay products, one column at a time with the exact
    e^{gc_i - gc_j} (every exponent ≤ 0 after masking): the path for steep gates."""
    a16 = tl.arange(0, 16)
    dq = tl.zeros([64, 16], dtype=tl.float32)
    dk = tl.zeros([64, 16], dtype=tl.float32)
    for jj in range(16):
        kj, dec = exact_column(kJ, gJ, gc, r, J, jj)
        kd = kj[None, :] * dec
        col = (a16 == jj)[None, :]
        dq = tl.where(col, tl.sum(qh * kd, 1)[:, None], dq)
        dk = tl.where(col, tl.sum(kh * kd, 1)[:, None], dk)
    return dq, dk


@triton.jit
def _col_block(qh, kh, gc, r, acc_q, acc_k, J: tl.constexpr, BKB: tl.constexpr, SPAN: tl.constexpr):
    """Add one K-slice's contribution to column block J (columns 16J..16J+15) of the unmasked
    q̂–k̂ (acc_q) and k̂–k̂ (acc_k) decay products. qh, kh: [64, BKB] FP32; gc: [64, BKB] FP64."""
    _, kJ, gJ = block_rows(kh, gc, J, BKB)
    ref = tl.sum(tl.where((tl.arange(0, 16) == 8)[:, None], gJ, 0.0), 0)  # gc at row 16J+8
    below = r[:, None] >= 16 * J
    left = tl.where(below, gc - ref[None, :], 0.0).to(tl.float32)
    right = (ref[None, :] - gJ).to(tl.float32)
    span = tl.maximum(tl.max(left), tl.max(right))
    if span <= SPAN:
        el = tl.exp(left)
        rt = tl.trans(kJ * tl.exp(right))  # [BKB, 16]
        acc_q += dot3(tl.where(below, qh * el, 0.0), rt)
        acc_k += dot3(tl.where(below, kh * el, 0.0), rt)
    else:
        dq, dk = _col_block_exact(qh, kh, gc, kJ, gJ, r, J)
        acc_q += dq
        acc_k += dk
    return acc_q, acc_k


@triton.jit
def _join4(x0, x1, x2, x3):
    """Four [64, 16] column blocks side by side: [64, 64]."""
    x = tl.join(tl.join(x0, x1), tl.join(x2, x3))  # [64, 16, 2, 2]: x[i, c, a, b] = x_{2b+a}[i, c]
    return tl.reshape(tl.permute(x, (0, 3, 2, 1)), [64, 64])


@triton.jit
def chunk_exponents(gc, ref):
    """gc_i − gc_32 for every row (ref: row 32 of gc, from :func:`k_slice`), a difference of two FP64
    rows rounded once to FP32: the exponents of the whole-chunk factors e^{gc_i − gc_32} (rows i) and
    e^{gc_32 − gc_j} (rows j, the negation)."""
    return (gc - ref[None, :]).to(tl.float32)


@triton.jit
def _whole_chunk_products(qh, kh, x, acc_q, acc_k):
    """Add one K-slice's decay products factored at row 32 (x: :func:`chunk_exponents`)."""
    rt = tl.trans(kh * tl.exp(-x))  # [BKB, 64]
    el = tl.exp(x)
    return acc_q + dot3(qh * el, rt), acc_k + dot3(kh * el, rt)


@triton.jit
def _decay_products(qh, kh, gc, x, r, acc_q, acc_k, BKB: tl.constexpr, SPAN: tl.constexpr, BLOCKS: tl.constexpr):
    """Add one K-slice's unmasked q̂–k̂ (acc_q) and k̂–k̂ (acc_k) decay products, [64, 64] each.
    Whole chunk at once, factored at row 32 (x: :func:`chunk_exponents`). With BLOCKS (the launch for the
    chunks the first launch flagged) only when no exponent of the slice exceeds SPAN, otherwise by
    the four 16-column blocks of :func:`_col_block` (each factored at its own middle row, or exact)."""
    if not BLOCKS:
        acc_q, acc_k = _whole_chunk_products(qh, kh, x, acc_q, acc_k)
    elif tl.max(tl.abs(x)) <= SPAN:
        acc_q, acc_k = _whole_chunk_products(qh, kh, x, acc_q, acc_k)
    else:
        z = tl.zeros([64, 16], dtype=tl.float32)
        q0, k0 = _col_block(qh, kh, gc, r, z, z, 0, BKB, SPAN)
        q1, k1 = _col_block(qh, kh, gc, r, z, z, 1, BKB, SPAN)
        q2, k2 = _col_block(qh, kh, gc, r, z, z, 2, BKB, SPAN)
        q3, k3 = _col_block(qh, kh, gc, r, z, z, 3, BKB, SPAN)
        acc_q += _join4(q0, q1, q2, q3)
        acc_k += _join4(k0, k1, k2, k3)
    return acc_q, acc_k


@triton.jit
def _causal_products(qh, kh, gc, r, acc_q, acc_k, BKB: tl.constexpr, SPAN: tl.constexpr):
    """Add one K-slice's unmasked q̂–k̂ (acc_q) and k̂–k̂ (acc_k) decay products, row-causally: the
    rows of row block I (16I..16I+15) are factored at the block's first row r = 16I,
    ``(x_i e^{gc_i − gc_r})·(k̂_j e^{gc_r − gc_j})``, one [64, 64] dot per product and block, kept
    for the block's rows. For decays (g ≤ 0) the left factor and the right factors of the earlier
    blocks' columns are ≤ 1; a column j of the block itself passes while its right exponents stay
    within SPAN, else its products come from the exact elementwise path. Every choice and every
    product of row i reads rows ≤ i only, so a partial chunk's rows are the full chunk's, bitwise."""
    blk = r // 16
    g4 = tl.reshape(gc, [4, 16, BKB])
    first = tl.sum(tl.where((tl.arange(0, 16) == 0)[None, :, None], g4, 0.0), 1)  # [4, BKB]: rows 0, 16, 32, 48
    own_ref = tl.reshape(tl.broadcast_to(first[:, None, :], [4, 16, BKB]), [64, BKB])
    el = tl.exp((gc - own_ref).to(tl.float32))
    qf = qh * el
    kf = kh * el
    for I in tl.static_range(4):
        ref = tl.sum(tl.where((tl.arange(0, 4) == I)[:, None], first, 0.0), 0)  # gc at row 16I
        read = r < 16 * I + 16  # the columns (rows j of k̂) that row block I reads
        right = tl.where(read[:, None], (ref[None, :] - gc).to(tl.float32), 0.0)
        steep = (r >= 16 * I) & (tl.max(right, 1) > SPAN)  # the block's own columns beyond e^SPAN
        rt = tl.trans(tl.where((read & ~steep)[:, None], kh * tl.exp(right), 0.0))  # [BKB, 64]
        mine = (blk == I)[:, None]
        acc_q = tl.where(mine, acc_q + dot3(qf, rt), acc_q)
        acc_k = tl.where(mine, acc_k + dot3(kf, rt), acc_k)
        if tl.sum(steep.to(tl.int32)) > 0:
            _, kJ, gJ = block_rows(kh, gc, I, BKB)
            eq, ek = _col_block_exact(qh, kh, gc, kJ, gJ, r, I)  # [64, 16]: column block I
            z = tl.zeros([64, 16], dtype=tl.float32)
            eq = _join4(eq if I == 0 else z, eq if I == 1 else z, eq if I == 2 else z, eq if I == 3 else z)
            ek = _join4(ek if I == 0 else z, ek if I == 1 else z, ek if I == 2 else z, ek if I == 3 else z)
            fix = mine & steep[None, :]  # (their dot products above are exact zeros)
            acc_q = tl.where(fix, acc_q + eq, acc_q)
            acc_k = tl.where(fix, acc_k + ek, acc_k)
    return acc_q, acc_k


@triton.jit
def _inv_norms(q, k, tok, rows, i_h, H: tl.constexpr, K: tl.constexpr, BK: tl.constexpr, EPS: tl.constexpr):
    """1 / L2 norm of the q and k rows, FP32 over the full rows."""
    ck = tl.arange(0, BK)
    m_full = rows[:, None] & (ck < K)[None, :]
    off_full = tok[:, None] * (H * K) + i_h * K + ck[None, :]
    qx = tl.load(q + off_full, mask=m_full, other=0.0).to(tl.float32)
    kx = tl.load(k + off_full, mask=m_full, other=0.0).to(tl.float32)
    return 1.0 / tl.sqrt(tl.sum(qx * qx, 1) + EPS), 1.0 / tl.sqrt(tl.sum(kx * kx, 1) + EPS)


@triton.jit
def k_slice(q, k, g, tok, rows, r, n, rq, rk, i_h, kb, H: tl.constexpr, K: tl.constexpr, BKB: tl.constexpr):
    """K-slice kb: its columns, q̂ and k̂ [64, BKB] FP32, the FP64 chunk cumulative gate gc and its
    rows n-1 and 32."""
    c = kb * BKB + tl.arange(0, BKB)
    m = rows[:, None] & (c < K)[None, :]
    off = tok[:, None] * (H * K) + i_h * K + c[None, :]
    qh = tl.load(q + off, mask=m, other=0.0).to(tl.float32) * rq[:, None]
    kh = tl.load(k + off, mask=m, other=0.0).to(tl.float32) * rk[:, None]
    # the chunk cumulative gate in FP64: every exponent below is a difference of two of its rows,
    # which FP32 prefixes would carry with an absolute error ~ulp(|gc|) (6e-5 at |gc| = 960)
    gc = tl.cumsum(tl.load(g + off, mask=m, other=0.0).to(tl.float64), 0)
    # rows n-1 (the chunk's last) and 32 (the whole-chunk factors' reference) of gc, as exact selects
    # in one reduction: FP64 reductions over the rows cross warps, and each costs a shared-memory
    # round trip (measured: docs/kda.md)
    pick = tl.where(tl.arange(0, 2) == 0, n - 1, 32)
    gl, ref = tl.split(tl.sum(tl.where((r[:, None] == pick[None, :])[:, None, :], gc[:, :, None], 0.0), 0))
    return c, qh, kh, gc, gl, ref


@triton.jit
def _store_k_slice(QG, W, KGT, DEC, slot, r, c, qh, kh, gc, gl, b, scale, BK: tl.constexpr):
    """qg, the right-hand side β k̂ e^{gc} of w (solved later), kgᵀ and e^{gc_last} of one K-slice."""
    eg = tl.exp(gc.to(tl.float32))
    t_off = slot * (64 * BK) + r[:, None] * BK + c[None, :]
    tl.store(QG + t_off, qh * eg * scale)
    tl.store(W + t_off, kh * eg * b[:, None])
    kg = kh * tl.exp((gl[None, :] - gc).to(tl.float32))
    tl.store(KGT + slot * (BK * 64) + c[None, :] * 64 + r[:, None], kg)
    tl.store(DEC + slot * BK + c, tl.exp(gl.to(tl.float32)))


@triton.jit
def chunk_kernel(q, k, g, beta, chunk_map, cu, QG, KGT, W, AQK, DEC, AI, NRM, FLAG, scale,
                 H: tl.constexpr, K: tl.constexpr, BK: tl.constexpr, BKB: tl.constexpr, EPS: tl.constexpr,
                 SPAN: tl.constexpr, STORE_A: tl.constexpr, LOAD_A: tl.constexpr, BLOCKS: tl.constexpr,
                 CAUSAL: tl.constexpr):
    """The chunk kernel (module docstring), one program per (chunk slot, head). AI: per slot A⁻¹,
    then with STORE_A the k̂–k̂ products (no β, j < i; the backward reads them); W gets the
    right-hand side β k̂ e^{gc} of w (the forward's state pass reads it; :func:`.solve.solve_kernel`
    turns it into w for the split pass and the backward). LOAD_A: Aqk and AI hold a previous call's
    results: skip the decay products and the inverse, recompute only qg, kgᵀ, w's right-hand side
    and e^{gc_last}. Otherwise two launches: without BLOCKS a program computes its chunk while
    every slice's whole-chunk exponents stay within SPAN, stops at the first slice where they do not
    and then flags the chunk in FLAG (int32 per (slot, head)); with BLOCKS a program computes only a
    flagged chunk. CAUSAL: one launch, every chunk's decay products by :func:`_causal_products`
    (no flags)."""
    i_h = tl.program_id(1)
    r, rows, n, tok, slot = chunk_slot(chunk_map, cu, tl.program_id(0), i_h, H)
    if BLOCKS:
        if tl.load(FLAG + slot) == 0:
            return
    rq, rk = _inv_norms(q, k, tok, rows, i_h, H, K, BK, EPS)
    tl.store(NRM + slot * 128 + r, rq)  # for the backward's kernels
    tl.store(NRM + slot * 128 + 64 + r, rk)
    b = tl.load(beta + tok * H + i_h, mask=rows, other=0.0).to(tl.float32)

    # pass 1 over K-slices: gate cumsum, qg / kgᵀ / βk̂e^{gc} / e^{gc_last}, the decay products
    acc_q = tl.zeros([64, 64], dtype=tl.float32)
    acc_k = tl.zeros([64, 64], dtype=tl.float32)
    xmax = tl.full([], 0.0, tl.float32)  # the first launch's largest |whole-chunk exponent| so far
    for kb in range(BK // BKB):
        c, qh, kh, gc, gl, ref = k_slice(q, k, g, tok, rows, r, n, rq, rk, i_h, kb, H, K, BKB)
        x = chunk_exponents(gc, ref)
        go = True
        if not LOAD_A and not BLOCKS and not CAUSAL:
            xmax = tl.maximum(xmax, tl.max(tl.abs(x)))
            go = xmax <= SPAN
        if go:  # (the first launch's results of a flagged chunk are all overwritten by the second)
            _store_k_slice(QG, W, KGT, DEC, slot, r, c, qh, kh, gc, gl, b, scale, BK)
            if CAUSAL and not LOAD_A:
                acc_q, acc_k = _causal_products(qh, kh, gc, r, acc_q, acc_k, BKB, SPAN)
            elif not LOAD_A:
                acc_q, acc_k = _decay_products(qh, kh, gc, x, r, acc_q, acc_k, BKB, SPAN, BLOCKS)

    if not LOAD_A:
        if not BLOCKS and not CAUSAL:
            flag = tl.where(xmax <= SPAN, 0, 1)
            tl.store(FLAG + slot, flag)
            if flag != 0:
                return
        # masked: scale·Aqk (j ≤ i), and A − I = β_i·(k̂–k̂ products) (j < i), whose products the
        # backward reads for dβ (STORE_A)
        c64 = tl.arange(0, 64)
        p_ai = AI + slot * (8192 if STORE_A else 4096) + r[:, None] * 64 + c64[None, :]
        tl.store(AQK + slot * 4096 + r[:, None] * 64 + c64[None, :],
                 tl.where(r[:, None] >= c64[None, :], acc_q * scale, 0.0))
        akk = tl.where(r[:, None] > c64[None, :], acc_k, 0.0)
        if STORE_A:
            tl.store(p_ai + 4096, akk)
        inverse_to(akk * b[:, None], r, AI + slot * (8192 if STORE_A else 4096))
