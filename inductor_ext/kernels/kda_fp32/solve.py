"""Triangular solves of the FP32 KDA kernels: each chunk's A⁻¹ (:func:`inverse_to`, called by the
chunk kernel) and w, u (:func:`solve_kernel`).

:func:`inverse_to`: ``(I + L)⁻¹`` for the strictly lower ``L`` [64, 64] FP32. The four 16×16 diagonal
blocks are inverted together by a 15-step row sweep ([4,16,16] tiles, FP32 elementwise), then block
forward elimination builds the four 16-row blocks of A⁻¹ with :func:`.primitives.dot3`. L is stored
first into A⁻¹'s own 64×64 slot, and the sweep's rows and the elimination's column blocks are loaded
back from there (L1/L2) instead of selected out of registers.

:func:`solve_kernel` (``split_output`` and the backward only), one program per (BC columns, chunk slot,
head): ``w = A⁻¹(β k̂ e^{gc})`` in place of its right-hand side and ``u = A⁻¹(β v)``, by
:func:`.primitives.dot3t` (both operands are tiles it loads itself).
"""

from __future__ import annotations

import triton
import triton.language as tl

from inductor_ext.kernels.kda_fp32.chunk_list import chunk_slot
from inductor_ext.kernels.kda_fp32.primitives import dot3, dot3t

__all__ = ["inverse_to", "solve_kernel"]


@triton.jit
def _elim_step(Z, M, lJ, r, J: tl.constexpr, LAST: tl.constexpr):
    """Block J of the forward elimination: P_J = D_J⁻¹ M_J (rows 16J.. of A⁻¹); rows below lose
    L[:, J] · P_J. Z: the stacked diagonal inverses [4,16,16]; M: the eliminated identity [64,64]."""
    ZJ = tl.sum(tl.where((tl.arange(0, 4) == J)[:, None, None], Z, 0.0), 0)  # [16,16]
    EJ = tl.reshape(tl.where((tl.arange(0, 4) == J)[None, :, None], ZJ[:, None, :], 0.0), [16, 64])
    P = dot3(EJ, M)  # [16,64]
    if not LAST:
        M = M - dot3(tl.where(r[:, None] >= 16 * (J + 1), lJ, 0.0), P)
    return P, M


@triton.jit
def inverse_to(L, r, p):
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
def solve_kernel(v, beta, chunk_map, cu, W, U, AI, H: tl.constexpr, V: tl.constexpr, BK: tl.constexpr,
                 BV: tl.constexpr, BC: tl.constexpr, AIS: tl.constexpr):
    """w and u of every chunk: one program per (BC-column block, chunk slot, head), the blocks of a slot
    adjacent so that they share its A⁻¹ (AIS floats per slot in AI) in L2: the K columns of
    w = A⁻¹ (β k̂ e^{gc}), in place of its right-hand side in W, then the V columns of u = A⁻¹ (β v)
    into U."""
    NK: tl.constexpr = BK // BC
    NB: tl.constexpr = NK + BV // BC
    i_h = tl.program_id(1)
    i_c = tl.program_id(0) % NB
    r, rows, n, tok, slot = chunk_slot(chunk_map, cu, tl.program_id(0) // NB, i_h, H)
    ainv = tl.load(AI + slot * AIS + r[:, None] * 64 + tl.arange(0, 64)[None, :])
    if i_c < NK:
        c = i_c * BC + tl.arange(0, BC)
        t_off = slot * (64 * BK) + r[:, None] * BK + c[None, :]
        tl.store(W + t_off, dot3t(ainv, tl.load(W + t_off)))
    else:
        c = (i_c - NK) * BC + tl.arange(0, BC)
        m = rows[:, None] & (c < V)[None, :]
        b = tl.load(beta + tok * H + i_h, mask=rows, other=0.0).to(tl.float32)
        vx = tl.load(v + tok[:, None] * (H * V) + i_h * V + c[None, :], mask=m, other=0.0).to(tl.float32)
        tl.store(U + slot * (64 * BV) + r[:, None] * BV + c[None, :], dot3t(ainv, vx * b[:, None]))
