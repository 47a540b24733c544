"""The FP32 KDA forward's state pass in Gluon, for Hopper (sm_90): :func:`state_pass_gluon`.

The same computation as :func:`.state.state_kernel` without ``SPLIT``, bitwise (the same three TF32
products per tile, summed in the same order; the split of :func:`.primitives.split_tf32_gluon`): one
program per (64 V columns, head, document), sequential over the document's chunks, per chunk
``v_new = A⁻¹(βv − R·h)`` (R = β k̂ e^{gc}, w's right-hand side, which the chunk kernel stores in ``W``;
v and beta the op's inputs), ``o = qg·h + Aqk·v_new`` (stored in o's dtype) and
``h ← e^{gc_last}·h + kgᵀ·v_new``, the state ``h`` ``[128, 64]`` FP32 carried across the loop as its
TF32 halves in shared memory. In Gluon so that the products run asynchronously, overlapped with the
loads and splits of the next tiles, without spilling (Triton waits for every ``tl.dot`` of that loop
and spills; the profiles: ``docs/kda.md``). Per chunk, five products of three TF32 MMAs
each:

- tiles that multiply the same B operand are stacked into one [128, 64] A operand, one 64-row tile per
  warpgroup: ``[R; qg]`` over K 0-63 and over K 64-127 (times the state's two halves: R·h in the
  first warpgroup's rows, qg·h in the second's) and ``[kgᵀ over K 0-63; kgᵀ over K 64-127]`` times
  v_new (the next state, both halves); A⁻¹·x and Aqk·v_new are [64, 64] products with each warpgroup
  on 32 columns;
- the tiles go global -> shared memory by ``cp.async`` into a ring of three [128, 64] slots (the pair
  tiles in two slots alternating by chunk parity, A⁻¹ and Aqk in the third), each issued at least one
  product ahead of its use; the chunk's v rows and beta are loaded into registers at its start;
- the tiles' TF32 hi/lo halves are A operands in registers; the halves of the state, of x = βv − R·h
  (with −qg·h below it, for o) and of v_new, the B operands, are staged in shared memory once per
  chunk (K-major, as TF32 wgmma reads them);
- each product runs asynchronously while the next tile is loaded and split; Aqk·v_new is issued before
  kgᵀ·v_new is waited for.

Only this geometry: K in 65..128 (the chunk kernel's BK = 128), 64 V columns per program, no
``split_output``; :func:`usable` says when, and :func:`.forward.state_pass` takes the Triton kernel
otherwise. Shared memory 224 KB, 8 warps, 255 registers, no spills (static sm_90 compile).
"""

from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, warpgroup_mma, warpgroup_mma_wait

from inductor_ext.kernels.kda_fp32.primitives import split_tf32_gluon

__all__ = ["state_pass_gluon", "usable", "BK", "BVT", "WARPS"]

# the geometry, written into the kernel as its literals 128 and 64
BK = 128  # the chunk kernel's padded K: the state as two 64-row halves
BVT = 64  # V columns per program
WARPS = 8  # two warpgroups (the layouts P and S of the kernel assume them)


def usable(device: torch.device, bk: int, bvt: int, split_output: bool) -> bool:
    """Whether this kernel computes the state pass of a ChunkPass with padded K ``bk`` and ``bvt`` V
    columns per program on ``device``: a Hopper GPU (wgmma, cp.async), BK = 128, 64 columns, o wanted."""
    return (bk == BK and bvt == BVT and not split_output and device.type == "cuda"
            and torch.cuda.get_device_capability(device) == (9, 0))


@gluon.jit
def _fetch_pair(dst, TOP, BOT, t, n_chunks, r2, c, RS: gl.constexpr):
    """cp.async a [128, 64] tile of chunk t into dst, rows 0-63 from TOP and 64-127 from BOT (rows RS
    floats apart; nothing past the document's last chunk), as one commit group."""
    p = gl.where(r2 < 64, TOP + r2 * RS, BOT + (r2 - 64) * RS)[:, None] + c[None, :]
    async_copy.async_copy_global_to_shared(dst, p, mask=(r2 >= 0)[:, None] & (t < n_chunks))
    async_copy.commit_group()


