"""TileLang backward of ``glm53::sparse_mla`` for Hopper (sm_90a): ``dq`` and ``dkv`` in one launch,
warp-specialised, one CTA per (query row, group of 64 heads).

Imports torch only; tilelang (the ``tilelang`` extra, 0.1.15) is imported when a kernel is first
built. Supported: :func:`supports` (the forward's geometries: sm_90, ``H`` a multiple of 64,
``D = d_v`` of 256 or 512, BF16, int32 / int64 ids).

The row's query and output gradient (``[64, D]`` each) stay in shared memory. Each block of
``BLOCK`` listed ids is gathered once (``cp.async``, one buffer) and serves the five products of
the block, computed with the ids as the MMA's M dimension (``sᵀ``, ``dpᵀ``: M = ids, N = heads):

- consumer 0: ``sᵀ = k · qᵀ``, ``pᵀ = exp2(sᵀ · scale · log2 e − lse · log2 e)`` (0 at padding),
  written to shared memory in FP32 and BF16;
- consumer 1: ``dpᵀ = k · dOᵀ``, then ``dsᵀ = pᵀ · (dpᵀ − delta) · scale`` (FP32 ``p``), written in BF16;
- both: ``dq[:, half] += ds · k[:, half]`` (FP32 registers, fixed block order; consumer 0 the left
  half of the columns, consumer 1 the right), then the block's gather buffer is released, then
  ``dk[:, half] = dsᵀ · q[:, half] + pᵀ · dO[:, half]`` in 128-column pieces, each added into the
  ``[S, D]`` accumulator at the listed rows.

``delta = Σ dO · out − dlse`` ``[T, H]`` FP32 is an input (computed beforehand).

The accumulator is ``int64`` fixed point (``fx``: two FP32 factors whose product is ``2^F``, from
the bound of the Triton backward's :func:`~.backward.fixed_point_scale`: every partial sum of an
element stays below 2^60), each contribution rounded to the nearest integer (ties to even) and
added by an integer atomic: integer addition is associative, so the sum is bitwise the same in
any order. With ``float32`` accumulation (``deterministic=False``) the contributions are added by
FP32 atomics (order-dependent rounding).

Rows of ids are handled as in the forward: the id row's first and last valid position bound the
visited blocks, a padding id loads row 0, its scores are masked through a per-block bias and it
adds nothing. No host synchronisation.

No ``from __future__ import annotations`` here: TileLang evaluates the kernel's parameter annotations.
"""

import functools
import types

import torch

__all__ = ["supports", "sparse_mla_bwd_tilelang", "HEADS_PER_CTA", "BLOCK"]

HEADS_PER_CTA = 64
BLOCK = 64
PIECE = 128  # columns per shared buffer and per dk piece
_TARGET = {"kind": "cuda", "arch": "sm_90a"}


def supports(q: torch.Tensor, kv: torch.Tensor, token_ids: torch.Tensor, d_v: int,
             capability: tuple[int, int]) -> bool:
    """Whether this kernel runs the geometry on a device of compute ``capability``."""
    H, D = q.shape[1], q.shape[2]
    return (tuple(capability) == (9, 0) and q.dtype == kv.dtype == torch.bfloat16 and H % HEADS_PER_CTA == 0
            and d_v == D and D in (256, 512) and token_ids.dtype in (torch.int32, torch.int64))


