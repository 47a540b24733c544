"""The state pass backwards of the FP32 KDA backward: :func:`state_bwd_kernel`.

One program per (V block, head, document), backwards over the document's chunks with dh ``[K, BVT]``
FP32 in registers as one or two 64-row tiles (as the forward's state, :mod:`.state`). Per chunk (h' the
state leaving it, dh' its gradient): ``dv_new = Aqkᵀ·do + kg·dh'`` and ``dh = e^{gc_last}·dh' + qgᵀ·do −
wᵀ·dv_new``; stores dv_new and the dh' of every chunk (for the chunk-gradient kernels of
:mod:`.backward_chunk`) and dh0. Every product is :func:`.primitives.dot3`.
"""

from __future__ import annotations

import triton
import triton.language as tl

from inductor_ext.kernels.kda_fp32.primitives import dot3
from inductor_ext.kernels.kda_fp32.state import doc_tiles, load_state, store_state

__all__ = ["state_bwd_kernel"]


@triton.jit
def _tile_t(ptr, rows, cols, ld: tl.constexpr):
    """The transpose of the row-major tile ``ptr[rows, cols]`` (leading dimension ld)."""
    return tl.trans(tl.load(ptr + rows[:, None] * ld + cols[None, :]))


@triton.jit
def state_bwd_kernel(QG, KGT, W, AQK, DEC, do, dht, dh0, cu, first_slot, DHS, DVN,
                     H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                     BVT: tl.constexpr, HAS_DHT: tl.constexpr):
    """The state pass backwards (module docstring), one program per (V block, head, document): dh
    [K, BVT] held as one or two [≤64, BVT] tiles (K rows 0-63, 64-127), as the forward state; dht read
    when HAS_DHT, dh0 stored."""
    KS: tl.constexpr = BK if BK < 64 else 64
    TWO: tl.constexpr = BK > 64
    i_h = tl.program_id(1)
    bos, length, slot0, ck, cv, off_a, off_b, m_a, m_b = doc_tiles(
        cu, first_slot, tl.program_id(0), i_h, tl.program_id(2), H, K, V, KS, BVT)
    r = tl.arange(0, 64)
    da, db = load_state(dht, off_a, off_b, m_a, m_b, HAS_DHT, KS, BVT)
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
        dvn = dot3(_tile_t(AQK + slot * 4096, r, r, 64), d_o)
        dvn += dot3(_tile_t(KGT + slot * (BK * 64), ck, r, 64), da)
        if TWO:
            dvn += dot3(_tile_t(KGT + slot * (BK * 64) + 64 * 64, ck, r, 64), db)
        tl.store(DVN + slot * (64 * BV) + r[:, None] * BV + cv[None, :], dvn)
        # dh = e^{gc_last}·dh' + qgᵀ·do − wᵀ·dv_new
        p_d = DEC + slot * BK + ck
        da = da * tl.load(p_d)[:, None] + dot3(_tile_t(QG + base, r, ck, BK), d_o) \
            - dot3(_tile_t(W + base, r, ck, BK), dvn)
        if TWO:
            db = db * tl.load(p_d + 64)[:, None] + dot3(_tile_t(QG + base + 64, r, ck, BK), d_o) \
                - dot3(_tile_t(W + base + 64, r, ck, BK), dvn)
    store_state(dh0, da, db, off_a, off_b, m_a, m_b, TWO)
