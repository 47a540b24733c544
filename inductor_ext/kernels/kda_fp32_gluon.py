"""The FP32 KDA forward's state pass in Gluon, for Hopper (sm_90): ``state_pass_gluon``.

The same computation as ``kda_fp32_triton._state_kernel`` without ``SPLIT``, bitwise (the same three
TF32 products per tile, summed in the same order): one program per (64 V columns, head, document),
sequential over the document's chunks, per chunk ``v_new = A⁻¹(βv − R·h)`` (R = β k̂ e^{gc}, w's
right-hand side, which the chunk kernel stores in ``W``; v and beta the op's inputs), ``o = qg·h +
Aqk·v_new`` (stored in o's dtype) and ``h ← e^{gc_last}·h + kgᵀ·v_new``, the state ``h`` ``[128, 64]`` FP32
carried across the loop as its TF32 halves in shared memory.
Written in Gluon because Triton waits for every ``tl.dot`` of that loop before the next instruction and
spills at 255 registers: H200, T = 16384, H = 64, K = V = 128, Nsight Compute on the Triton kernel, 34 %
of its stall samples wait for a warpgroup MMA to finish and its spills hit L1 6 % of the time (196 KB of
staged loads leave little L1); ``notes/kda-fp32-kernels.md``, session 16. Here:

- every operand tile (R, qg, kgᵀ in 64-column halves, A⁻¹, Aqk) goes global -> shared memory by
  ``cp.async`` into a ring of four 64×64 slots, each refilled three tiles ahead of its use; the
  chunk's v rows and beta are loaded into registers;
- the tiles' TF32 hi/lo halves are A operands in registers; the halves of the state, of βv − R·h
  and of v_new, the B operands, are staged in shared memory once per chunk (K-major, as TF32 wgmma
  reads them);
- each three-product ``warpgroup_mma`` runs asynchronously while the next tile is loaded and
  split, so one product is waited for at a time instead of each MMA.

Only this geometry: K in 65..128 (the chunk kernel's BK = 128), 64 V columns per program, no
``split_output``; :func:`usable` says when, and ``kda_fp32_triton.state_pass`` takes the Triton
kernel otherwise. Shared memory 192 KB, 8 warps (two warpgroups splitting the 64 V columns; at 4
warps ptxas spilled 304 bytes per thread), 250 registers. H200, same size: with u − w·h from a separate
solve kernel (session 16), alone, 1758-1767 us against the Triton kernel's 2322-2354, the tensor
cores busy 42 % of the time (Nsight Compute), the shared-memory queue the next limit; solving v_new
here (eight products per chunk instead of seven) took the forward from 5316 to 4815 us without the
solve kernel (session 18; this kernel alone was not timed).
"""

from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, warpgroup_mma, warpgroup_mma_wait

__all__ = ["state_pass_gluon", "usable", "BK", "BVT", "WARPS"]

# the geometry, written into the kernel as its literals 128 and 64
BK = 128  # the chunk kernel's padded K: the state as two 64-row halves
BVT = 64  # V columns per program
# H200, T = 16384, H = 64, K = V = 128, alone: 1767 us at 8 warps, 1906 at 4 (Triton's kernel: 2354)
WARPS = 8
_TILES = gl.constexpr(8)  # operand tiles per chunk, in the order of use (see _tile_ptr)
_RING = gl.constexpr(4)  # shared-memory slots they cycle through


def usable(device: torch.device, bk: int, bvt: int, split_output: bool) -> bool:
    """Whether this kernel computes the state pass of a ChunkPass with padded K ``bk`` and ``bvt`` V
    columns per program on ``device``: a Hopper GPU (wgmma, cp.async), BK = 128, 64 columns, o wanted."""
    return (bk == BK and bvt == BVT and not split_output and device.type == "cuda"
            and torch.cuda.get_device_capability(device) == (9, 0))


