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

The ``[S, D]`` accumulator (launch modes, :data:`MODES`):

- ``fixed32x2`` (the default, deterministic): the Triton backward's fixed point
  (:mod:`~.backward`): int32 fields with one scale ``2^F_s`` per latent row, from each row's bound
  ``B_s = Σ_{(t,j)→s} c[t,j]``, ``c[t,j] = Σ_h |ds| · max|q[t,h]| + p · max|dO[t,h]|``. A first
  launch (``bound``) computes only ``sᵀ``, ``dpᵀ`` and ``ds`` and adds the ``c`` into an int64 ``[S]``
  accumulator (fixed point of :func:`~.backward.fixed_point_scale`); the second rounds each
  contribution at its row's scale (ties to even) and adds a thread's two adjacent columns as one
  64-bit integer ``hi · 2^32 + lo`` (``_PAIR_ADD``), half the atomics of one per element;
- ``fixed64`` (deterministic, one launch): int64 fixed point with one scale for the tensor (every
  partial sum below 2^60), one 64-bit integer atomic per element;
- ``float32`` (``deterministic=False``): FP32 atomics, two columns per instruction (order-dependent
  rounding).

Integer addition is associative, so the integer accumulators are bitwise the same in any order.

Rows of ids are handled as in the forward: the id row's first and last valid position bound the
visited blocks, a padding id loads row 0, its scores are masked through a per-block bias and it
adds nothing. No host synchronisation.

