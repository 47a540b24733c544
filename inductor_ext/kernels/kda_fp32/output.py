"""Output rows of the FP32 KDA forward: ``o = qg·h + Aqk·v_new`` per chunk.

:func:`store_output` computes and stores one chunk's rows (h: the state entering the chunk; the fused
state pass of :mod:`.state` calls it); :func:`output_kernel` (``split_output``), one program per (chunk
slot, head, V block), fully parallel, does the same from the entering states and v_new that the split
state pass stored. Every product is :func:`.primitives.dot3`; o is stored in its own dtype, rows past
a document's end masked.
"""

from __future__ import annotations

import triton
import triton.language as tl

from inductor_ext.kernels.kda_fp32.primitives import dot3

__all__ = ["chunk_rows", "store_output", "output_kernel"]


@triton.jit
def chunk_rows(bos, length, t, r, cv, V: tl.constexpr):
    """Chunk t of a document (first token bos, ``length`` tokens): its token indices, which rows lie
    inside the document, and the mask of its [64, BVT] tile of V columns cv."""
    live = r < length - t * 64
    return bos + t * 64 + r, live, live[:, None] & (cv < V)[None, :]


@triton.jit
def store_output(p_q, ha, hb, aqk, vn, o, bos, length, t, i_h, r, cv, H: tl.constexpr, V: tl.constexpr,
                 TWO: tl.constexpr):
    """Chunk t's output rows o = qg·h + Aqk·v_new (h: the state entering the chunk, as one or two
    64-row tiles ha, hb), stored in o's dtype; rows past the document's end are masked."""
    ov = dot3(tl.load(p_q), ha)
    if TWO:
        ov += dot3(tl.load(p_q + 64), hb)
    c64 = tl.arange(0, 64)
    ov += dot3(tl.load(aqk + r[:, None] * 64 + c64[None, :]), vn)
    tok, _, m_o = chunk_rows(bos, length, t, r, cv, V)
    tl.store(o + tok[:, None] * (H * V) + i_h * V + cv[None, :], ov.to(o.dtype.element_ty), mask=m_o)


@triton.jit
def output_kernel(QG, AQK, HS, VN, o, chunk_map, cu,
                  H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                  BVT: tl.constexpr):
    """split_output: one program per (chunk slot, head, V-block), fully parallel: o = qg·h + Aqk·v_new
    from the state entering the chunk (HS) and v_new (VN), both stored by the split state pass."""
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
        store_output(p_q, ha, hb, AQK + slot * 4096, vn, o, bos, length, t, i_h, r, cv, H, V, BK > 64)
