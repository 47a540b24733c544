"""FP32-accurate KDA chunk forward in Triton: ``kda_fp32_fwd``, the forward of ``glm53::kda_chunk(...,
precision="fp32")`` on CUDA (through ``inductor_ext.kernels.kda_fp32``; backward: ``kda_fp32_bwd_triton``).

Same semantics as the forward of ``glm53::kda_chunk(..., precision="fp32")`` (``shared/DESIGN.md`` §4,
``inductor_ext/ops/kda.py``): q and k are L2-normalised in FP32 (``x / sqrt(Σx² + 1e-6)``), g is the
per-key natural-log decay (≤ 0) accumulated inside 64-token chunks that restart at every document
start, beta per (token, head), o in v's dtype, final state FP32 ``[N,H,K,V]``. K, V ≤ 128.

Two kernels, or three with ``split_output`` and in the backward, no host synchronisation (the chunk
list has the static length ``ceil(T/64) + N - 1`` when packed, ``B·ceil(T/64)`` otherwise, and is
filled on the device):

1. ``_chunk_kernel``, one program per (chunk slot, head), fully parallel. Reads q, k, g, beta (q
   and k a second time after their norms) and writes, chunk-major FP32:
   ``qg = scale·q̂·e^{gc}``, ``kgᵀ = (k̂·e^{gc_last-gc})ᵀ``, ``Aqk`` (scale·masked q̂–k̂ decay products),
   ``A⁻¹`` with ``A = I + strict_lower(β_i k̂_i·k̂_j e^{gc_i-gc_j})``, w's right-hand side ``β k̂ e^{gc}``
   and ``e^{gc_last}`` per chunk.
   Aqk and A come from tensor-core dots over each K-slice, the decay split into two factors at a
   reference row r of the chunk cumulative gate: ``(x_i e^{gc_i - gc_r})·(k̂_j e^{gc_r - gc_j})``.
   First the whole chunk at r = 32 (one [64,64] dot per product); a K-slice where some factor would
   exceed e^{SPAN} goes by 16-column blocks J instead, r = 16J+8 (off the diagonal block both
   factors are ≤ 1, inside it ≤ e^{8|g|}: any gate ≥ -5 per token passes); a block that fails that
   check too takes an exact elementwise path (CUDA cores, every exponent ≤ 0). H200, T = 16384,
   H = 64, K = V = 128: chunk kernel 6.5 -> 4.9 ms with the whole-chunk path on the benchmark's
   gates (``notes/kda-fp32-kernels.md``, session 12). The kernel is launched twice: the first launch
   computes the chunks whose whole-chunk exponents all stay within SPAN, checked slice by slice (a
   chunk stops its work at the first slice that fails), and flags the rest, which the second launch,
   the only one compiled with the 16-column-block and exact paths, computes. Without that code the
   first launch compiles to 8.3 instead of 11.7 k sm_90 instructions with fewer spills; H200, same
   size, FP32 inputs, both launches: 4611 -> 4028 us on the benchmark's gates, 5271 -> 5304 on
   KDA-style gates (session 14, then with a Σ|g| bound before any work; checking the exponents
   themselves in the loop, with rows n-1 and 32 of gc taken in one reduction: BF16 inputs, 3129 ->
   2803 us and 5987 -> 5950 us, session 17). The cumulative gate is scanned in FP64
   and every exponent is a difference of two of its rows rounded once to FP32, so a steep gate early
   in a chunk does not cost the later tokens ulp(|gc|) of absolute exponent error.
   The chunk kernel also stores each row's 1/‖q‖ and 1/‖k‖ for the backward.
   A⁻¹: the four 16×16 diagonal blocks are inverted together by a 15-step row sweep ([4,16,16]
   tiles, FP32 elementwise), then block forward elimination builds the four 16-row blocks of A⁻¹
   with small dots. L = A − I is stored first into A⁻¹'s own slot, and the sweep's rows and the
   elimination's column blocks are loaded back from there (L1/L2) instead of selected out of
   registers by reductions (session 17: 104 us of the chunk kernel's 3.1 ms).
2. ``_solve_kernel`` (``split_output`` and the backward only), one program per (64 columns, chunk
   slot, head): ``w = A⁻¹(β k̂ e^{gc})`` in place of its right-hand side and ``u = A⁻¹(β v)``, by
   :func:`_dot3t` (H200, T = 16384, H = 64, K = V = 128, BF16 inputs: 0.80 ms, session 15).
3. ``_state_kernel``, one program per (V-block, head, document), sequential over the document's
   chunks with the state ``[K, BV]`` in registers (as 64-row tiles, so no dot operand exceeds
   [64, 64]): ``v_new = A⁻¹(βv − R·h)`` with R = β k̂ e^{gc} (w's right-hand side; with
   ``split_output``, ``v_new = u − w·h`` from the solve kernel's w and u), ``o = qg·h + Aqk·v_new``
   (stored in v's dtype), ``h ← e^{gc_last}·h + kgᵀ·v_new``. The per-chunk states never reach global
   memory. Solving in the state pass costs it one more ``_dot3`` per chunk and spares the forward the
   solve kernel's memory traffic: H200, same size, forward 5316 -> 4815 us (session 18). On Hopper,
   for the H200 geometry (K in 65..128, 64 V columns per program, o wanted), ``kda_fp32_gluon``'s Gluon
   kernel instead: the same products, bitwise, with asynchronous MMAs (session 16: 2354 -> 1767 us alone,
   before the solve moved in).

Dot precisions: every dot is ``_dot3`` (the solve's as :func:`_dot3t`, the same products; hi/lo split,
three TF32 MMAs, FP32-grade products at tensor-core speed): Triton's ``tf32x3`` arithmetic with a
cheaper split and no NaN mask, bitwise the same results on the H200, ``_chunk_kernel`` 6.97 -> 6.2 ms
and ``_state_kernel`` 2.76 -> 2.70 ms at T=16384, H=64, K=V=128; the 16×16 diagonal sweep is elementwise
FP32. tf32x3 instead of IEEE elimination dots took ``_chunk_kernel`` from 9.3 to 8.5 ms at unchanged
test accuracy; two other forms of the solve measured slower and were reverted
(``notes/kda-fp32-kernels.md``, sessions 5, 10).
"""