@gluon.jit
def _fetch_tile(dst, X, t, n_chunks, off):
    """cp.async the [64, 64] tile X + off of chunk t into dst (nothing past the document's last chunk),
    as one commit group."""
    async_copy.async_copy_global_to_shared(dst, X + off, mask=(off >= 0) & (t < n_chunks))
    async_copy.commit_group()


@gluon.jit
def _mma3(a, b_hi, b_lo, mma: gl.constexpr):
    """Issue a·b as ``dot3`` does (lo·hi, hi·lo, then hi·hi, from zero), asynchronously; a = (hi, lo)
    in registers. Three wgmma groups."""
    acc = gl.zeros(a[0].shape, dtype=gl.float32, layout=mma)
    acc = warpgroup_mma(a[1], b_hi, acc, is_async=True)
    acc = warpgroup_mma(a[0], b_lo, acc, is_async=True)
    return warpgroup_mma(a[0], b_hi, acc, is_async=True)


@gluon.jit
def _done(acc, a, pending: gl.constexpr = 0):
    """Wait for the product (issued with A operand a, whose registers stay untouched until then) while
    ``pending`` later wgmma groups may still run; its result."""
    acc, a_hi, a_lo = warpgroup_mma_wait(pending, deps=[acc, a[0], a[1]])
    return acc


@gluon.jit
def _b_buffers(layout: gl.constexpr):
    """A [128, 64] FP32 B operand's hi and lo buffers, each its own allocation (so that the compiler's
    shared-memory hazard analysis sees them apart) with a leading dimension of 1 for :func:`_rows`."""
    return (gl.allocate_shared_memory(gl.float32, [1, 128, 64], layout),
            gl.allocate_shared_memory(gl.float32, [1, 128, 64], layout))


@gluon.jit
def _stage(x, smem, z=0):
    """x's TF32 halves into B-operand buffers (hi, lo), fenced for wgmma."""
    hi, lo = split_tf32_gluon(x)
    smem[0].index(z).store(hi)
    smem[1].index(z).store(lo)
    fence_async_shared()


@gluon.jit
def _unstage(smem, layout: gl.constexpr, z=0):
    """The value staged by :func:`_stage` (hi + lo is exact), in ``layout``."""
    return smem[0].index(z).load(layout) + smem[1].index(z).load(layout)


@gluon.jit
def _rows(smem, start: gl.constexpr, z):
    """Rows start..start+63 (the K dimension) of B-operand buffers (hi, lo). ``z`` is always 0 but
    opaque to the compiler: the wgmma descriptors of these views are then computed where they are used
    instead of being hoisted out of the chunk loop, where their 64-bit values would take registers
    that ptxas then spills."""
    return smem[0].index(z).slice(start, 64, 0), smem[1].index(z).slice(start, 64, 0)


@gluon.jit
def _state_offsets(i_n, i_h, rk, cv, H: gl.constexpr, K: gl.constexpr, V: gl.constexpr):
    """Offsets of the [128, 64] state tile (K rows rk, V columns cv) of document i_n, head i_h."""
    return ((i_n * H + i_h) * K + rk[:, None]).to(gl.int64) * V + cv[None, :]


@gluon.jit
def _state_mask(rk, cv, K: gl.constexpr, V: gl.constexpr):
    """Which elements of that tile lie inside the [K, V] state."""
    return (rk[:, None] < K) & (cv < V)[None, :]


