"""FP32-accurate KDA chunk forward: :func:`kda_fp32_fwd`, the forward of ``glm53::kda_chunk(...,
precision="fp32")`` on CUDA for K, V ≤ 128 (op glue: :mod:`inductor_ext.kernels.kda_fp32`; backward:
:mod:`.backward`), and the host side that the backward shares (:func:`chunk_pass`, :func:`state_pass`).

Semantics (``docs/DESIGN.md`` §4, :mod:`inductor_ext.ops.kda_reference`): q and k are L2-normalised
in FP32 (``x / sqrt(Σx² + 1e-6)``), g is the per-key natural-log decay (≤ 0) accumulated inside 64-token
chunks that restart at every document start, beta per (token, head), o in v's dtype, final state FP32
``[N,H,K,V]``. K, V ≤ 128.

Two kernels, or three with ``split_output`` and in the backward, no host synchronisation (the chunk
list of :mod:`.chunk_list` has a static length and is filled on the device):

1. the chunk kernel (:mod:`.chunk`), one program per (chunk slot, head), in two launches (the second
   only for the chunks whose whole-chunk factors the first found beyond ``chunk.SPAN``; one launch of
   its row-causal path with ``causal``): qg, kgᵀ, w's
   right-hand side β k̂ e^{gc}, Aqk, A⁻¹ (with ``keep_a`` also the k̂–k̂ products), e^{gc_last} and the
   rows' inverse norms, chunk-major FP32;
2. with ``split_output`` (and in the backward) the solve kernel (:mod:`.solve`): w and u;
3. the state pass, one program per (V block, head, document), sequential over the document's chunks
   with the state in registers. Fused (the default): it solves ``v_new = A⁻¹(βv − R·h)`` itself and
   stores o; on Hopper, for K in 65..128 with 64 V columns per program, that is the Gluon kernel of
   :mod:`.gluon_state` (the same results, bitwise), else the Triton kernel of :mod:`.state`. With
   ``split_output`` the Triton state pass stores every chunk's entering state and v_new = u − w·h, and
   the output kernel (:mod:`.output`) computes o from them, fully parallel.

Precision: every dot is :func:`.primitives.dot3` or :func:`.primitives.dot3t` (three TF32 MMAs on
hi/lo-split operands: FP32-grade products); the 16×16 diagonal sweep of the inverse is elementwise
FP32 and the gate's chunk cumsum FP64. Bounds, relative L2 against the FP64 token recurrence: o and
the final state 1e-5 for FP32 inputs, 1e-4 for BF16 inputs against the FP64 result rounded to BF16.
"""

from __future__ import annotations

import dataclasses

import torch

from inductor_ext.kernels.kda_fp32 import chunk, gluon_state, output, state
from inductor_ext.kernels.kda_fp32 import solve as solve_module  # (chunk_pass's ``solve`` flag shadows the name)
from inductor_ext.kernels.kda_fp32.chunk_list import chunk_list, pow2
from inductor_ext.ops.kda_reference import CHUNK, FP32_KERNEL_MAX_DIM, L2_EPS, chunk_count, chunk_slots

__all__ = ["kda_fp32_fwd", "CAUSAL_LAUNCH", "ChunkPass", "chunk_pass", "state_pass", "contiguous_inputs",
           "check_inputs", "check_blocks", "MAX_DIM"]

MAX_DIM = FP32_KERNEL_MAX_DIM  # head dims K, V
# launch options (the H200 measurements behind them: docs/kda.md):
# the split state pass (the backward's) keeps the loads of 2 chunks in flight (cp.async into shared memory:
# 196 KB at K = 128, block_v 64; 3 stages would need 278 KB, more than an SM has)
STATE_STAGES = 2
# the forward's fused state pass (v_new solved in the loop: A⁻¹ and v loaded as well) is not pipelined: at 2
# stages it needs 246 KB of shared memory at K = 128, block_v 64 (sm_90 static compile), more than an SM has;
# 98 KB at 1. On Hopper that geometry runs the Gluon kernel instead
FUSED_STATE_STAGES = 1
# the chunk kernel's loops are not software-pipelined
CHUNK_STAGES = 1
# columns of w and u per solve-kernel program
SOLVE_COLUMNS = 64
# the launch of the row-causal path (four [64, 64] dots per product and K-slice): at 32-column slices
# and 168 registers it spills ~4 KB per thread (offline sm_90a compile, K = 128), at 16-column slices
# and ptxas' own register count 0.2 KB
CAUSAL_LAUNCH = dict(block_k=16, chunk_maxnreg=None)