from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl

from inductor_ext.kernels import kda_fp32_gluon
from inductor_ext.ops.kda import CHUNK, FP32_KERNEL_MAX_DIM, L2_EPS, chunk_count, chunk_slots

__all__ = ["kda_fp32_fwd", "MAX_DIM", "SPAN"]

MAX_DIM = FP32_KERNEL_MAX_DIM  # head dims K, V
# the split state pass (the backward's) keeps the loads of 2 chunks in flight (cp.async into shared memory:
# 196 KB at K = 128, block_v 64). H200, T = 16384, H = 64, K = V = 128: 2359-2399 us against 2698-2707
# for the unpipelined loop at block_v 32 (block_v 32 with 2 stages: 3178-3196 us, 155 KB, one program
# per SM; 3 stages need 278 KB, more than an SM has)
STATE_STAGES = 2
# the forward's fused state pass (v_new solved in the loop: A⁻¹ and v loaded as well) is not pipelined: at 2
# stages it needs 246 KB of shared memory at K = 128, block_v 64 (sm_90 static compile), more than an SM has;
# 98 KB at 1. On Hopper that geometry runs the Gluon kernel instead
FUSED_STATE_STAGES = 1
# the chunk kernel's loops are not software-pipelined: H200, same size, 4.61 ms at 1 stage against 4.96 at
# Triton's default 3 (5.05 at 2) keeping A, and 2.10 against 2.24 ms reading it (the backward's call)
CHUNK_STAGES = 1
# columns of w and u per _solve_kernel program. H200, T = 16384, H = 64, K = V = 128, FP32, with _dot3
# (before _dot3t): 1151 us at 64, 1079 at 32, 1596 at 128; 2 or 4 blocks of 64 per program 1092 / 1148
# (4 software-pipelined at 2 stages: 1054)
SOLVE_COLUMNS = 64
# Largest exponent a factor of the blocked Aqk / A dots may carry (e^42 ≈ 1.7e18): the products of
# masked-out pairs (up to e^84 · Σ|q̂||k̂| ≤ e^84) stay finite and the low TF32 half of the smaller
# factor of any product ≥ 1e-12 stays a normal FP32 number. A 16-column block (8 rows either side of
# its reference) passes for gates ≥ -5 per token; the whole chunk (32 rows) for gates ≥ -1.3.
SPAN = 42.0
_TF32_HI = tl.constexpr(-8192)  # 0xFFFFE000: sign, exponent and the 10 mantissa bits TF32 keeps


@triton.jit
def _split(x):
    """(hi, lo): hi = x rounded to TF32, to nearest with ties away from zero (``cvt.rna.tf32.f32``
    done as an integer add and mask), lo = x - hi, exact in FP32 with |lo| <= 2^-11 |x|."""
    hi = ((x.to(tl.int32, bitcast=True) + 0x1000) & _TF32_HI).to(tl.float32, bitcast=True)
    return hi, x - hi


@triton.jit
def _dot3(a, b):
    """a·b with FP32-grade products from three TF32 MMAs on split operands, as Triton's ``tf32x3``:
    lo·hi and hi·lo, then hi·hi, accumulated by the tensor cores from zero. Callers add any
    accumulator on the CUDA cores: chained onto a large accumulator, the tensor cores' addition
    drops low bits of the small products (H200: 7.8e-6 against 2.6e-7 relative L2 on o). Cheaper
    than ``tf32x3``: the split is an integer add and mask, and there is no NaN mask between the
    MMAs (the operands here are finite)."""
    a_hi, a_lo = _split(a)
    b_hi, b_lo = _split(b)
    out = tl.dot(a_lo, b_hi, tl.zeros([a.shape[0], b.shape[1]], dtype=tl.float32), input_precision="tf32")
    out = tl.dot(a_hi, b_lo, out, input_precision="tf32")
    return tl.dot(a_hi, b_hi, out, input_precision="tf32")


@triton.jit
def _dot3t(a, b):
    """:func:`_dot3` computed as (bᵀ·aᵀ)ᵀ: the same products. TF32 tensor cores read their second
    operand K-major from shared memory. Staging a row-major b there takes one scalar (transposing)
    store per element; staging aᵀ, for a row-major a, takes vector stores. For tiles loaded from memory:
    H200, ``notes/dot3_probe.py``, 1040 -> 622 us (the kernel's no-dot floor: 599). On operands that
    other dots produced or that stay live, the extra layout conversions cost more than that (session 15:
    the chunk kernel's own solve 4.0 -> 5.0 ms, the state pass 2.4 -> 3.5 ms)."""
    return tl.trans(_dot3(tl.trans(b), tl.trans(a)))


# ---------------------------------------------------------------------------------------------
# kernel 1: within-chunk quantities, one program per (chunk slot, head)
# ---------------------------------------------------------------------------------------------


@triton.jit
def _block_rows(kh, gc, J: tl.constexpr, BKB: tl.constexpr):
    """Rows 16J..16J+15 of k̂ and of the FP64 cumulative gate (a select over the four row blocks
    adds three zeros: exact), and the selector."""
    sel = (tl.arange(0, 4) == J)[:, None, None]
    kJ = tl.sum(tl.where(sel, tl.reshape(kh, [4, 16, BKB]), 0.0), 0)
    gJ = tl.sum(tl.where(sel, tl.reshape(gc, [4, 16, BKB]), 0.0), 0)
    return sel, kJ, gJ


@triton.jit
def _exact_column(kJ, gJ, gc, r, J: tl.constexpr, jj):
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
        kj, dec = _exact_column(kJ, gJ, gc, r, J, jj)
        kd = kj[None, :] * dec
        col = (a16 == jj)[None, :]
        dq = tl.where(col, tl.sum(qh * kd, 1)[:, None], dq)
        dk = tl.where(col, tl.sum(kh * kd, 1)[:, None], dk)
    return dq, dk