@functools.cache
def _kernel(H: int, D: int, scale: float, ids_dtype: str, acc_dtype: str):
    import tilelang
    import tilelang.language as T

    HB, BI, DP = HEADS_PER_CTA, BLOCK, PIECE
    NP = D // DP
    HALF = NP // 2
    pieces, halves = tuple(range(NP)), tuple(range(HALF))  # Python loops over them unroll when traced
    NHG = H // HB
    sl2 = scale * 1.4426950408889634
    bf16, f32 = "bfloat16", "float32"
    fixed = acc_dtype == "int64"
    n_rows, n_keys, width = T.dynamic("T"), T.dynamic("S"), T.dynamic("W")

    @T.macro
    def add_piece(c, acc_k, par, col0):
        """acc[ids, col0 : col0 + DP] += acc_k at the block's valid rows."""
        for i, j in T.Parallel(BI, DP):
            row = c.ids_sh[par * BI + i]
            if row >= 0:
                if fixed:
                    T.atomic_add(c.Acc[row, col0 + j],
                                 T.Cast("int64", T.round(acc_k[i, j] * c.fx[0] * c.fx[1])))
                else:
                    T.atomic_add(c.Acc[row, col0 + j], acc_k[i, j])

    @T.macro
    def dq_and_dk(c, acc_dq, acc_k, first, par):
        """This consumer's dq pieces, the gather buffer's release, then its dk pieces."""
        for u in halves:
            T.wgmma_gemm(c.ds_sh, c.kv_s[first + u], acc_dq[u], transpose_A=True)
        T.wait_wgmma(0)
        T.barrier_arrive(c.empty[0])
        for u in halves:
            T.wgmma_gemm(c.ds_sh, c.q_s[first + u], acc_k, clear_accum=True)
            T.wgmma_gemm(c.p_sh, c.do_s[first + u], acc_k)
            T.wait_wgmma(0)
            add_piece(c, acc_k, par, (first + u) * DP)
        T.barrier_arrive(c.pds_empty[0])

    @T.macro
    def probabilities(c, j, acc_t, acc_dq, acc_k):
        T.barrier_wait(c.full[0], j & 1)
        for i, h in T.Parallel(BI, HB):
            acc_t[i, h] = c.bias[i]
        for u in pieces:
            T.wgmma_gemm(c.kv_s[u], c.q_s[u], acc_t, transpose_B=True)
        T.wait_wgmma(0)
        T.barrier_wait(c.pds_empty[0], (j & 1) ^ 1)
        for i, h in T.Parallel(BI, HB):
            acc_t[i, h] = T.exp2(acc_t[i, h] * sl2 - c.lse_sh[h])
        T.copy(acc_t, c.pf_sh)
        T.copy(acc_t, c.p_sh)
        T.barrier_arrive(c.p_full[0])
        T.barrier_wait(c.ds_full[0], j & 1)
        dq_and_dk(c, acc_dq, acc_k, 0, j & 1)

    @T.macro
    def score_grads(c, j, acc_t, acc_dq, acc_k):
        T.barrier_wait(c.full[0], j & 1)
        for u in pieces:
            T.wgmma_gemm(c.kv_s[u], c.do_s[u], acc_t, transpose_B=True, clear_accum=u == 0)
        T.wait_wgmma(0)
        T.barrier_wait(c.p_full[0], j & 1)
        for i, h in T.Parallel(BI, HB):
            acc_t[i, h] = c.pf_sh[i, h] * (acc_t[i, h] - c.delta_sh[h]) * scale
        T.copy(acc_t, c.ds_sh)
        T.barrier_arrive(c.ds_full[0])
        dq_and_dk(c, acc_dq, acc_k, HALF, j & 1)

    @T.macro
    def write_dq(c, acc_dq, first):
        """This consumer's dq pieces, staged through its (no longer needed) query buffers."""
        for u in halves:
            T.copy(acc_dq[u], c.q_s[first + u])
            T.copy(c.q_s[first + u], c.dQ[c.t, c.h0:c.h0 + HB, (first + u) * DP:(first + u + 1) * DP])

    @T.macro
    def gather(c, n, j):
        p = c.tx - 256
        for r in T.unroll(BI // 16):  # this thread's 4 ids first: independent loads, before the wait
            pos = n * BI + r * 16 + p // 8
            c.row_id[r] = c.Ids[c.t, T.min(pos, width - 1)]
            if (pos >= width) | (c.row_id[r] < 0) | (c.row_id[r] >= n_keys):
                c.row_id[r] = -1
        T.barrier_wait(c.empty[0], (j & 1) ^ 1)
        for r in T.unroll(BI // 16):
            row = r * 16 + p // 8
            if p % 8 == 0:
                c.bias[row] = T.if_then_else(c.row_id[r] >= 0, 0, -T.infinity(f32))
                c.ids_sh[(j & 1) * BI + row] = c.row_id[r]
            src = T.max(c.row_id[r], 0)
            for u in pieces:
                for v in T.unroll(DP // 64):
                    col = 64 * v + (p % 8) * 8
                    T.ptx_cp_async(T.access_ptr(c.kv_s[u][row, col], "w", extent=8),
                                   T.access_ptr(c.KV[src, u * DP + col], "r", extent=8), 8)
        T.barrier_arrive(c.full[0])  # bias and ids (release); the rows arrive by cp.async completion
        T.cp_async_barrier_noinc(c.full[0])

    @T.prim_func
    def main(
        Q: T.Tensor([n_rows, H, D], bf16),
        KV: T.Tensor([n_keys, D], bf16),
        Ids: T.Tensor([n_rows, width], ids_dtype),
        dO: T.Tensor([n_rows, H, D], bf16),
        Lse: T.Tensor([n_rows, H], f32),
        Delta: T.Tensor([n_rows, H], f32),
        Fx: T.Tensor([2], f32),
        Acc: T.Tensor([n_keys, D], acc_dtype),
        dQ: T.Tensor([n_rows, H, D], bf16),
    ):
        with T.Kernel(n_rows * NHG, threads=384) as bx:
            q_s = [T.alloc_shared([HB, DP], bf16) for _ in range(NP)]
            do_s = [T.alloc_shared([HB, DP], bf16) for _ in range(NP)]
            kv_s = [T.alloc_shared([BI, DP], bf16) for _ in range(NP)]
            p_sh = T.alloc_shared([BI, HB], bf16)
            ds_sh = T.alloc_shared([BI, HB], bf16)
            pf_sh = T.alloc_shared([BI, HB], f32)
            lse_sh = T.alloc_shared([HB], f32)
            delta_sh = T.alloc_shared([HB], f32)
            bias = T.alloc_shared([BI], f32)
            ids_sh = T.alloc_shared([2 * BI], ids_dtype)
            span = T.alloc_shared([2], "int32")

            # each consumer its own fragments: with one fragment written in both branches TileLang
            # 0.1.15 dropped consumer 1's element-wise loop and atomics from the generated code
            acc_t = [T.alloc_fragment([BI, HB], f32) for _ in range(2)]
            acc_dq = [[T.alloc_fragment([HB, DP], f32) for _ in range(HALF)] for _ in range(2)]
            acc_k = [T.alloc_fragment([BI, DP], f32) for _ in range(2)]
            fx = T.alloc_local([2], f32)
            row_id = T.alloc_local([BI // 16], ids_dtype)
            lo_hi = T.alloc_local([2], "int32")

            bar_q = T.alloc_barrier(128)
            full = T.alloc_barrier(256)
            empty = T.alloc_barrier(256)
            p_full = T.alloc_barrier(128)
            ds_full = T.alloc_barrier(128)
            pds_empty = T.alloc_barrier(256)

            t = n_rows - 1 - bx // NHG
            h0 = (bx % NHG) * HB
            tx = T.get_thread_binding()

            if tx >= 256:  # the query's and dO's heads by 16-byte cp.async, in flight during the scan
                for r in T.unroll(HB * DP // 8 // 128):
                    chunk = r * 128 + tx - 256
                    row, col = chunk // (DP // 8), chunk % (DP // 8) * 8
                    for u in pieces:
                        T.ptx_cp_async(T.access_ptr(q_s[u][row, col], "w", extent=8),
                                       T.access_ptr(Q[t, h0 + row, u * DP + col], "r", extent=8), 8)
                        T.ptx_cp_async(T.access_ptr(do_s[u][row, col], "w", extent=8),
                                       T.access_ptr(dO[t, h0 + row, u * DP + col], "r", extent=8), 8)
                T.cp_async_barrier_noinc(bar_q[0])
            if tx < HB:
                lse_sh[tx] = Lse[t, h0 + tx] * 1.4426950408889634
                delta_sh[tx] = Delta[t, h0 + tx]
            if tx == 0:
                span[0] = width
                span[1] = 0
            T.sync_threads()
            lo_hi[0] = width
            lo_hi[1] = 0
            for w in T.serial(T.ceildiv(width, 384)):
                pos = w * 384 + tx
                if pos < width:
                    key = Ids[t, pos]
                    if (key >= 0) & (key < n_keys):
                        lo_hi[0] = T.min(lo_hi[0], pos)
                        lo_hi[1] = T.max(lo_hi[1], pos + 1)
            T.atomic_min(span[0], lo_hi[0])
            T.atomic_max(span[1], lo_hi[1])
            T.sync_threads()
            n_lo = span[0] // BI
            n_hi = T.ceildiv(span[1], BI)

            c = types.SimpleNamespace(full=full, empty=empty, p_full=p_full, ds_full=ds_full,
                                      pds_empty=pds_empty, Ids=Ids, KV=KV, Acc=Acc, dQ=dQ, t=t, h0=h0, tx=tx,
                                      q_s=q_s, do_s=do_s, kv_s=kv_s, p_sh=p_sh, ds_sh=ds_sh, pf_sh=pf_sh,
                                      lse_sh=lse_sh, delta_sh=delta_sh, bias=bias, ids_sh=ids_sh,
                                      row_id=row_id, fx=fx)

            # registers: 384 threads launch with 168 each (64512 of the SM's 65536), and setmaxnreg
            # can only redistribute those: 2 x 232 + 40 = 504 per thread of a warpgroup (240 + 240 +
            # 32 = 512 asked for more than the pool and hung)
            if tx < 256:
                T.set_max_nreg(232, 1)
                fx[0] = Fx[0]
                fx[1] = Fx[1]
                T.barrier_wait(bar_q[0], 0)
                if tx < 128:
                    for u in halves:
                        T.fill(acc_dq[0][u], 0)
                    for n in T.serial(n_lo, n_hi):
                        probabilities(c, n - n_lo, acc_t[0], acc_dq[0], acc_k[0])
                    write_dq(c, acc_dq[0], 0)
                else:
                    for u in halves:
                        T.fill(acc_dq[1][u], 0)
                    for n in T.serial(n_lo, n_hi):
                        score_grads(c, n - n_lo, acc_t[1], acc_dq[1], acc_k[1])
                    write_dq(c, acc_dq[1], HALF)
            else:
                T.set_max_nreg(40, 0)
                for n in T.serial(n_lo, n_hi):
                    gather(c, n, n - n_lo)

    return tilelang.compile(main, out_idx=[8], target=_TARGET,
                            pass_configs={tilelang.PassConfigKey.TL_DISABLE_SAFE_MEMORY_ACCESS: True})


def sparse_mla_bwd_tilelang(q, kv, token_ids, out, lse, dout, dlse, scale, *, deterministic=True):
    """``(dq [T, H, D] bf16, dkv [S, D] bf16)`` of ``glm53::sparse_mla`` (module doc; :func:`supports`).

    ``delta`` (Triton) and the fixed point's scale come first; ``dkv`` is the accumulator times
    ``2^-F`` (FP64, rounded once to kv's dtype) or the FP32 sums rounded."""
    from inductor_ext.kernels.sparse_mla.backward import fixed_point_scale, softmax_delta

    q, kv, token_ids, dout = (x.contiguous() for x in (q, kv, token_ids, dout))
    T_, H, D = q.shape
    delta = softmax_delta(out, dout, dlse)
    ids_dtype = "int32" if token_ids.dtype == torch.int32 else "int64"
    acc_dtype = "int64" if deterministic else "float32"
    acc = torch.zeros(kv.shape, dtype=getattr(torch, acc_dtype), device=kv.device)
    if deterministic:
        fx, inv = fixed_point_scale(q, kv, dout, dlse, scale, D)
    else:
        fx = inv = torch.ones(2, dtype=torch.float32, device=kv.device)
    if T_ == 0:
        return torch.zeros_like(q), torch.zeros_like(kv)
    kernel = _kernel(H, D, float(scale), ids_dtype, acc_dtype)
    dq = kernel(q, kv, token_ids, dout, lse.float().contiguous(), delta, fx, acc)
    dkv = (acc.double() * inv.double().prod()).to(kv.dtype) if deterministic else acc.to(kv.dtype)
    return dq, dkv