@gluon.jit
def _split(x):
    """(hi, lo): x rounded to TF32 (ties away from zero) and the exact FP32 remainder, as ``_dot3``'s."""
    hi = ((x.to(gl.int32, bitcast=True) + 0x1000) & -8192).to(gl.float32, bitcast=True)
    return hi, x - hi


@gluon.jit
def _tile_ptr(QG, KGT, R, AI, AQK, slot, J: gl.constexpr, r, c, AIS: gl.constexpr):
    """[64, 64] pointers of tile J of a chunk, in the order of use: R[:, :64], R[:, 64:], qg[:, :64],
    A⁻¹, qg[:, 64:], Aqk, kgᵀ[:64], kgᵀ[64:]."""
    if J < 2:
        p = R + slot * (64 * 128) + r[:, None] * 128 + 64 * J + c[None, :]
    elif J == 2 or J == 4:
        p = QG + slot * (64 * 128) + r[:, None] * 128 + 32 * (J - 2) + c[None, :]
    elif J == 3:
        p = AI + slot * AIS + r[:, None] * 64 + c[None, :]
    elif J == 5:
        p = AQK + slot * 4096 + r[:, None] * 64 + c[None, :]
    else:
        p = KGT + slot * (128 * 64) + (64 * (J - 6) + r[:, None]) * 64 + c[None, :]
    return p


@gluon.jit
def _fetch(ring, QG, KGT, R, AI, AQK, slot0, t, i_h, n_chunks, J: gl.constexpr, r, c,
           H: gl.constexpr, AIS: gl.constexpr):
    """cp.async tile J of chunk t into ring slot J % 4 as one commit group (nothing past the
    document's last chunk)."""
    slot = (slot0 + gl.maximum(gl.minimum(t, n_chunks - 1), 0)).to(gl.int64) * H + i_h
    p = _tile_ptr(QG, KGT, R, AI, AQK, slot, J, r, c, AIS)
    async_copy.async_copy_global_to_shared(ring.index(J % _RING), p, mask=(r[:, None] >= 0) & (t < n_chunks))
    async_copy.commit_group()