@triton.jit
def _col_block(qh, kh, gc, r, acc_q, acc_k, J: tl.constexpr, BKB: tl.constexpr, SPAN: tl.constexpr):
    """Add one K-slice's contribution to column block J (columns 16J..16J+15) of the unmasked
    q̂–k̂ (acc_q) and k̂–k̂ (acc_k) decay products. qh, kh: [64, BKB] FP32; gc: [64, BKB] FP64."""
    _, kJ, gJ = _block_rows(kh, gc, J, BKB)
    ref = tl.sum(tl.where((tl.arange(0, 16) == 8)[:, None], gJ, 0.0), 0)  # gc at row 16J+8
    below = r[:, None] >= 16 * J
    left = tl.where(below, gc - ref[None, :], 0.0).to(tl.float32)
    right = (ref[None, :] - gJ).to(tl.float32)
    span = tl.maximum(tl.max(left), tl.max(right))
    if span <= SPAN:
        el = tl.exp(left)
        rt = tl.trans(kJ * tl.exp(right))  # [BKB, 16]
        acc_q += _dot3(tl.where(below, qh * el, 0.0), rt)
        acc_k += _dot3(tl.where(below, kh * el, 0.0), rt)
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
def _chunk_exponents(gc, ref):
    """gc_i − gc_32 for every row (ref: row 32 of gc, from :func:`_k_slice`), a difference of two FP64
    rows rounded once to FP32: the exponents of the whole-chunk factors e^{gc_i − gc_32} (rows i) and
    e^{gc_32 − gc_j} (rows j, the negation)."""
    return (gc - ref[None, :]).to(tl.float32)


@triton.jit
def _whole_chunk_products(qh, kh, x, acc_q, acc_k):
    """Add one K-slice's decay products factored at row 32 (x: :func:`_chunk_exponents`)."""
    rt = tl.trans(kh * tl.exp(-x))  # [BKB, 64]
    el = tl.exp(x)
    return acc_q + _dot3(qh * el, rt), acc_k + _dot3(kh * el, rt)


@triton.jit
def _decay_products(qh, kh, gc, x, r, acc_q, acc_k, BKB: tl.constexpr, SPAN: tl.constexpr, BLOCKS: tl.constexpr):
    """Add one K-slice's unmasked q̂–k̂ (acc_q) and k̂–k̂ (acc_k) decay products, [64, 64] each.
    Whole chunk at once, factored at row 32 (x: :func:`_chunk_exponents`). With BLOCKS (the launch for the
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
def _elim_step(Z, M, lJ, r, J: tl.constexpr, LAST: tl.constexpr):
    """Block J of the forward elimination: P_J = D_J⁻¹ M_J (rows 16J.. of A⁻¹); rows below lose
    L[:, J] · P_J. Z: the stacked diagonal inverses [4,16,16]; M: the eliminated identity [64,64]."""
    ZJ = tl.sum(tl.where((tl.arange(0, 4) == J)[:, None, None], Z, 0.0), 0)  # [16,16]
    EJ = tl.reshape(tl.where((tl.arange(0, 4) == J)[None, :, None], ZJ[:, None, :], 0.0), [16, 64])
    P = _dot3(EJ, M)  # [16,64]
    if not LAST:
        M = M - _dot3(tl.where(r[:, None] >= 16 * (J + 1), lJ, 0.0), P)
    return P, M


@triton.jit
def _inverse_to(L, r, p):
    """(I + L)⁻¹ for the strictly lower L [64, 64], stored row-major at p (64×64 FP32, which also
    holds L meanwhile: rows and columns of L are read back from there, not selected in registers)."""
    tl.store(p + r[:, None] * 64 + tl.arange(0, 64)[None, :], L)
    tl.debug_barrier()
    ib = tl.arange(0, 4)
    a16 = tl.arange(0, 16)
    ra = a16[None, :, None]
    cb = a16[None, None, :]
    Z = tl.where(ra == cb, 1.0, 0.0) + tl.zeros([4, 16, 16], dtype=tl.float32)
    for s in tl.static_range(1, 16):  # row s of every diagonal inverse, from rows < s
        lrow = tl.load(p + (16 * ib[:, None] + s) * 64 + 16 * ib[:, None] + a16[None, :])  # [4,16]: L[16J+s, 16J+b]
        Z = tl.where(ra == s, Z - tl.sum(lrow[:, :, None] * Z, 1)[:, None, :], Z)
    c64 = tl.arange(0, 64)
    M = tl.where(r[:, None] == c64[None, :], 1.0, 0.0)
    P0, M = _elim_step(Z, M, tl.load(p + r[:, None] * 64 + a16[None, :]), r, 0, False)
    P1, M = _elim_step(Z, M, tl.load(p + r[:, None] * 64 + 16 + a16[None, :]), r, 1, False)
    P2, M = _elim_step(Z, M, tl.load(p + r[:, None] * 64 + 32 + a16[None, :]), r, 2, False)
    P3, M = _elim_step(Z, M, M, r, 3, True)  # (the last step eliminates nothing: no column block)
    tl.debug_barrier()
    p_rows = p + a16[:, None] * 64 + c64[None, :]
    tl.store(p_rows, P0)
    tl.store(p_rows + 16 * 64, P1)
    tl.store(p_rows + 32 * 64, P2)
    tl.store(p_rows + 48 * 64, P3)


@triton.jit
def _slot(chunk_map, cu, i_s, i_h, H: tl.constexpr):
    """Chunk slot i_s of head i_h: rows r, valid rows, token indices, and the slot's scratch index."""
    doc = tl.load(chunk_map + 2 * i_s)
    i_t = tl.load(chunk_map + 2 * i_s + 1)
    live = doc >= 0  # unused trailing slots of the fixed-length chunk list carry doc = -1
    doc = tl.maximum(doc, 0)
    start = tl.load(cu + doc) + i_t.to(tl.int64) * 64
    n = tl.where(live, tl.minimum(tl.load(cu + doc + 1) - start, 64), 0)
    r = tl.arange(0, 64)
    return r, r < n, n, start + r.to(tl.int64), i_s.to(tl.int64) * H + i_h


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
def _k_slice(q, k, g, tok, rows, r, n, rq, rk, i_h, kb, H: tl.constexpr, K: tl.constexpr, BKB: tl.constexpr):
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
    # round trip (H200, T = 16384, H = 64: a separate one for each, 71 us more, session 17)
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
def _chunk_kernel(q, k, g, beta, chunk_map, cu, QG, KGT, W, AQK, DEC, AI, NRM, FLAG, scale,
                  H: tl.constexpr, K: tl.constexpr, BK: tl.constexpr, BKB: tl.constexpr, EPS: tl.constexpr,
                  SPAN: tl.constexpr, STORE_A: tl.constexpr, LOAD_A: tl.constexpr, BLOCKS: tl.constexpr):
    # AI: per slot A⁻¹, then with STORE_A the k̂–k̂ products (no β, j < i; the backward reads them);
    # W gets the right-hand side β k̂ e^{gc} of w (the forward's state pass reads it; _solve_kernel turns
    # it into w for the split pass and the backward). LOAD_A: Aqk and AI hold a previous call's
    # results: skip the decay products and the inverse, recompute only qg, kgᵀ, w's right-hand side
    # and e^{gc_last}. Otherwise two launches: without BLOCKS a program
    # computes its chunk while every slice's whole-chunk exponents stay within SPAN, stops at the first
    # slice where they do not and then flags the chunk in FLAG; with BLOCKS a program computes only a
    # flagged chunk
    i_h = tl.program_id(1)
    r, rows, n, tok, slot = _slot(chunk_map, cu, tl.program_id(0), i_h, H)
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
        c, qh, kh, gc, gl, ref = _k_slice(q, k, g, tok, rows, r, n, rq, rk, i_h, kb, H, K, BKB)
        x = _chunk_exponents(gc, ref)
        go = True
        if not LOAD_A and not BLOCKS:
            xmax = tl.maximum(xmax, tl.max(tl.abs(x)))
            go = xmax <= SPAN
        if go:  # (the first launch's results of a flagged chunk are all overwritten by the second)
            _store_k_slice(QG, W, KGT, DEC, slot, r, c, qh, kh, gc, gl, b, scale, BK)
            if not LOAD_A:
                acc_q, acc_k = _decay_products(qh, kh, gc, x, r, acc_q, acc_k, BKB, SPAN, BLOCKS)

    if not LOAD_A:
        if not BLOCKS:
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
        _inverse_to(akk * b[:, None], r, AI + slot * (8192 if STORE_A else 4096))


