"""FP32-accurate KDA chunk backward: :func:`kda_fp32_bwd`, the VJP of :func:`.forward.kda_fp32_fwd`.

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

1. the forward's chunk kernel (:mod:`.chunk`, two launches) and solve kernel (:mod:`.solve`), which also
   store A⁻¹, the k̂–k̂ products and the rows' inverse norms, or, given A⁻¹ and Aqk from the forward
   (``given_a``), only recompute qg, kgᵀ, w, u (the chunk kernel then in one launch);
2. the forward's Triton state kernel (:mod:`.state`) with ``SPLIT``: the state entering every chunk and
   v_new;
3. :func:`.backward_state.state_bwd_kernel`, one program per (V block, head, document), backwards over
   chunks with dh in registers: stores dv_new and the dh' of every chunk, and dh0;
4. :func:`.backward_chunk.chunk_bwd_wy_kernel`, one program per (chunk, head): dv, the decay products'
   cotangents, d(β k̂ e^{gc}) and dβ's share from u and A;
5. :func:`.backward_chunk.chunk_bwd_kernel`, one program per (chunk, head, K-slice): d q̂, d k̂, d gc into
   scratch with the decay products' whole-chunk path, flagging a slice whose span check fails; the
   slice's row sums (dβ's share, q̂·d q̂, k̂·d k̂);
6. :func:`.backward_chunk.chunk_bwd_blocks_kernel`, the same grid, idle but for flagged slices: their
   decay products' backward by 16-column blocks (or exact), added into d q̂, d k̂, d gc and the row sums;
7. :func:`.backward_chunk.chunk_bwd_finish_kernel`, one program per (chunk, head), one pass: dg (reverse
   cumsum), dq and dk (through the L2 norms), dβ.

Every dot is :func:`.primitives.dot3` (three TF32 MMAs on split operands). Scratch at T = 16384, H = 64,
K = V = 128: about 9 GB of FP32 intermediates. Bound: every gradient within 1e-4 relative L2 of the FP64
VJP (FP32 inputs). H200 times and the versions tried: ``docs/kda.md``.
"""

from __future__ import annotations

import torch

from inductor_ext.kernels.kda_fp32 import chunk
from inductor_ext.kernels.kda_fp32.backward_chunk import (
    chunk_bwd_blocks_kernel,
    chunk_bwd_finish_kernel,
    chunk_bwd_kernel,
    chunk_bwd_wy_kernel,
)
from inductor_ext.kernels.kda_fp32.backward_state import state_bwd_kernel
from inductor_ext.kernels.kda_fp32.forward import check_blocks, check_inputs, chunk_pass, contiguous_inputs, state_pass

__all__ = ["kda_fp32_bwd"]

# software-pipelining depths, the fastest measured on the H200 (docs/kda.md): the state pass
# backwards is not pipelined (its loop carries five dots and 196 KB of staged loads), nor is the WY
# backward's loop; the per-slice chunk-gradient kernel's is, 3 deep (its V loop's loads of HS, dh', do and
# v_new in flight)
STATE_BWD_STAGES = 1
CHUNK_BWD_WY_STAGES = 1
CHUNK_BWD_STAGES = 3


def kda_fp32_bwd(q, k, v, g, beta, scale, initial_state, cu_seqlens, do, dht=None, *,
                 block_k: int = 32, block_v: int = 32, warps: tuple[int, int, int, int] = (4, 4, 4, 4),
                 chunk_maxnreg: int | None = 168, chunk_bwd_maxnreg: int | None = None,
                 chunk_bwd_wy_maxnreg: int | None = 168, given_a: tuple | None = None):
    """Gradients (dq, dk, dv, dg, dbeta, dh0) of ``kda_fp32_fwd(q, k, v, g, beta, scale,
    initial_state, cu_seqlens)`` for the cotangents ``do`` (o's shape, any float dtype) and
    ``dht`` (FP32 ``[N,H,K,V]`` or None: zero). Each gradient in its input's dtype, dh0 FP32 (zeros'
    gradient when there is no initial state). Inputs as for ``kda_fp32_fwd``; ``warps`` per kernel
    (chunk, state, state backward, the two chunk-gradient kernels), ``chunk_bwd_maxnreg`` the register
    cap of the per-slice chunk-gradient kernel, ``chunk_bwd_wy_maxnreg`` the WY backward's (168: on BF16
    v, beta, do or dv ptxas would take it to 174-210 registers on sm_90, one program per SM fewer), the
    other knobs as there. ``block_v`` 32 by default (faster than 64 for both state passes on the H200).
    ``given_a``: the (Aqk, AI) that ``kda_fp32_fwd(..., keep_a=True)`` returned for these inputs;
    the chunk kernel then skips the decay products and the inverse."""
    check_inputs(q, k, v, g, beta, initial_state, cu_seqlens)
    check_blocks("kda_fp32_bwd", block_k, block_v, chunk_maxnreg=chunk_maxnreg,
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
        state_bwd_kernel[(BV // cp.BVT, H, N)](
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
        chunk_bwd_wy_kernel[(cp.n_slots, H)](
            v, beta, do, cp.chunk_map, cp.cu, cp.W, cp.U, cp.AI, HS, VN, DVN, DP, DBW, DB0, dv, float(scale),
            V=V, BV=BV, BVB=cp.BVB, **geometry, num_warps=warps[3], num_stages=CHUNK_BWD_WY_STAGES,
            maxnreg=chunk_bwd_wy_maxnreg)
        chunk_bwd_kernel[(cp.n_slots, H, NKB)](
            q, k, g, beta, do, cp.chunk_map, cp.cu, HS, DHS, VN, cp.NRM, DP, DBW, DQK, DGC, SUMS, FLAG,
            float(scale), K=K, V=V, BV=BV, BVB=cp.BVB, SPAN=chunk.SPAN, **geometry,
            num_warps=warps[3], num_stages=CHUNK_BWD_STAGES, maxnreg=chunk_bwd_maxnreg)
        chunk_bwd_blocks_kernel[(cp.n_slots, H, NKB)](
            q, k, g, cp.chunk_map, cp.cu, cp.NRM, DP, DQK, DGC, SUMS, FLAG, K=K, SPAN=chunk.SPAN, **geometry,
            num_warps=4)
        chunk_bwd_finish_kernel[(cp.n_slots, H)](
            q, k, cp.chunk_map, cp.cu, cp.NRM, DQK, DGC, DB0, SUMS, dq, dk, dg, dbeta, K=K, **geometry, num_warps=4)
    return dq, dk, dv, dg, dbeta, dh0