@gluon.jit
def _arrive(ring, QG, KGT, R, AI, AQK, slot0, it, i_h, n_chunks, J: gl.constexpr, r, c,
            H: gl.constexpr, AIS: gl.constexpr):
    """Before tile J of chunk it is read: wait for its copy (two later groups may still be in flight),
    then, every warp being past tile J-1, refill J-1's slot with the tile three ahead of J."""
    async_copy.wait_group(2)
    gl.thread_barrier()
    _fetch(ring, QG, KGT, R, AI, AQK, slot0, it + (J + 3) // _TILES, i_h, n_chunks, (J + 3) % _TILES, r, c, H, AIS)


@gluon.jit
def _operand(ring, J: gl.constexpr, a_layout: gl.constexpr):
    """Tile J's TF32 halves as A operands in registers."""
    return _split(ring.index(J % _RING).load(a_layout))


@gluon.jit
def _mma3(a_hi, a_lo, b_hi, b_lo, mma: gl.constexpr):
    """Issue a·b as ``_dot3`` does (lo·hi, hi·lo, then hi·hi, from zero), asynchronously."""
    acc = gl.zeros([64, 64], dtype=gl.float32, layout=mma)
    acc = warpgroup_mma(a_lo, b_hi, acc, is_async=True)
    acc = warpgroup_mma(a_hi, b_lo, acc, is_async=True)
    return warpgroup_mma(a_hi, b_hi, acc, is_async=True)


@gluon.jit
def _done(acc, a_hi, a_lo):
    """Wait for the product in flight (its A registers stay untouched until then); its result."""
    acc, a_hi, a_lo = warpgroup_mma_wait(0, deps=[acc, a_hi, a_lo])
    return acc


@gluon.jit
def _stage(x, smem, i: gl.constexpr):
    """x's TF32 halves into B-operand slots i, i + 1."""
    hi, lo = _split(x)
    smem.index(i).store(hi)
    smem.index(i + 1).store(lo)


@gluon.jit
def _state_kernel_gluon(QG, KGT, R, AI, AQK, DEC, v, beta, o, h0, ht, cu, first_slot,
                        H: gl.constexpr, K: gl.constexpr, V: gl.constexpr, AIS: gl.constexpr, HAS_H0: gl.constexpr):
    WG: gl.constexpr = gl.num_warps() // 4
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, WG], instr_shape=[16, 64 // WG, 8])
    a_l: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=1)
    copy_l: gl.constexpr = gl.BlockedLayout([1, 4], [4, 8], [4 * WG, 1], [1, 0])
    i_v = gl.program_id(0)
    i_h = gl.program_id(1)
    i_n = gl.program_id(2)
    bos = gl.load(cu + i_n)
    length = gl.load(cu + i_n + 1) - bos
    slot0 = gl.load(first_slot + i_n)
    n_chunks = ((length + 63) // 64).to(gl.int32)
    r = gl.arange(0, 64, layout=gl.SliceLayout(1, copy_l))
    c = gl.arange(0, 64, layout=gl.SliceLayout(0, copy_l))
    rm = gl.arange(0, 64, layout=gl.SliceLayout(1, mma))  # rows of the MMA-layout tiles: tokens or K
    cv = i_v * 64 + gl.arange(0, 64, layout=gl.SliceLayout(0, mma))  # this program's V columns
    ring = gl.allocate_shared_memory(gl.float32, [_RING, 64, 64],
                                     gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=32, rank=2))
    b_sl: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=32, rank=2, transposed=True)
    hs = gl.allocate_shared_memory(gl.float32, [4, 64, 64], b_sl)  # h's hi, lo (K rows 0-63), hi, lo (64-127)
    xs = gl.allocate_shared_memory(gl.float32, [2, 64, 64], b_sl)  # βv − R·h's hi, lo
    vs = gl.allocate_shared_memory(gl.float32, [2, 64, 64], b_sl)  # v_new's hi, lo
    for J in gl.static_range(3):
        _fetch(ring, QG, KGT, R, AI, AQK, slot0, 0, i_h, n_chunks, J, r, c, H, AIS)
    off = ((i_n * H + i_h) * K + rm[:, None]).to(gl.int64) * V + cv[None, :]
    m_a = (rm[:, None] < K) & (cv < V)[None, :]
    m_b = (rm[:, None] + 64 < K) & (cv < V)[None, :]
    if HAS_H0:
        ha = gl.load(h0 + off, mask=m_a, other=0.0)
        hb = gl.load(h0 + off + 64 * V, mask=m_b, other=0.0)
    else:
        ha = gl.zeros([64, 64], dtype=gl.float32, layout=mma)
        hb = gl.zeros([64, 64], dtype=gl.float32, layout=mma)
    _stage(ha, hs, 0)
    _stage(hb, hs, 2)
    fence_async_shared()
    for it in range(n_chunks):
        slot = (slot0 + it).to(gl.int64) * H + i_h
        dec_a = gl.load(DEC + slot * 128 + rm)
        dec_b = gl.load(DEC + slot * 128 + 64 + rm)
        tok = bos + it * 64 + rm
        live = rm < length - it * 64
        m_o = live[:, None] & (cv < V)[None, :]
        vx = gl.load(v + tok[:, None] * (H * V) + i_h * V + cv[None, :], mask=m_o, other=0.0).to(gl.float32)
        b = gl.load(beta + tok * H + i_h, mask=live, other=0.0).to(gl.float32)
        # R·h (two K halves), then qg·h's first half while x = βv − R·h is staged
        _arrive(ring, QG, KGT, R, AI, AQK, slot0, it, i_h, n_chunks, 0, r, c, H, AIS)
        x_hi, x_lo = _operand(ring, 0, a_l)
        acc = _mma3(x_hi, x_lo, hs.index(0), hs.index(1), mma)
        _arrive(ring, QG, KGT, R, AI, AQK, slot0, it, i_h, n_chunks, 1, r, c, H, AIS)
        y_hi, y_lo = _operand(ring, 1, a_l)
        rh = _done(acc, x_hi, x_lo)
        acc = _mma3(y_hi, y_lo, hs.index(2), hs.index(3), mma)
        _arrive(ring, QG, KGT, R, AI, AQK, slot0, it, i_h, n_chunks, 2, r, c, H, AIS)
        x_hi, x_lo = _operand(ring, 2, a_l)
        rh += _done(acc, y_hi, y_lo)
        acc = _mma3(x_hi, x_lo, hs.index(0), hs.index(1), mma)
        _stage(gl.fma(vx, b[:, None], -rh), xs, 0)
        fence_async_shared()
        # v_new = A⁻¹·x, then qg·h's second half while v_new is staged
        _arrive(ring, QG, KGT, R, AI, AQK, slot0, it, i_h, n_chunks, 3, r, c, H, AIS)
        y_hi, y_lo = _operand(ring, 3, a_l)
        ov = _done(acc, x_hi, x_lo)
        acc = _mma3(y_hi, y_lo, xs.index(0), xs.index(1), mma)
        _arrive(ring, QG, KGT, R, AI, AQK, slot0, it, i_h, n_chunks, 4, r, c, H, AIS)
        x_hi, x_lo = _operand(ring, 4, a_l)
        vn = _done(acc, y_hi, y_lo)
        acc = _mma3(x_hi, x_lo, hs.index(2), hs.index(3), mma)
        _stage(vn, vs, 0)
        fence_async_shared()
        # Aqk·v_new, then kgᵀ·v_new for the next state
        _arrive(ring, QG, KGT, R, AI, AQK, slot0, it, i_h, n_chunks, 5, r, c, H, AIS)
        y_hi, y_lo = _operand(ring, 5, a_l)
        ov += _done(acc, x_hi, x_lo)
        acc = _mma3(y_hi, y_lo, vs.index(0), vs.index(1), mma)
        _arrive(ring, QG, KGT, R, AI, AQK, slot0, it, i_h, n_chunks, 6, r, c, H, AIS)
        x_hi, x_lo = _operand(ring, 6, a_l)
        ov += _done(acc, y_hi, y_lo)
        acc = _mma3(x_hi, x_lo, vs.index(0), vs.index(1), mma)
        gl.store(o + tok[:, None] * (H * V) + i_h * V + cv[None, :], ov.to(o.dtype.element_ty), mask=m_o)
        _arrive(ring, QG, KGT, R, AI, AQK, slot0, it, i_h, n_chunks, 7, r, c, H, AIS)
        y_hi, y_lo = _operand(ring, 7, a_l)
        ka = _done(acc, x_hi, x_lo)
        acc = _mma3(y_hi, y_lo, vs.index(0), vs.index(1), mma)
        # the state from its staged halves (hi + lo is exact): no registers held across the chunk
        ha = (hs.index(0).load(mma) + hs.index(1).load(mma)) * dec_a[:, None] + ka
        hb = (hs.index(2).load(mma) + hs.index(3).load(mma)) * dec_b[:, None] + _done(acc, y_hi, y_lo)
        _stage(ha, hs, 0)
        _stage(hb, hs, 2)
        fence_async_shared()
    async_copy.wait_group(0)
    gl.store(ht + off, ha, mask=m_a)
    gl.store(ht + off + 64 * V, hb, mask=m_b)


def state_pass_gluon(cp, o, initial_state, final) -> None:
    """o and the final state of an unsolved ``kda_fp32_triton.ChunkPass`` (see the module docstring;
    requires :func:`usable`)."""
    h0 = initial_state.contiguous() if initial_state is not None else final
    _state_kernel_gluon[(cp.BV // BVT, cp.H, cp.N)](
        cp.QG, cp.KGT, cp.W, cp.AI, cp.AQK, cp.DEC, cp.v, cp.beta, o, h0, final, cp.cu, cp.first_slot,
        H=cp.H, K=cp.K, V=cp.V, AIS=cp.AI.stride(1), HAS_H0=initial_state is not None, num_warps=WARPS)