@triton.jit
def _solve_kernel(v, beta, chunk_map, cu, W, U, AI, H: tl.constexpr, V: tl.constexpr, BK: tl.constexpr,
                  BV: tl.constexpr, BC: tl.constexpr, AIS: tl.constexpr):
    # one program per (BC-column block, chunk slot, head), the blocks of a slot adjacent so that they
    # share its A⁻¹ (AIS floats per slot in AI) in L2: the K columns of w = A⁻¹ (β k̂ e^{gc}), in
    # place of its right-hand side in W, then the V columns of u = A⁻¹ (β v)
    NK: tl.constexpr = BK // BC
    NB: tl.constexpr = NK + BV // BC
    i_h = tl.program_id(1)
    i_c = tl.program_id(0) % NB
    r, rows, n, tok, slot = _slot(chunk_map, cu, tl.program_id(0) // NB, i_h, H)
    ainv = tl.load(AI + slot * AIS + r[:, None] * 64 + tl.arange(0, 64)[None, :])
    if i_c < NK:
        c = i_c * BC + tl.arange(0, BC)
        t_off = slot * (64 * BK) + r[:, None] * BK + c[None, :]
        tl.store(W + t_off, _dot3t(ainv, tl.load(W + t_off)))
    else:
        c = (i_c - NK) * BC + tl.arange(0, BC)
        m = rows[:, None] & (c < V)[None, :]
        b = tl.load(beta + tok * H + i_h, mask=rows, other=0.0).to(tl.float32)
        vx = tl.load(v + tok[:, None] * (H * V) + i_h * V + c[None, :], mask=m, other=0.0).to(tl.float32)
        tl.store(U + slot * (64 * BV) + r[:, None] * BV + c[None, :], _dot3t(ainv, vx * b[:, None]))


# ---------------------------------------------------------------------------------------------
# kernel 2: the state pass, one program per (V-block, head, document)
# ---------------------------------------------------------------------------------------------


@triton.jit
def _doc_tiles(cu, first_slot, i_v, i_h, i_n, H: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
               KS: tl.constexpr, BVT: tl.constexpr):
    """Document i_n of a state pass (V block i_v, head i_h): its first token, length and first
    chunk slot; the state's K rows ``ck`` and V columns ``cv``; offsets and masks of its two
    [KS, BVT] tiles (K rows 0-63 and 64-127) in an ``[N,H,K,V]`` state tensor."""
    bos = tl.load(cu + i_n)
    length = tl.load(cu + i_n + 1) - bos
    slot0 = tl.load(first_slot + i_n)
    ck = tl.arange(0, KS)
    cv = i_v * BVT + tl.arange(0, BVT)
    m_a = (ck < K)[:, None] & (cv < V)[None, :]
    m_b = (ck + 64 < K)[:, None] & (cv < V)[None, :]
    off_a = ((i_n * H + i_h) * K + ck[:, None]).to(tl.int64) * V + cv[None, :]
    return bos, length, slot0, ck, cv, off_a, off_a + 64 * V, m_a, m_b


@triton.jit
def _load_state(ptr, off_a, off_b, m_a, m_b, GIVEN: tl.constexpr, KS: tl.constexpr, BVT: tl.constexpr):
    """The two tiles of a state (or its cotangent) from ``ptr``, or zeros when not GIVEN."""
    if GIVEN:
        a = tl.load(ptr + off_a, mask=m_a, other=0.0)
        b = tl.load(ptr + off_b, mask=m_b, other=0.0)
    else:
        a = tl.zeros([KS, BVT], dtype=tl.float32)
        b = tl.zeros([KS, BVT], dtype=tl.float32)
    return a, b


@triton.jit
def _store_state(ptr, a, b, off_a, off_b, m_a, m_b, TWO: tl.constexpr):
    tl.store(ptr + off_a, a, mask=m_a)
    if TWO:
        tl.store(ptr + off_b, b, mask=m_b)


@triton.jit
def _state_kernel(QG, KGT, W, U, AQK, DEC, AI, v, beta, o, h0, ht, cu, first_slot, HS, VN,
                  H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                  BVT: tl.constexpr, AIS: tl.constexpr, HAS_H0: tl.constexpr, SPLIT: tl.constexpr):
    # the state [K, BVT] is held as one or two [≤64, BVT] register tiles (K rows 0-63, 64-127): each
    # dot's A operand (split into TF32 hi/lo in registers) is then at most [64, 64], which keeps
    # K = 128 free of register spills. SPLIT: W and U hold the solve kernel's w and u, v_new = u − w·h;
    # otherwise W holds w's right-hand side R = βk̂e^{gc} and v_new = A⁻¹(βv − R·h) (A⁻¹ at AI, AIS
    # floats per slot; v and beta the inputs)
    KS: tl.constexpr = BK if BK < 64 else 64
    TWO: tl.constexpr = BK > 64
    i_h = tl.program_id(1)
    bos, length, slot0, ck, cv, off_a, off_b, m_a, m_b = _doc_tiles(
        cu, first_slot, tl.program_id(0), i_h, tl.program_id(2), H, K, V, KS, BVT)
    r = tl.arange(0, 64)
    c64 = tl.arange(0, 64)
    ha, hb = _load_state(h0, off_a, off_b, m_a, m_b, HAS_H0, KS, BVT)
    n_chunks = tl.cdiv(length, 64).to(tl.int32)
    for it in range(n_chunks):  # SPLIT: software-pipelined, the next chunks' loads in flight (STATE_STAGES)
        slot = (slot0 + it).to(tl.int64) * H + i_h
        p_w = W + slot * (64 * BK) + r[:, None] * BK + ck[None, :]
        p_q = QG + slot * (64 * BK) + r[:, None] * BK + ck[None, :]
        p_k = KGT + slot * (BK * 64) + ck[:, None] * 64 + c64[None, :]
        p_d = DEC + slot * BK + ck
        wh = _dot3(tl.load(p_w), ha)
        if TWO:
            wh += _dot3(tl.load(p_w + 64), hb)
        if SPLIT:  # the state before this chunk and v_new, for _output_kernel
            p_u = slot * (64 * BV) + r[:, None] * BV + cv[None, :]
            vn = tl.load(U + p_u) - wh
            p_h = slot * (BK * BV) + ck[:, None] * BV + cv[None, :]
            tl.store(HS + p_h, ha)
            if TWO:
                tl.store(HS + p_h + 64 * BV, hb)
            tl.store(VN + p_u, vn)
        else:
            tok, live, m_o = _chunk_rows(bos, length, it, r, cv, V)
            vx = tl.load(v + tok[:, None] * (H * V) + i_h * V + cv[None, :], mask=m_o, other=0.0).to(tl.float32)
            b = tl.load(beta + tok * H + i_h, mask=live, other=0.0).to(tl.float32)
            x = tl.fma(vx, b[:, None], -wh)  # (one rounding, as the Gluon kernel's)
            vn = _dot3(tl.load(AI + slot * AIS + r[:, None] * 64 + c64[None, :]), x)
            _store_output(p_q, ha, hb, AQK + slot * 4096, vn, o, bos, length, it, i_h, r, cv, H, V, TWO)
        ha = ha * tl.load(p_d)[:, None] + _dot3(tl.load(p_k), vn)
        if TWO:
            hb = hb * tl.load(p_d + 64)[:, None] + _dot3(tl.load(p_k + 64 * 64), vn)
    _store_state(ht, ha, hb, off_a, off_b, m_a, m_b, TWO)


@triton.jit
def _chunk_rows(bos, length, t, r, cv, V: tl.constexpr):
    """Chunk t of a document (first token bos, ``length`` tokens): its token indices, which rows lie
    inside the document, and the mask of its [64, BVT] tile of V columns cv."""
    live = r < length - t * 64
    return bos + t * 64 + r, live, live[:, None] & (cv < V)[None, :]


@triton.jit
def _store_output(p_q, ha, hb, aqk, vn, o, bos, length, t, i_h, r, cv, H: tl.constexpr, V: tl.constexpr,
                  TWO: tl.constexpr):
    # chunk t's output rows o = qg·h + Aqk·v_new (h: the state entering the chunk, as one or two
    # 64-row tiles ha, hb), stored in o's dtype; rows past the document's end are masked
    ov = _dot3(tl.load(p_q), ha)
    if TWO:
        ov += _dot3(tl.load(p_q + 64), hb)
    c64 = tl.arange(0, 64)
    ov += _dot3(tl.load(aqk + r[:, None] * 64 + c64[None, :]), vn)
    tok, _, m_o = _chunk_rows(bos, length, t, r, cv, V)
    tl.store(o + tok[:, None] * (H * V) + i_h * V + cv[None, :], ov.to(o.dtype.element_ty), mask=m_o)


@triton.jit
def _output_kernel(QG, AQK, HS, VN, o, chunk_map, cu,
                   H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                   BVT: tl.constexpr):
    # split_output: one program per (chunk slot, head, V-block), fully parallel:
    # o = qg·h + Aqk·v_new from the state entering the chunk and v_new, both stored by the state pass
    KS: tl.constexpr = BK if BK < 64 else 64
    i_s = tl.program_id(0).to(tl.int64)
    i_h = tl.program_id(1)
    i_v = tl.program_id(2)
    doc = tl.load(chunk_map + 2 * i_s)
    if doc >= 0:
        t = tl.load(chunk_map + 2 * i_s + 1)
        bos = tl.load(cu + doc)
        length = tl.load(cu + doc + 1) - bos
        slot = i_s * H + i_h
        r = tl.arange(0, 64)
        ck = tl.arange(0, KS)
        cv = i_v * BVT + tl.arange(0, BVT)
        p_q = QG + slot * (64 * BK) + r[:, None] * BK + ck[None, :]
        p_h = HS + slot * (BK * BV) + ck[:, None] * BV + cv[None, :]
        ha = tl.load(p_h)
        hb = tl.load(p_h + 64 * BV) if BK > 64 else ha  # (unused unless BK > 64)
        vn = tl.load(VN + slot * (64 * BV) + r[:, None] * BV + cv[None, :])
        _store_output(p_q, ha, hb, AQK + slot * 4096, vn, o, bos, length, t, i_h, r, cv, H, V, BK > 64)


# ---------------------------------------------------------------------------------------------
# host wrapper
# ---------------------------------------------------------------------------------------------


def _pow2(n: int) -> int:
    return max(16, triton.next_power_of_2(n))


def _check(q, k, v, g, beta, initial_state, cu_seqlens):
    if q.dim() != 4 or k.shape != q.shape or g.shape != q.shape:
        raise ValueError(f"kda_fp32_fwd: q, k, g must be [B,T,H,K] of one shape, got {tuple(q.shape)}, "
                         f"{tuple(k.shape)}, {tuple(g.shape)}")
    B, T, H, K = q.shape
    if v.dim() != 4 or v.shape[:3] != q.shape[:3] or beta.shape != q.shape[:3]:
        raise ValueError(f"kda_fp32_fwd: v must be [B,T,H,V] and beta [B,T,H] with B,T,H = {B},{T},{H}, got "
                         f"{tuple(v.shape)} and {tuple(beta.shape)}")
    V = v.shape[-1]
    if not (1 <= K <= MAX_DIM and 1 <= V <= MAX_DIM):
        raise ValueError(f"kda_fp32_fwd: head dims K, V must be in 1..{MAX_DIM}, got K={K}, V={V}")
    for name, t in (("q", q), ("k", k), ("v", v), ("beta", beta)):
        if t.dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(f"kda_fp32_fwd: {name} must be float32 or bfloat16, got {t.dtype}")
    if g.dtype != torch.float32:
        raise ValueError(f"kda_fp32_fwd: g (log-decay) must be float32, got {g.dtype}")
    if cu_seqlens is not None:
        if cu_seqlens.dtype != torch.int64 or cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
            raise ValueError("kda_fp32_fwd: cu_seqlens must be a 1-D int64 tensor of N+1 >= 2 offsets")
        if B != 1:
            raise ValueError(f"kda_fp32_fwd: batch must be 1 when cu_seqlens packs documents, got B={B}")
    N = B if cu_seqlens is None else cu_seqlens.numel() - 1
    if initial_state is not None and (initial_state.dtype != torch.float32
                                      or tuple(initial_state.shape) != (N, H, K, V)):
        raise ValueError(f"kda_fp32_fwd: initial_state must be float32 [N,H,K,V] = {(N, H, K, V)}, got "
                         f"{initial_state.dtype} {tuple(initial_state.shape)}")


@triton.jit
def _chunk_list_kernel(cu, chunk_map, first, N, n_slots, steps, C: tl.constexpr, BN: tl.constexpr,
                       BS: tl.constexpr):
    # one program: each document's first slot (a running prefix sum of its chunk counts of C tokens,
    # BN documents at a time), then per slot its document (the last one whose first slot is at most
    # the slot, by binary search over ``first``, which the program has just written) and its chunk
    total = tl.full([], 0, tl.int64)
    for d0 in range(0, N, BN):
        d = d0 + tl.arange(0, BN)
        m = d < N
        nch = tl.where(m, (tl.load(cu + d + 1, mask=m, other=0) - tl.load(cu + d, mask=m, other=0) + C - 1) // C, 0)
        tl.store(first + d, (total + tl.cumsum(nch, 0) - nch).to(tl.int32), mask=m)
        total += tl.sum(nch, 0)
    tl.debug_barrier()
    for s0 in range(0, n_slots, BS):
        s = s0 + tl.arange(0, BS)
        lo = tl.zeros([BS], dtype=tl.int32)
        hi = tl.zeros([BS], dtype=tl.int32) + N
        for _ in range(steps):
            mid = (lo + hi) // 2
            act = hi - lo > 1
            go = tl.load(first + mid, mask=act, other=0) <= s
            lo = tl.where(act & go, mid, lo)
            hi = tl.where(act & ~go, mid, hi)
        live = s < total
        m = s < n_slots
        tl.store(chunk_map + 2 * s, tl.where(live, lo, -1), mask=m)
        tl.store(chunk_map + 2 * s + 1, tl.where(live, s - tl.load(first + lo, mask=m & live, other=0), 0), mask=m)


def _chunk_list(cu: torch.Tensor, n_slots: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Device-side, fixed length: (document, chunk) per slot ``[n_slots, 2]`` int32 (document -1 =
    unused slot) and each document's first slot ``[N]`` int32, for documents at the int64 offsets
    ``cu`` ``[N+1]``. No host synchronisation. One kernel: H200, one 16384-token document, 18 us in
    CUDA-graph replay against 31 us for the 18 small torch ops it replaced (session 19)."""
    N = cu.numel() - 1
    chunk_map = torch.empty(n_slots, 2, device=cu.device, dtype=torch.int32)
    first = torch.empty(N, device=cu.device, dtype=torch.int32)
    _chunk_list_kernel[(1,)](cu, chunk_map, first, N, n_slots, max(N - 1, 0).bit_length(), C=CHUNK,
                             BN=min(_pow2(N), 1024), BS=min(_pow2(n_slots), 1024), num_warps=4)
    return chunk_map, first


@dataclasses.dataclass
class ChunkPass:
    """What the chunk and solve kernels leave for the state passes: the chunk list, the chunk-major
    FP32 intermediates ``[slot, H, ...]``, the launch geometry, and v and beta (the forward's state pass
    reads them when the solve kernel did not run)."""

    N: int
    H: int
    K: int
    V: int
    BK: int
    BV: int
    BKB: int
    BVB: int
    BVT: int
    n_slots: int
    cu: torch.Tensor
    chunk_map: torch.Tensor
    first_slot: torch.Tensor
    QG: torch.Tensor
    KGT: torch.Tensor
    W: torch.Tensor  # w, or (not solved) its right-hand side βk̂e^{gc}
    U: torch.Tensor  # u, or (not solved) empty
    AQK: torch.Tensor
    DEC: torch.Tensor
    AI: torch.Tensor  # per slot A⁻¹, then (kept) the k̂–k̂ products (no β): [slot, H, 1 or 2 (kept), 64, 64]
    NRM: torch.Tensor  # per slot 1/‖q‖ and 1/‖k‖ of each row, [slot, H, 2, 64]
    v: torch.Tensor
    beta: torch.Tensor
    solved: bool  # whether the solve kernel ran (W holds w, U u)


def contiguous_inputs(*xs: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The inputs as contiguous tensors in their own dtypes. The kernels convert BF16 to FP32 as they
    load it (exact), so BF16 inputs cost no FP32 copies. H200, T = 16384, H = 64, K = V = 128, BF16
    q, k, v, beta and do: forward 8078 -> 7222 us and forward + backward 28191 -> 24334 us against
    promoting them to FP32 copies first, although the chunk kernel itself takes 4857 instead of 4531 us
    (more spills: sm_90, 2112 against 624 bytes of spill loads); notes/kda-fp32-kernels.md, session 14."""
    return tuple(x.contiguous() for x in xs)


def _check_blocks(name: str, block_k: int, block_v: int, **maxnregs: int | None) -> None:
    """Block sizes 16, 32 or 64; each named register cap None or 32..255."""
    for arg, blk in (("block_k", block_k), ("block_v", block_v)):
        if blk not in (16, 32, 64):
            raise ValueError(f"{name}: {arg} must be 16, 32 or 64, got {blk}")
    for arg, cap in maxnregs.items():
        if cap is not None and not 32 <= cap <= 255:
            raise ValueError(f"{name}: {arg} must be None or 32..255 registers, got {cap}")


def chunk_pass(q, k, v, g, beta, scale, cu_seqlens, *, block_k: int, block_v: int, warps: int,
               chunk_maxnreg: int | None, keep_a: bool = False, given_a: tuple | None = None,
               solve: bool = True) -> ChunkPass:
    """Launch the chunk kernel (twice) and, with ``solve``, the solve kernel on contiguous, checked
    inputs (see :func:`kda_fp32_fwd`). ``keep_a``: keep the k̂–k̂ products in ``AI`` beside A⁻¹;
    ``given_a``: (Aqk, AI) of an earlier call on the same inputs, which the chunk kernel then does not
    recompute. Without ``solve`` (the forward's state pass, which solves v_new itself) W keeps w's
    right-hand side and U is empty."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    dev = q.device
    BK, BV = _pow2(K), _pow2(V)
    if cu_seqlens is None:
        N = B
        cu = torch.arange(B + 1, device=dev, dtype=torch.int64) * T
    else:
        N = cu_seqlens.numel() - 1
        cu = cu_seqlens.contiguous()
    n_slots = chunk_count(q, cu_seqlens)
    S = chunk_slots(q, cu_seqlens)  # the scratch's and the residuals' first dim
    chunk_map, first_slot = _chunk_list(cu, S)
    f32 = dict(device=dev, dtype=torch.float32)
    if given_a is not None:
        aqk, ai = given_a
        if tuple(aqk.shape) != (S, H, CHUNK, CHUNK) or tuple(ai.shape) != (S, H, 2, CHUNK, CHUNK):
            raise ValueError(f"kda_fp32: given (Aqk, AI) must be [{S},{H},64,64] and [{S},{H},2,64,64], got "
                             f"{tuple(aqk.shape)} and {tuple(ai.shape)}")
    else:
        aqk = torch.empty(S, H, CHUNK, CHUNK, **f32)
        ai = torch.empty(S, H, 2 if keep_a else 1, CHUNK, CHUNK, **f32)
    cp = ChunkPass(
        N=N, H=H, K=K, V=V, BK=BK, BV=BV, BKB=min(BK, block_k), BVB=min(BV, block_k), BVT=min(BV, block_v),
        n_slots=n_slots, cu=cu, chunk_map=chunk_map, first_slot=first_slot,
        QG=torch.empty(S, H, CHUNK, BK, **f32), KGT=torch.empty(S, H, BK, CHUNK, **f32),
        W=torch.empty(S, H, CHUNK, BK, **f32), U=torch.empty(S if solve else 0, H, CHUNK, BV, **f32),
        AQK=aqk, DEC=torch.empty(S, H, BK, **f32), AI=ai, NRM=torch.empty(S, H, 2, CHUNK, **f32), v=v, beta=beta,
        solved=solve)
    if n_slots > 0 and H > 0:
        load_a = given_a is not None
        # per (slot, head): 1 where the chunk's whole-chunk factors may exceed e^SPAN (not used when reading A)
        flag = torch.empty(0 if load_a else S, H, device=dev, dtype=torch.int32)
        for blocks in (False,) if load_a else (False, True):
            _chunk_kernel[(n_slots, H)](
                q, k, g, beta, chunk_map, cu, cp.QG, cp.KGT, cp.W, cp.AQK, cp.DEC, ai, cp.NRM,
                flag if flag.numel() else aqk, float(scale), H=H, K=K, BK=BK, BKB=cp.BKB, EPS=L2_EPS, SPAN=SPAN,
                STORE_A=keep_a and not load_a, LOAD_A=load_a, BLOCKS=blocks, num_warps=warps,
                num_stages=CHUNK_STAGES, maxnreg=chunk_maxnreg)  # (FLAG is not touched unless used)
        if solve:
            BC = min(SOLVE_COLUMNS, BK, BV)
            _solve_kernel[(n_slots * ((BK + BV) // BC), H)](
                v, beta, chunk_map, cu, cp.W, cp.U, ai, H=H, V=V, BK=BK, BV=BV, BC=BC, AIS=ai.stride(1),
                num_warps=warps)
    return cp


def state_pass(cp: ChunkPass, o, initial_state, final, *, warps: int, split_output: bool, HS=None, VN=None):
    """Launch the state kernel: o and the final state (``cp`` not solved: v_new = A⁻¹(βv − R·h) per
    chunk), or (``split_output``, o None, ``cp`` solved) the final state, the state entering every chunk
    into HS and v_new = u − w·h into VN. On Hopper, for K in 65..128 with 64 V columns per program and o
    wanted, the Gluon kernel of ``kda_fp32_gluon`` (the same results, bitwise); ``warps`` is the Triton
    kernel's."""
    if cp.N == 0 or cp.H == 0:
        return
    if split_output != cp.solved:
        raise ValueError("kda_fp32 state_pass: split_output needs a solved ChunkPass (w, u), o an unsolved one")
    if kda_fp32_gluon.usable(final.device, cp.BK, cp.BVT, split_output):
        kda_fp32_gluon.state_pass_gluon(cp, o, initial_state, final)
    else:
        h0 = initial_state.contiguous() if initial_state is not None else final
        _state_kernel[(cp.BV // cp.BVT, cp.H, cp.N)](
            cp.QG, cp.KGT, cp.W, cp.U, cp.AQK, cp.DEC, cp.AI, cp.v, cp.beta, final if o is None else o, h0, final,
            cp.cu, cp.first_slot, final if HS is None else HS, final if VN is None else VN,
            H=cp.H, K=cp.K, V=cp.V, BK=cp.BK, BV=cp.BV, BVT=cp.BVT, AIS=cp.AI.stride(1),
            HAS_H0=initial_state is not None, SPLIT=split_output, num_warps=warps,
            num_stages=STATE_STAGES if split_output else FUSED_STATE_STAGES)


def kda_fp32_fwd(q, k, v, g, beta, scale, initial_state=None, cu_seqlens=None, *,
                 block_k: int = 32, block_v: int = 64, warps: tuple[int, int] = (4, 4),
                 chunk_maxnreg: int | None = 168, split_output: bool = False, keep_a: bool = False):
    """KDA chunk forward with FP32-grade arithmetic (see the module docstring).

    q, k ``[B,T,H,K]`` and v ``[B,T,H,V]`` FP32 or BF16 (read as they are, converted to FP32 on load),
    g ``[B,T,H,K]`` FP32, beta ``[B,T,H]``,
    optional FP32 initial_state ``[N,H,K,V]``, optional int64 cu_seqlens ``[N+1]`` (then B = 1).
    Returns (o in v's dtype ``[B,T,H,V]``, final state FP32 ``[N,H,K,V]``). Tuning knobs, not
    semantics: ``block_k`` (K and V columns per step of the chunk kernel's loops), ``block_v`` (V
    columns per state-pass program) and ``warps`` (chunk and solve kernels, Triton state kernel; the Gluon
    state pass of ``kda_fp32_gluon``, taken on Hopper for block_v 64 and K > 64, runs 8). On the H200 (triton
    3.6) 8 warps in the chunk kernel fault with an illegal memory access at T=2048, H=64 (two
    warpgroups on M=64 tf32x3 dots, n8 wgmma; not retried with ``_dot3``); 4 warps run (see
    ``notes/kda-fp32-kernels.md``).
    ``chunk_maxnreg`` caps the chunk kernel's registers per thread (None: ptxas' choice, 255 with
    spills): 168 measured fastest on the H200 (T=16384, H=64, tf32x3 dots: 7.0 vs 8.5 ms; 128: 7.6;
    192: 9.0; ``_dot3``: 6.2 ms, 128: 6.7).
    ``split_output``: the solve kernel computes w and u, the state pass only carries the state
    (``v_new = u − w·h``, then ``kgᵀ·v_new``) and stores each chunk's entering state and v_new (FP32,
    1.6 GB at T=16384, H=64, K=V=128); a parallel third kernel computes o from them.
    ``keep_a``: also return (Aqk ``[S,H,64,64]``, AI ``[S,H,2,64,64]``: A⁻¹ and the k̂–k̂ products),
    chunk-major FP32 with S = ``inductor_ext.ops.kda.chunk_slots``, for ``kda_fp32_bwd(..., given_a=...)``.
    """
    _check(q, k, v, g, beta, initial_state, cu_seqlens)
    _check_blocks("kda_fp32_fwd", block_k, block_v, chunk_maxnreg=chunk_maxnreg)
    o = torch.empty(v.shape, device=v.device, dtype=v.dtype)  # stored in v's dtype by the state kernel
    q, k, v, g, beta = contiguous_inputs(q, k, v, g, beta)
    cp = chunk_pass(q, k, v, g, beta, scale, cu_seqlens, block_k=block_k, block_v=block_v, warps=warps[0],
                    chunk_maxnreg=chunk_maxnreg, keep_a=keep_a, solve=split_output)
    final = torch.empty(cp.N, cp.H, cp.K, cp.V, device=q.device, dtype=torch.float32)
    kept = (cp.AQK, cp.AI) if keep_a else ()
    if not split_output:
        state_pass(cp, o, initial_state, final, warps=warps[1], split_output=False)
        return (o, final, *kept)
    f32 = dict(device=q.device, dtype=torch.float32)
    HS = torch.empty(cp.QG.shape[0], cp.H, cp.BK, cp.BV, **f32)
    VN = torch.empty_like(cp.U)
    state_pass(cp, o, initial_state, final, warps=warps[1], split_output=True, HS=HS, VN=VN)
    if cp.n_slots > 0 and cp.H > 0:
        _output_kernel[(cp.n_slots, cp.H, cp.BV // cp.BVT)](
            cp.QG, cp.AQK, HS, VN, o, cp.chunk_map, cp.cu, H=cp.H, K=cp.K, V=cp.V, BK=cp.BK, BV=cp.BV,
            BVT=cp.BVT, num_warps=warps[1])
    return (o, final, *kept)