@gluon.jit
def _state_kernel_gluon(QG, KGT, R, AI, AQK, DEC, v, beta, o, h0, ht, cu, first_slot,
                        H: gl.constexpr, K: gl.constexpr, V: gl.constexpr, AIS: gl.constexpr, HAS_H0: gl.constexpr):
    # layouts: P for [128, 64] products of two stacked tiles sharing one B operand, each warpgroup
    # computing one tile's 64 rows; S for [64, 64] products, each warpgroup 32 of the columns
    P: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[8, 1], instr_shape=[16, 64, 8])
    S: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2], instr_shape=[16, 32, 8])
    a_p: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=P, k_width=1)
    a_s: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=S, k_width=1)
    copy_l: gl.constexpr = gl.BlockedLayout([1, 4], [4, 8], [8, 1], [1, 0])
    b_sl: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=32, rank=2, transposed=True)
    i_v = gl.program_id(0)
    i_h = gl.program_id(1)
    i_n = gl.program_id(2)
    bos = gl.load(cu + i_n)
    length = gl.load(cu + i_n + 1) - bos
    slot0 = gl.load(first_slot + i_n)
    n_chunks = ((length + 63) // 64).to(gl.int32)
    r = gl.arange(0, 64, layout=gl.SliceLayout(1, copy_l))
    r2 = gl.arange(0, 128, layout=gl.SliceLayout(1, copy_l))
    c = gl.arange(0, 64, layout=gl.SliceLayout(0, copy_l))
    o64 = r[:, None] * 64 + c[None, :]  # a [64, 64] tile's offsets
    rp = gl.arange(0, 128, layout=gl.SliceLayout(1, P))  # rows of P tiles: K, or tokens (first half)
    cp = i_v * 64 + gl.arange(0, 64, layout=gl.SliceLayout(0, P))  # this program's V columns
    rs = gl.arange(0, 64, layout=gl.SliceLayout(1, S))
    cs = i_v * 64 + gl.arange(0, 64, layout=gl.SliceLayout(0, S))
    # the ring: slots 0 and 1 alternate by chunk parity ("even" holds [R; qg] over K 0-63, then kgᵀ;
    # "odd" [R; qg] over K 64-127, then the next chunk's first tile); slot 2 holds A⁻¹ and Aqk
    ring = gl.allocate_shared_memory(gl.float32, [3, 128, 64],
                                     gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=32, rank=2))
    a_inv = ring.index(2).slice(0, 64, 0)
    a_qk = ring.index(2).slice(64, 64, 0)
    hs = _b_buffers(b_sl)  # the state h [K, V]
    xs = _b_buffers(b_sl)  # rows 0-63: x = βv − R·h; 64-127: −qg·h, then v_new
    # prologue: what the previous chunk's last three copies would have been
    s = slot0.to(gl.int64) * H + i_h
    _fetch_pair(ring.index(0), R + s * 8192, QG + s * 8192, 0, n_chunks, r2, c, 128)
    _fetch_tile(a_inv, AI + s * AIS, 0, n_chunks, o64)
    _fetch_pair(ring.index(1), R + s * 8192 + 64, QG + s * 8192 + 64, 0, n_chunks, r2, c, 128)
    if HAS_H0:
        h = gl.load(h0 + _state_offsets(i_n, i_h, rp, cp, H, K, V), mask=_state_mask(rp, cp, K, V), other=0.0)
    else:
        h = gl.zeros([128, 64], dtype=gl.float32, layout=P)
    _stage(h, hs)
    for it in range(n_chunks):
        slot = (slot0 + it).to(gl.int64) * H + i_h
        nxt = (slot0 + gl.minimum(it + 1, n_chunks - 1)).to(gl.int64) * H + i_h
        z = gl.inline_asm_elementwise("mov.b32 $0, 0;", "=r,r", [it], dtype=gl.int32, is_pure=True, pack=1)
        even = ring.index(it % 2)
        odd = ring.index(1 - it % 2)
        dec = gl.load(DEC + slot * 128 + rp)
        live = rp < gl.minimum(length - it * 64, 64)  # x's rows: the chunk's tokens
        tok = bos + it * 64 + rp
        vx = gl.load(v + tok[:, None] * (H * V) + i_h * V + cp[None, :], mask=live[:, None] & (cp < V)[None, :],
                     other=0.0).to(gl.float32)
        b = gl.load(beta + tok * H + i_h, mask=live, other=0.0).to(gl.float32)
        # [R; qg]·h over K 0-63, then 64-127: R·h in rows 0-63, qg·h in 64-127
        async_copy.wait_group(2)
        gl.thread_barrier()
        _fetch_tile(a_qk, AQK + slot * 4096, it, n_chunks, o64)
        a = split_tf32_gluon(even.load(a_p))
        hh, hl = _rows(hs, 0, z)
        acc = _mma3(a, hh, hl, P)
        async_copy.wait_group(1)
        gl.thread_barrier()
        _fetch_pair(even, KGT + slot * 8192, KGT + slot * 8192 + 4096, it, n_chunks, r2, c, 64)
        a2 = split_tf32_gluon(odd.load(a_p))
        y = _done(acc, a)
        hh, hl = _rows(hs, 64, z)
        acc = _mma3(a2, hh, hl, P)
        a = split_tf32_gluon(a_inv.load(a_s))
        y += _done(acc, a2)
        # x = βv − R·h; rows 64-127 get −qg·h exactly (v and beta are masked to zero there)
        _stage(gl.fma(vx, b[:, None], -y), xs, z)
        gl.thread_barrier()
        _fetch_pair(odd, R + nxt * 8192, QG + nxt * 8192, it + 1, n_chunks, r2, c, 128)
        xh, xl = _rows(xs, 0, z)
        acc_s = _mma3(a, xh, xl, S)  # v_new = A⁻¹·x
        async_copy.wait_group(1)
        gl.thread_barrier()
        _fetch_tile(a_inv, AI + nxt * AIS, it + 1, n_chunks, o64)
        a2 = split_tf32_gluon(even.load(a_p))  # kgᵀ
        vn = _done(acc_s, a)
        # −qg·h out of rows 64-127 of x's buffers, v_new into them (each thread its own elements)
        xh, xl = _rows(xs, 64, z)
        qh = xh.load(S) + xl.load(S)
        vn_hi, vn_lo = split_tf32_gluon(vn)
        xh.store(vn_hi)
        xl.store(vn_lo)
        fence_async_shared()
        gl.thread_barrier()
        _fetch_pair(even, R + nxt * 8192 + 64, QG + nxt * 8192 + 64, it + 1, n_chunks, r2, c, 128)
        acc = _mma3(a2, xh, xl, P)  # kgᵀ·v_new
        a = split_tf32_gluon(a_qk.load(a_s))
        acc_s = _mma3(a, xh, xl, S)  # Aqk·v_new, issued before kgᵀ·v_new is waited for
        kv = _done(acc, a2, 3)
        h = _unstage(hs, P, z) * dec[:, None] + kv
        _stage(h, hs, z)
        ov = _done(acc_s, a) - qh
        tok_s = bos + it * 64 + rs
        m_o = (rs < length - it * 64)[:, None] & (cs < V)[None, :]
        gl.store(o + tok_s[:, None] * (H * V) + i_h * V + cs[None, :], ov.to(o.dtype.element_ty), mask=m_o)
    async_copy.wait_group(0)
    # the final state from its staged halves: no state is carried in registers
    h = _unstage(hs, P)
    gl.store(ht + _state_offsets(i_n, i_h, rp, cp, H, K, V), h, mask=_state_mask(rp, cp, K, V))


def state_pass_gluon(cp, o, initial_state, final) -> None:
    """o and the final state of an unsolved :class:`.forward.ChunkPass` (see the module docstring;
    requires :func:`usable`)."""
    h0 = initial_state.contiguous() if initial_state is not None else final
    _state_kernel_gluon[(cp.BV // BVT, cp.H, cp.N)](
        cp.QG, cp.KGT, cp.W, cp.AI, cp.AQK, cp.DEC, cp.v, cp.beta, o, h0, final, cp.cu, cp.first_slot,
        H=cp.H, K=cp.K, V=cp.V, AIS=cp.AI.stride(1), HAS_H0=initial_state is not None, num_warps=WARPS)