No ``from __future__ import annotations`` here: TileLang evaluates the kernel's parameter annotations.
"""

import functools
import types

import torch

from .tilelang_common import (
    BLOCK,
    HEADS_PER_CTA,
    THREADS,
    compile_kernel,
    macros,
    row_major_inputs,
    rows_tensor,
    supports,
)

__all__ = ["supports", "sparse_mla_bwd_tilelang", "HEADS_PER_CTA", "BLOCK", "MODES", "ACCUMULATORS"]

PIECE = 128  # columns per shared buffer and per dk piece

MODES = ("fixed64", "fixed32x2", "float32", "bound")
ACCUMULATORS = ("fixed32x2", "fixed64")  # deterministic=True's choices

# Two adjacent int32 fields added as one 64-bit integer: hi · 2^32 + lo (lo sign-extended). The low
# field's carries land in the high one; each field's sum stays inside int32, so the word's low 32
# bits are the low field's sum and (word - lo) >> 32 the high field's (``_unpack_pairs``).
_PAIR_ADD = """
__device__ __forceinline__ void AtomicAddx2(int *ref, const int *val, int memory_order = 0) {
  long long w = (static_cast<long long>(val[1]) << 32) + static_cast<long long>(val[0]);
  atomicAdd(reinterpret_cast<unsigned long long *>(ref), static_cast<unsigned long long>(w));
}
"""


@functools.cache
def _kernel(H: int, D: int, scale: float, ids_dtype: str, mode: str, strided: bool):
    """The launch for ``mode``: ``fixed64`` / ``fixed32x2`` / ``float32`` accumulate dq and dkv
    (module doc), ``bound`` only adds each listed slot's bound into ``Acc[:, 0]``. ``strided``: Q's
    and dO's query and head strides are kernel arguments (else both contiguous)."""
    import tilelang.language as T

    HB, BI, DP = HEADS_PER_CTA, BLOCK, PIECE
    NP = D // DP
    HALF = NP // 2
    pieces, halves = tuple(range(NP)), tuple(range(HALF))  # Python loops over them unroll when traced
    NHG = H // HB
    sl2 = scale * 1.4426950408889634
    bf16, f32 = "bfloat16", "float32"
    grads = mode != "bound"
    acc_dtype = {"fixed64": "int64", "float32": "float32", "fixed32x2": "int32", "bound": "int64"}[mode]
    acc_width = 1 if mode == "bound" else D
    n_rows, n_keys, width = T.dynamic("T"), T.dynamic("S"), T.dynamic("W")
    n_max, n_scales, n_dq = T.dynamic("TM"), T.dynamic("NS"), T.dynamic("TQ")
    q_type, do_type = (rows_tensor(T, n_rows, H, D, strided, name) for name in ("q", "do"))
    m = macros(T, width, n_keys)

    def fixed(x, c, k):  # x scaled by the two factors of scale row k, rounded (ties to even)
        return T.round(x * c.Scales[k, 0] * c.Scales[k, 1])

    @T.macro
    def add_piece(c, acc_k, acc_x, par, col0):
        """acc[ids, col0 : col0 + DP] += acc_k at the block's valid rows."""
        if mode == "fixed32x2":  # int32 fields; each thread's column pairs go as one 64-bit add
            for i, j in T.Parallel(BI, DP):
                acc_x[i, j] = T.Cast("int32", fixed(acc_k[i, j], c, T.max(c.ids_sh[par * BI + i], 0)))
            for i, j in T.Parallel(BI, DP // 2):
                row = c.ids_sh[par * BI + i]
                if row >= 0:
                    T.atomic_addx2(c.Acc[row, col0 + 2 * j], acc_x[i, 2 * j])
        else:
            for i, j in T.Parallel(BI, DP):
                row = c.ids_sh[par * BI + i]
                if row >= 0:
                    if mode == "fixed64":
                        T.atomic_add(c.Acc[row, col0 + j], T.Cast("int64", fixed(acc_k[i, j], c, 0)))
                    else:
                        T.atomic_add(c.Acc[row, col0 + j], acc_k[i, j])

    @T.macro
    def dq_and_dk(c, acc_dq, acc_k, acc_x, first, par):
        """This consumer's dq pieces, the gather buffer's release, then its dk pieces."""
        for u in halves:
            T.wgmma_gemm(c.ds_sh, c.kv_s[first + u], acc_dq[u], transpose_A=True)
        T.wait_wgmma(0)
        T.barrier_arrive(c.empty[0])
        for u in halves:
            T.wgmma_gemm(c.ds_sh, c.q_s[first + u], acc_k, clear_accum=True)
            T.wgmma_gemm(c.p_sh, c.do_s[first + u], acc_k)
            T.wait_wgmma(0)
            add_piece(c, acc_k, acc_x, par, (first + u) * DP)
        T.barrier_arrive(c.pds_empty[0])

    @T.macro
    def add_bounds(c, acc_t, par):
        """Acc[id, 0] += ceil(Σ_h |ds| · max|q| + p · max|dO|) (fixed point of Scales[0]) per valid id."""
        for i, h in T.Parallel(BI, HB):
            acc_t[i, h] = T.abs(acc_t[i, h]) * c.qmax_sh[h] + c.pf_sh[i, h] * c.gmax_sh[h]
        T.reduce_sum(acc_t, c.bound_f, dim=1)
        T.copy(c.bound_f, c.bound_sh)
        lt = c.tx - 128
        if lt < BI:
            row = c.ids_sh[par * BI + lt]
            if row >= 0:
                T.atomic_add(c.Acc[row, 0], T.Cast("int64", T.ceil(c.bound_sh[lt] * c.Scales[0, 0] * c.Scales[0, 1])))
        T.barrier_arrive(c.pds_empty[0])

    @T.macro
    def probabilities(c, j, acc_t, acc_dq, acc_k, acc_x):
        T.barrier_wait(c.full[0], j & 1)
        for i, h in T.Parallel(BI, HB):
            acc_t[i, h] = c.bias[i]
        for u in pieces:
            T.wgmma_gemm(c.kv_s[u], c.q_s[u], acc_t, transpose_B=True)
        T.wait_wgmma(0)
        if not grads:
            T.barrier_arrive(c.empty[0])
        T.barrier_wait(c.pds_empty[0], (j & 1) ^ 1)
        for i, h in T.Parallel(BI, HB):
            acc_t[i, h] = T.exp2(acc_t[i, h] * sl2 - c.lse_sh[h])
        T.copy(acc_t, c.pf_sh)
        if grads:
            T.copy(acc_t, c.p_sh)
        T.barrier_arrive(c.p_full[0])
        if grads:
            T.barrier_wait(c.ds_full[0], j & 1)
            dq_and_dk(c, acc_dq, acc_k, acc_x, 0, j & 1)
        else:
            T.barrier_arrive(c.pds_empty[0])

    @T.macro
    def score_grads(c, j, acc_t, acc_dq, acc_k, acc_x):
        T.barrier_wait(c.full[0], j & 1)
        for u in pieces:
            T.wgmma_gemm(c.kv_s[u], c.do_s[u], acc_t, transpose_B=True, clear_accum=u == 0)
        T.wait_wgmma(0)
        if not grads:
            T.barrier_arrive(c.empty[0])
        T.barrier_wait(c.p_full[0], j & 1)
        for i, h in T.Parallel(BI, HB):
            acc_t[i, h] = c.pf_sh[i, h] * (acc_t[i, h] - c.delta_sh[h]) * scale
        if grads:
            T.copy(acc_t, c.ds_sh)
            T.barrier_arrive(c.ds_full[0])
            dq_and_dk(c, acc_dq, acc_k, acc_x, HALF, j & 1)
        else:
            add_bounds(c, acc_t, j & 1)

    @T.macro
    def write_dq(c, acc_dq, first):
        """This consumer's dq pieces, staged through its (no longer needed) query buffers."""
        for u in halves:
            T.copy(acc_dq[u], c.q_s[first + u])
            T.copy(c.q_s[first + u], c.dQ[c.t, c.h0:c.h0 + HB, (first + u) * DP:(first + u + 1) * DP])

    @T.macro
    def gather(c, n, j):
        p = c.tx - 256
        m.block_ids(c.row_id, c.Ids, c.t, n * BI, p)
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
                    m.copy16(c.kv_s[u][row, col], c.KV[src, u * DP + col])
        T.barrier_arrive(c.full[0])  # bias and ids (release); the rows arrive by cp.async completion
        T.cp_async_barrier_noinc(c.full[0])

    @T.prim_func
    def main(
        Q: q_type,
        KV: T.Tensor([n_keys, D], bf16),
        Ids: T.Tensor([n_rows, width], ids_dtype),
        dO: do_type,
        Lse: T.Tensor([n_rows, H], f32),
        Delta: T.Tensor([n_rows, H], f32),
        Maxima: T.Tensor([n_max, H, 2], f32),
        Scales: T.Tensor([n_scales, 2], f32),
        Acc: T.Tensor([n_keys, acc_width], acc_dtype),
        dQ: T.Tensor([n_dq, H, D], bf16),
    ):
        with T.Kernel(n_rows * NHG, threads=THREADS, prelude=_PAIR_ADD) as bx:
            q_s = [T.alloc_shared([HB, DP], bf16) for _ in range(NP)]
            do_s = [T.alloc_shared([HB, DP], bf16) for _ in range(NP)]
            kv_s = [T.alloc_shared([BI, DP], bf16) for _ in range(NP)]
            p_sh = T.alloc_shared([BI, HB], bf16)
            ds_sh = T.alloc_shared([BI, HB], bf16)
            pf_sh = T.alloc_shared([BI, HB], f32)
            lse_sh = T.alloc_shared([HB], f32)
            delta_sh = T.alloc_shared([HB], f32)
            qmax_sh = T.alloc_shared([HB], f32)
            gmax_sh = T.alloc_shared([HB], f32)
            bound_sh = T.alloc_shared([BI], f32)
            bias = T.alloc_shared([BI], f32)
            ids_sh = T.alloc_shared([2 * BI], ids_dtype)
            span = T.alloc_shared([2], "int32")

            # each consumer its own fragments: with one fragment written in both branches TileLang
            # 0.1.15 dropped consumer 1's element-wise loop and atomics from the generated code
            acc_t = [T.alloc_fragment([BI, HB], f32) for _ in range(2)]
            acc_dq = [[T.alloc_fragment([HB, DP], f32) for _ in range(HALF if grads else 0)] for _ in range(2)]
            acc_k = [T.alloc_fragment([BI, DP], f32) if grads else None for _ in range(2)]
            acc_x = [T.alloc_fragment([BI, DP], "int32") if mode == "fixed32x2" else None for _ in range(2)]
            bound_f = T.alloc_fragment([BI], f32)
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
                        m.copy16(q_s[u][row, col], Q[t, h0 + row, u * DP + col])
                        m.copy16(do_s[u][row, col], dO[t, h0 + row, u * DP + col])
                T.cp_async_barrier_noinc(bar_q[0])
            if tx < HB:
                lse_sh[tx] = Lse[t, h0 + tx] * 1.4426950408889634
                delta_sh[tx] = Delta[t, h0 + tx]
                if not grads:
                    qmax_sh[tx] = Maxima[t, h0 + tx, 0]
                    gmax_sh[tx] = Maxima[t, h0 + tx, 1]
            m.row_span(span, lo_hi, Ids, t, tx)
            n_lo = span[0] // BI
            n_hi = T.ceildiv(span[1], BI)

            c = types.SimpleNamespace(full=full, empty=empty, p_full=p_full, ds_full=ds_full,
                                      pds_empty=pds_empty, Ids=Ids, KV=KV, Acc=Acc, dQ=dQ, t=t, h0=h0, tx=tx,
                                      q_s=q_s, do_s=do_s, kv_s=kv_s, p_sh=p_sh, ds_sh=ds_sh, pf_sh=pf_sh,
                                      lse_sh=lse_sh, delta_sh=delta_sh, bias=bias, ids_sh=ids_sh,
                                      row_id=row_id, Scales=Scales, qmax_sh=qmax_sh, gmax_sh=gmax_sh,
                                      bound_f=bound_f, bound_sh=bound_sh)

            # registers: 384 threads launch with 168 each (64512 of the SM's 65536), and setmaxnreg
            # can only redistribute those: 2 x 232 + 40 = 504 per thread of a warpgroup (240 + 240 +
            # 32 = 512 asked for more than the pool and hung)
            if tx < 256:
                T.set_max_nreg(232, 1)
                T.barrier_wait(bar_q[0], 0)
                if tx < 128:
                    for u in halves if grads else ():
                        T.fill(acc_dq[0][u], 0)
                    for n in T.serial(n_lo, n_hi):
                        probabilities(c, n - n_lo, acc_t[0], acc_dq[0], acc_k[0], acc_x[0])
                    if grads:
                        write_dq(c, acc_dq[0], 0)
                else:
                    for u in halves if grads else ():
                        T.fill(acc_dq[1][u], 0)
                    for n in T.serial(n_lo, n_hi):
                        score_grads(c, n - n_lo, acc_t[1], acc_dq[1], acc_k[1], acc_x[1])
                    if grads:
                        write_dq(c, acc_dq[1], HALF)
            else:
                T.set_max_nreg(40, 0)
                for n in T.serial(n_lo, n_hi):
                    gather(c, n, n - n_lo)

    return compile_kernel(main)


def _unpack_pairs(words: torch.Tensor) -> torch.Tensor:
    """``[S, D]`` int64 fields of ``[S, D / 2]`` words ``hi · 2^32 + lo``: column 2j is lo, 2j + 1 hi
    (each field's sum stays inside int32, so the word's low 32 bits are lo's sum)."""
    lo = (words << 32) >> 32
    hi = (words - lo) >> 32
    return torch.stack((lo, hi), dim=-1).flatten(-2)


def sparse_mla_bwd_tilelang(q, kv, token_ids, out, lse, dout, dlse, scale, *, deterministic=True,
                            accumulator="fixed32x2"):
    """``(dq [T, H, D] bf16, dkv [S, D] bf16)`` of ``glm53::sparse_mla`` (module doc; :func:`supports`).

    ``deterministic``: ``accumulator`` (:data:`ACCUMULATORS`) ``"fixed32x2"`` (a ``bound`` launch,
    then int32 fields with a scale per latent row, two per int64 word) or ``"fixed64"`` (one
    scale); else FP32 atomics. Non-contiguous ``q`` / ``dout`` that the 16-byte copies can read
    (the absorbed layer's head-major ones) are read in place
    (:func:`~.tilelang_common.row_major_inputs`), others copied first: the same bits either way."""
    from inductor_ext.kernels.sparse_mla.backward import _absmax, fixed_point_scale, row_scales, softmax_delta

    if accumulator not in ACCUMULATORS:
        raise ValueError(f"accumulator must be one of {ACCUMULATORS}, got {accumulator!r}")
    (q, dout), strided_in = row_major_inputs(q, dout)
    kv, token_ids = kv.contiguous(), token_ids.contiguous()
    T_, H, D = q.shape
    S = kv.shape[0]
    dev = kv.device
    if T_ == 0:
        return torch.zeros_like(q), torch.zeros_like(kv)
    mode = accumulator if deterministic else "float32"
    ids_dtype = "int32" if token_ids.dtype == torch.int32 else "int64"
    delta = softmax_delta(out, dout, dlse)
    lse = lse.float().contiguous()
    maxima = torch.zeros((1, H, 2), dtype=torch.float32, device=dev)
    dq = torch.empty((T_, H, D), dtype=q.dtype, device=dev)

    def launch(kind, maxima, scales, acc, dq_out):
        _kernel(H, D, float(scale), ids_dtype, kind, strided_in)(q, kv, token_ids, dout, lse, delta, maxima, scales,
                                                                 acc, dq_out)
        return acc

    if mode == "float32":
        acc = launch(mode, maxima, torch.ones((1, 2), device=dev), torch.zeros((S, D), device=dev), dq)
        return dq, acc.to(kv.dtype)
    qmax, gmax = _absmax(q, -1).float(), _absmax(dout, -1).float()
    fx, inv = fixed_point_scale(q, kv, dout, dlse, scale, D, qmax, gmax)
    if mode == "fixed64":
        acc = launch(mode, maxima, fx[None], torch.zeros((S, D), dtype=torch.int64, device=dev), dq)
        return dq, (acc.double() * inv.double().prod()).to(kv.dtype)
    bound = launch("bound", torch.stack((qmax, gmax), -1), fx[None],
                   torch.zeros((S, 1), dtype=torch.int64, device=dev), dq[:1])
    rowfx, rowinv = row_scales(bound[:, 0], inv)
    fields = launch(mode, maxima, rowfx, torch.zeros((S, D), dtype=torch.int32, device=dev), dq)
    return dq, (_unpack_pairs(fields.view(torch.int64)).double() * rowinv.double().prod(-1, keepdim=True)).to(kv.dtype)
