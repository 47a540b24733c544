"""The Triton state pass of the FP32 KDA kernels: :func:`state_kernel`, and the state-tile helpers
that the backward's state pass shares (:func:`doc_tiles`, :func:`load_state`, :func:`store_state`).

One program per (V block of BVT columns, head, document), sequential over the document's chunks with
the state ``[K, BVT]`` FP32 in registers as one or two 64-row tiles (K rows 0-63 and 64-127), so that
no dot operand exceeds [64, 64]. Per chunk, with R = β k̂ e^{gc} (w's right-hand side):

- fused (the forward; ``W`` holds R): ``v_new = A⁻¹(βv − R·h)``, ``βv − R·h`` rounded once (an FMA, as
  in the Gluon kernel of :mod:`.gluon_state`, which computes this form bitwise equally on Hopper), and
  ``o = qg·h + Aqk·v_new`` (:func:`.output.store_output`);
- ``SPLIT`` (``split_output`` and the backward; ``W`` and ``U`` hold the solve kernel's w and u):
  ``v_new = u − w·h``, the state entering every chunk stored into HS and v_new into VN (FP32);

then ``h ← e^{gc_last}·h + kgᵀ·v_new``. In the fused form the per-chunk states never reach global
memory. Every product is :func:`.primitives.dot3`.
"""

from __future__ import annotations

import triton
import triton.language as tl

from inductor_ext.kernels.kda_fp32.output import chunk_rows, store_output
from inductor_ext.kernels.kda_fp32.primitives import dot3

__all__ = ["state_kernel", "doc_tiles", "load_state", "store_state"]


@triton.jit
def doc_tiles(cu, first_slot, i_v, i_h, i_n, H: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
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
def load_state(ptr, off_a, off_b, m_a, m_b, GIVEN: tl.constexpr, KS: tl.constexpr, BVT: tl.constexpr):
    """The two tiles of a state (or its cotangent) from ``ptr``, or zeros when not GIVEN."""
    if GIVEN:
        a = tl.load(ptr + off_a, mask=m_a, other=0.0)
        b = tl.load(ptr + off_b, mask=m_b, other=0.0)
    else:
        a = tl.zeros([KS, BVT], dtype=tl.float32)
        b = tl.zeros([KS, BVT], dtype=tl.float32)
    return a, b


@triton.jit
def store_state(ptr, a, b, off_a, off_b, m_a, m_b, TWO: tl.constexpr):
    """Store a state's two tiles (b only when TWO) at the offsets and masks of :func:`doc_tiles`."""
    tl.store(ptr + off_a, a, mask=m_a)
    if TWO:
        tl.store(ptr + off_b, b, mask=m_b)


@triton.jit
def state_kernel(QG, KGT, W, U, AQK, DEC, AI, v, beta, o, h0, ht, cu, first_slot, HS, VN,
                 H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                 BVT: tl.constexpr, AIS: tl.constexpr, HAS_H0: tl.constexpr, SPLIT: tl.constexpr):
    """The state pass (module docstring), one program per (V block, head, document). The state
    [K, BVT] is held as one or two [≤64, BVT] register tiles (K rows 0-63, 64-127): each dot's A
    operand (split into TF32 hi/lo in registers) is then at most [64, 64], which keeps K = 128 free
    of register spills. SPLIT: W and U hold the solve kernel's w and u, v_new = u − w·h; otherwise
    W holds w's right-hand side R = βk̂e^{gc} and v_new = A⁻¹(βv − R·h) (A⁻¹ at AI, AIS floats per
    slot; v and beta the inputs). h0 is read when HAS_H0, the final state stored into ht."""
    KS: tl.constexpr = BK if BK < 64 else 64
    TWO: tl.constexpr = BK > 64
    i_h = tl.program_id(1)
    bos, length, slot0, ck, cv, off_a, off_b, m_a, m_b = doc_tiles(
        cu, first_slot, tl.program_id(0), i_h, tl.program_id(2), H, K, V, KS, BVT)
    r = tl.arange(0, 64)
    c64 = tl.arange(0, 64)
    ha, hb = load_state(h0, off_a, off_b, m_a, m_b, HAS_H0, KS, BVT)
    n_chunks = tl.cdiv(length, 64).to(tl.int32)
    for it in range(n_chunks):  # SPLIT: software-pipelined, the next chunks' loads in flight (STATE_STAGES)
        slot = (slot0 + it).to(tl.int64) * H + i_h
        p_w = W + slot * (64 * BK) + r[:, None] * BK + ck[None, :]
        p_q = QG + slot * (64 * BK) + r[:, None] * BK + ck[None, :]
        p_k = KGT + slot * (BK * 64) + ck[:, None] * 64 + c64[None, :]
        p_d = DEC + slot * BK + ck
        wh = dot3(tl.load(p_w), ha)
        if TWO:
            wh += dot3(tl.load(p_w + 64), hb)
        if SPLIT:  # the state before this chunk and v_new, for output_kernel
            p_u = slot * (64 * BV) + r[:, None] * BV + cv[None, :]
            vn = tl.load(U + p_u) - wh
            p_h = slot * (BK * BV) + ck[:, None] * BV + cv[None, :]
            tl.store(HS + p_h, ha)
            if TWO:
                tl.store(HS + p_h + 64 * BV, hb)
            tl.store(VN + p_u, vn)
        else:
            tok, live, m_o = chunk_rows(bos, length, it, r, cv, V)
            vx = tl.load(v + tok[:, None] * (H * V) + i_h * V + cv[None, :], mask=m_o, other=0.0).to(tl.float32)
            b = tl.load(beta + tok * H + i_h, mask=live, other=0.0).to(tl.float32)
            x = tl.fma(vx, b[:, None], -wh)  # (one rounding, as the Gluon kernel's)
            vn = dot3(tl.load(AI + slot * AIS + r[:, None] * 64 + c64[None, :]), x)
            store_output(p_q, ha, hb, AQK + slot * 4096, vn, o, bos, length, it, i_h, r, cv, H, V, TWO)
        ha = ha * tl.load(p_d)[:, None] + dot3(tl.load(p_k), vn)
        if TWO:
            hb = hb * tl.load(p_d + 64)[:, None] + dot3(tl.load(p_k + 64 * 64), vn)
    store_state(ht, ha, hb, off_a, off_b, m_a, m_b, TWO)