def check_inputs(q, k, v, g, beta, initial_state, cu_seqlens):
    """Raise ValueError unless the inputs have the shapes and dtypes of :func:`kda_fp32_fwd`."""
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
    load it (exact), so BF16 inputs cost no FP32 copies."""
    return tuple(x.contiguous() for x in xs)


def check_blocks(name: str, block_k: int, block_v: int, **maxnregs: int | None) -> None:
    """Block sizes 16, 32 or 64; each named register cap None or 32..255."""
    for arg, blk in (("block_k", block_k), ("block_v", block_v)):
        if blk not in (16, 32, 64):
            raise ValueError(f"{name}: {arg} must be 16, 32 or 64, got {blk}")
    for arg, cap in maxnregs.items():
        if cap is not None and not 32 <= cap <= 255:
            raise ValueError(f"{name}: {arg} must be None or 32..255 registers, got {cap}")


def chunk_pass(q, k, v, g, beta, scale, cu_seqlens, *, block_k: int, block_v: int, warps: int,
               chunk_maxnreg: int | None, keep_a: bool = False, given_a: tuple | None = None,
               solve: bool = True, causal: bool = False) -> ChunkPass:
    """Launch the chunk kernel (twice) and, with ``solve``, the solve kernel on contiguous, checked
    inputs (see :func:`kda_fp32_fwd`). ``keep_a``: keep the k̂–k̂ products in ``AI`` beside A⁻¹;
    ``given_a``: (Aqk, AI) of an earlier call on the same inputs, which the chunk kernel then does not
    recompute. Without ``solve`` (the forward's state pass, which solves v_new itself) W keeps w's
    right-hand side and U is empty. ``causal``: one launch of the chunk kernel's row-causal path
    (``chunk.CAUSAL``), so each row's arithmetic reads that row and the earlier rows of its chunk
    only, never a later reference row or a whole-chunk check."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    dev = q.device
    BK, BV = pow2(K), pow2(V)
    if cu_seqlens is None:
        N = B
        cu = torch.arange(B + 1, device=dev, dtype=torch.int64) * T
    else:
        N = cu_seqlens.numel() - 1
        cu = cu_seqlens.contiguous()
    n_slots = chunk_count(q, cu_seqlens)
    S = chunk_slots(q, cu_seqlens)  # the scratch's and the residuals' first dim
    chunk_map, first_slot = chunk_list(cu, S)
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
        flag = torch.empty(0 if load_a or causal else S, H, device=dev, dtype=torch.int32)
        for blocks in (False,) if load_a or causal else (False, True):
            chunk.chunk_kernel[(n_slots, H)](
                q, k, g, beta, chunk_map, cu, cp.QG, cp.KGT, cp.W, cp.AQK, cp.DEC, ai, cp.NRM,
                flag if flag.numel() else aqk, float(scale), H=H, K=K, BK=BK, BKB=cp.BKB, EPS=L2_EPS, SPAN=chunk.SPAN,
                STORE_A=keep_a and not load_a, LOAD_A=load_a, BLOCKS=blocks, CAUSAL=causal and not load_a,
                num_warps=warps,
                num_stages=CHUNK_STAGES, maxnreg=chunk_maxnreg)  # (FLAG is not touched unless used)
        if solve:
            BC = min(SOLVE_COLUMNS, BK, BV)
            solve_module.solve_kernel[(n_slots * ((BK + BV) // BC), H)](
                v, beta, chunk_map, cu, cp.W, cp.U, ai, H=H, V=V, BK=BK, BV=BV, BC=BC, AIS=ai.stride(1),
                num_warps=warps)
    return cp


def state_pass(cp: ChunkPass, o, initial_state, final, *, warps: int, split_output: bool, HS=None, VN=None):
    """Launch the state pass: o and the final state (``cp`` not solved: v_new = A⁻¹(βv − R·h) per
    chunk), or (``split_output``, o None, ``cp`` solved) the final state, the state entering every chunk
    into HS and v_new = u − w·h into VN. On Hopper, for K in 65..128 with 64 V columns per program and o
    wanted, the Gluon kernel of :mod:`.gluon_state` (the same results, bitwise); ``warps`` is the Triton
    kernel's."""
    if cp.N == 0 or cp.H == 0:
        return
    if split_output != cp.solved:
        raise ValueError("kda_fp32 state_pass: split_output needs a solved ChunkPass (w, u), o an unsolved one")
    if gluon_state.usable(final.device, cp.BK, cp.BVT, split_output):
        gluon_state.state_pass_gluon(cp, o, initial_state, final)
    else:
        h0 = initial_state.contiguous() if initial_state is not None else final
        state.state_kernel[(cp.BV // cp.BVT, cp.H, cp.N)](
            cp.QG, cp.KGT, cp.W, cp.U, cp.AQK, cp.DEC, cp.AI, cp.v, cp.beta, final if o is None else o, h0, final,
            cp.cu, cp.first_slot, final if HS is None else HS, final if VN is None else VN,
            H=cp.H, K=cp.K, V=cp.V, BK=cp.BK, BV=cp.BV, BVT=cp.BVT, AIS=cp.AI.stride(1),
            HAS_H0=initial_state is not None, SPLIT=split_output, num_warps=warps,
            num_stages=STATE_STAGES if split_output else FUSED_STATE_STAGES)


def kda_fp32_fwd(q, k, v, g, beta, scale, initial_state=None, cu_seqlens=None, *,
                 block_k: int = 32, block_v: int = 64, warps: tuple[int, int] = (4, 4),
                 chunk_maxnreg: int | None = 168, split_output: bool = False, keep_a: bool = False,
                 causal: bool = False):
    """KDA chunk forward with FP32-grade arithmetic (see the module docstring).

    q, k ``[B,T,H,K]`` and v ``[B,T,H,V]`` FP32 or BF16 (read as they are, converted to FP32 on load),
    g ``[B,T,H,K]`` FP32, beta ``[B,T,H]``,
    optional FP32 initial_state ``[N,H,K,V]``, optional int64 cu_seqlens ``[N+1]`` (then B = 1).
    Returns (o in v's dtype ``[B,T,H,V]``, final state FP32 ``[N,H,K,V]``). Tuning knobs, not
    semantics: ``block_k`` (K and V columns per step of the chunk kernel's loops), ``block_v`` (V
    columns per state-pass program) and ``warps`` (chunk and solve kernels, Triton state kernel; the Gluon
    state pass of :mod:`.gluon_state`, taken on Hopper for block_v 64 and K > 64, runs 8). Keep the
    chunk kernel at 4 warps: at 8 it faulted with an illegal memory access on the H200 (triton 3.6;
    ``docs/kda.md``).
    ``chunk_maxnreg`` caps the chunk kernel's registers per thread (None: ptxas' choice); 168 is the
    fastest cap measured on the H200.
    ``split_output``: the solve kernel computes w and u, the state pass only carries the state
    (``v_new = u − w·h``, then ``kgᵀ·v_new``) and stores each chunk's entering state and v_new (FP32,
    1.6 GB at T=16384, H=64, K=V=128); a parallel third kernel computes o from them.
    ``keep_a``: also return (Aqk ``[S,H,64,64]``, AI ``[S,H,2,64,64]``: A⁻¹ and the k̂–k̂ products),
    chunk-major FP32 with S = ``inductor_ext.ops.kda_reference.chunk_slots``, for
    ``kda_fp32_bwd(..., given_a=...)``.
    ``causal``: the chunk kernel's row-causal path (see :func:`chunk_pass`): a partial chunk's rows,
    zero-padded to 64, are bitwise the same rows of the full chunk (the batch-invariant decode
    replays partial chunks). For decays (g ≤ 0, the op's contract). The op launches it with
    :data:`CAUSAL_LAUNCH`."""
    check_inputs(q, k, v, g, beta, initial_state, cu_seqlens)
    check_blocks("kda_fp32_fwd", block_k, block_v, chunk_maxnreg=chunk_maxnreg)
    o = torch.empty(v.shape, device=v.device, dtype=v.dtype)  # stored in v's dtype by the state kernel
    q, k, v, g, beta = contiguous_inputs(q, k, v, g, beta)
    cp = chunk_pass(q, k, v, g, beta, scale, cu_seqlens, block_k=block_k, block_v=block_v, warps=warps[0],
                    chunk_maxnreg=chunk_maxnreg, keep_a=keep_a, solve=split_output, causal=causal)
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
        output.output_kernel[(cp.n_slots, cp.H, cp.BV // cp.BVT)](
            cp.QG, cp.AQK, HS, VN, o, cp.chunk_map, cp.cu, H=cp.H, K=cp.K, V=cp.V, BK=cp.BK, BV=cp.BV,
            BVT=cp.BVT, num_warps=warps[1])
    return (o, final, *kept)
