"""TileLang forward of ``glm53::sparse_mla`` for Hopper (sm_90a): warp-specialised, one CTA per
(query row, group of 64 heads).

Imports torch only; tilelang (the ``tilelang`` extra, 0.1.15) is imported when a kernel is first
built, which compiles it for the geometry with nvcc (seconds; cached on disk by TileLang).

Supported (:func:`supports`): an sm_90 device, ``H`` a multiple of 64, ``D = d_v`` of 256 or 512
(the widths run on the H200), BF16 q and kv, int32 or int64 ids (-1, or an id outside ``[0, S)``, is padding,
anywhere in a row). The op runs the Triton forward for every other geometry.

Three warpgroups of 128 threads share the CTA:

- the producer first loads the query's 64 heads into shared memory (``cp.async``, completing
  ``bar_q``, in flight while the CTA scans its id row), then gathers the listed latent rows,
  ``BLOCK`` ids at a time, with ``cp.async`` into one of two shared buffers (each row split into a
  left and a right half of ``D / 2`` columns); a padding id loads row 0 (its scores are masked, so
  its probabilities are exact zeros);
- consumer 0 computes the scores of the 64 heads against the block (``wgmma``, M = heads, K = D),
  masks padding to ``-inf``, runs the FP32 online softmax (base 2), writes the probabilities rounded
  to BF16 and the rescale factors to shared memory, and accumulates the left half of the output;
- consumer 1 accumulates the right half from the same probabilities.

mbarriers order them, phases counted from the row's first visited pair (``rnd``): ``full[b]``
(producer → consumers: 128 plain arrivals publishing the bias, 128 by ``cp.async`` completion),
``empty[b]`` (both consumers → producer), ``p_full`` / ``p_empty`` (consumer 0 ↔ consumer 1, the
probabilities).
Numerics are the Triton forward's: FP32 scores and softmax, BF16 probabilities into the value MMA,
``out = acc · (1 / l)`` rounded once, ``lse = (m + log2 l) · ln 2``; a row without valid ids gives
``out = 0``, ``lse = -inf``. Rows are scheduled last row first. Before the loop the CTA finds the
row's first and last valid position, so the pairs of blocks outside that span are not visited,
nor the pair's second block when the span ends before it (2051 ids are 33 blocks, not 34). No host
synchronisation.

No ``from __future__ import annotations`` here: TileLang evaluates the kernel's parameter annotations,
which name the geometry of the enclosing builder.
"""

import functools
import math
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

__all__ = ["supports", "sparse_mla_fwd_tilelang", "HEADS_PER_CTA", "BLOCK"]


@functools.cache
def _kernel(H: int, D: int, scale: float, ids_dtype: str, strided: bool):
    """The forward for the geometry; ``strided``: Q's query and head strides are kernel arguments
    (else Q is contiguous)."""
    import tilelang.language as T

    HB, BI, DH = HEADS_PER_CTA, BLOCK, D // 2
    NHG = H // HB
    sl2 = scale * 1.4426950408889634
    bf16, f32 = "bfloat16", "float32"
    n_rows, n_keys, width = T.dynamic("T"), T.dynamic("S"), T.dynamic("W")
    q_type = rows_tensor(T, n_rows, H, D, strided, "q")
    m = macros(T, width, n_keys)

    @T.macro
    def scores_and_left(c, i, kv_l, kv_r, b, rnd):
        T.barrier_wait(c.full[b], rnd & 1)
        for h, j in T.Parallel(HB, BI):
            c.acc_s[h, j] = c.bias[b * BI + j]
        T.wgmma_gemm(c.q_l, kv_l, c.acc_s, transpose_B=True)
        T.wgmma_gemm(c.q_r, kv_r, c.acc_s, transpose_B=True)
        T.wait_wgmma(0)
        T.barrier_wait(c.p_empty[0], (i & 1) ^ 1)
        T.copy(c.m_i, c.m_prev)
        T.reduce_max(c.acc_s, c.m_i, dim=1, clear=False)
        for h in T.Parallel(HB):
            c.alpha[h] = T.exp2((c.m_prev[h] - c.m_i[h]) * sl2)
        for h, j in T.Parallel(HB, BI):
            c.acc_s[h, j] = T.exp2(c.acc_s[h, j] * sl2 - c.m_i[h] * sl2)
        T.reduce_sum(c.acc_s, c.l_blk, dim=1)
        for h in T.Parallel(HB):
            c.l_i[h] = c.l_i[h] * c.alpha[h] + c.l_blk[h]
        for h, d in T.Parallel(HB, DH):
            c.acc_l[h, d] *= c.alpha[h]
        T.copy(c.alpha, c.alpha_sh)
        T.copy(c.acc_s, c.p_sh)
        T.barrier_arrive(c.p_full[0])
        T.gemm(c.p_sh, kv_l, c.acc_l)
        T.barrier_arrive(c.empty[b])

    @T.macro
    def right(c, i, kv_r, b):
        T.barrier_wait(c.p_full[0], i & 1)
        for h, d in T.Parallel(HB, DH):
            c.acc_r[h, d] *= c.alpha_sh[h]
        T.gemm(c.p_sh, kv_r, c.acc_r)
        T.barrier_arrive(c.p_empty[0])
        T.barrier_arrive(c.empty[b])

    @T.macro
    def copy_halves(dst_l, dst_r, src_l, src_r):
        """One 16-byte ``cp.async`` into each half-row buffer (8 BF16 columns from each source)."""
        m.copy16(dst_l, src_l)
        m.copy16(dst_r, src_r)

    @T.macro
    def gather(c, i, kv_l, kv_r, b, rnd):
        p = c.tx - 256
        m.block_ids(c.row_id, c.Ids, c.t, i * BI, p)
        T.barrier_wait(c.empty[b], (rnd & 1) ^ 1)
        for r in T.unroll(BI // 16):
            row = r * 16 + p // 8
            if p % 8 == 0:
                c.bias[b * BI + row] = T.if_then_else(c.row_id[r] >= 0, 0, -T.infinity(f32))
            src = T.max(c.row_id[r], 0)
            for u in T.unroll(DH // 64):
                col = 64 * u + (p % 8) * 8
                copy_halves(kv_l[row, col], kv_r[row, col], c.KV[src, col], c.KV[src, DH + col])
        T.barrier_arrive(c.full[b])  # the bias store (release); the rows arrive by cp.async completion
        T.cp_async_barrier_noinc(c.full[b])

    @T.prim_func
    def main(
        Q: q_type,
        KV: T.Tensor([n_keys, D], bf16),
        Ids: T.Tensor([n_rows, width], ids_dtype),
        Out: T.Tensor([n_rows, H, D], bf16),
        Lse: T.Tensor([n_rows, H], f32),
    ):
        with T.Kernel(n_rows * NHG, threads=THREADS) as bx:
            q_l = T.alloc_shared([HB, DH], bf16)
            q_r = T.alloc_shared([HB, DH], bf16)
            kv0_l = T.alloc_shared([BI, DH], bf16)
            kv0_r = T.alloc_shared([BI, DH], bf16)
            kv1_l = T.alloc_shared([BI, DH], bf16)
            kv1_r = T.alloc_shared([BI, DH], bf16)
            p_sh = T.alloc_shared([HB, BI], bf16)
            alpha_sh = T.alloc_shared([HB], f32)
            inv_sh = T.alloc_shared([HB], f32)

            acc_s = T.alloc_fragment([HB, BI], f32)
            acc_l = T.alloc_fragment([HB, DH], f32)
            acc_r = T.alloc_fragment([HB, DH], f32)
            m_i = T.alloc_fragment([HB], f32)
            m_prev = T.alloc_fragment([HB], f32)
            l_i = T.alloc_fragment([HB], f32)
            l_blk = T.alloc_fragment([HB], f32)
            alpha = T.alloc_fragment([HB], f32)
            lse_f = T.alloc_fragment([HB], f32)
            inv_l = T.alloc_fragment([HB], f32)
            bias = T.alloc_shared([2 * BI], f32)
            row_id = T.alloc_local([BI // 16], ids_dtype)
            span = T.alloc_shared([2], "int32")
            lo_hi = T.alloc_local([2], "int32")

            bar_q = T.alloc_barrier(128)
            full = T.alloc_barrier([256, 256])
            empty = T.alloc_barrier([256, 256])
            p_full = T.alloc_barrier(128)
            p_empty = T.alloc_barrier(128)
            done = T.alloc_barrier(128)

            t = n_rows - 1 - bx // NHG
            h0 = (bx % NHG) * HB
            tx = T.get_thread_binding()

            # the query's heads by 16-byte cp.async from the producer's threads, in flight during the
            # span scan (T.copy by all 384 threads lowers to 2-byte loads: a half's 2048 16-byte
            # chunks do not split evenly over 384 threads)
            if tx >= 256:
                for r in T.unroll(HB * DH // 8 // 128):
                    chunk = r * 128 + tx - 256
                    row, col = chunk // (DH // 8), chunk % (DH // 8) * 8
                    copy_halves(q_l[row, col], q_r[row, col], Q[t, h0 + row, col], Q[t, h0 + row, DH + col])
                T.cp_async_barrier_noinc(bar_q[0])
            m.row_span(span, lo_hi, Ids, t, tx)
            k_lo = span[0] // (2 * BI)
            k_hi = T.ceildiv(span[1], 2 * BI)
            n_hi = T.ceildiv(span[1], BI)  # the pair loop's last second block can lie past the span

            c = types.SimpleNamespace(full=full, empty=empty, p_full=p_full, p_empty=p_empty, Ids=Ids, t=t,
                                      acc_s=acc_s, q_l=q_l, q_r=q_r, m_i=m_i, m_prev=m_prev, alpha=alpha,
                                      l_i=l_i, l_blk=l_blk, acc_l=acc_l, alpha_sh=alpha_sh, p_sh=p_sh,
                                      acc_r=acc_r, tx=tx, row_id=row_id, KV=KV, bias=bias)

            if tx < 128:
                T.set_max_nreg(240, 1)
                T.fill(m_i, -(2.0 ** 30))
                T.fill(l_i, 0)
                T.fill(acc_l, 0)
                T.barrier_wait(bar_q[0], 0)
                for k in T.serial(k_lo, k_hi):
                    scores_and_left(c, 2 * k, kv0_l, kv0_r, 0, k - k_lo)
                    if 2 * k + 1 < n_hi:
                        scores_and_left(c, 2 * k + 1, kv1_l, kv1_r, 1, k - k_lo)
                for h in T.Parallel(HB):  # l >= 0 or NaN: `l <= 0` is l = 0 (no valid id); NaN stays NaN
                    inv_l[h] = T.if_then_else(l_i[h] <= 0, 0, 1.0 / l_i[h])
                    inv_sh[h] = inv_l[h]
                    lse_f[h] = T.if_then_else(l_i[h] <= 0, -T.infinity(f32),
                                              (T.log2(l_i[h]) + m_i[h] * sl2) * math.log(2.0))
                T.barrier_arrive(done[0])
                for h, d in T.Parallel(HB, DH):
                    acc_l[h, d] *= inv_l[h]
                T.copy(acc_l, q_l)
                T.copy(q_l, Out[t, h0:h0 + HB, 0:DH])
                T.copy(lse_f, Lse[t, h0:h0 + HB])
            elif tx < 256:
                T.set_max_nreg(168, 1)
                T.fill(acc_r, 0)
                for k in T.serial(k_lo, k_hi):
                    right(c, 2 * k, kv0_r, 0)
                    if 2 * k + 1 < n_hi:
                        right(c, 2 * k + 1, kv1_r, 1)
                T.barrier_wait(done[0], 0)
                for h, d in T.Parallel(HB, DH):
                    acc_r[h, d] *= inv_sh[h]
                T.copy(acc_r, q_r)
                T.copy(q_r, Out[t, h0:h0 + HB, DH:D])
            else:
                T.set_max_nreg(80, 0)
                for k in T.serial(k_lo, k_hi):
                    gather(c, 2 * k, kv0_l, kv0_r, 0, k - k_lo)
                    if 2 * k + 1 < n_hi:
                        gather(c, 2 * k + 1, kv1_l, kv1_r, 1, k - k_lo)

    return compile_kernel(main, out_idx=[3, 4])


def sparse_mla_fwd_tilelang(q, kv, token_ids, scale, d_v):
    """``(out [T, H, D] bf16, lse [T, H] fp32)`` of ``glm53::sparse_mla`` (module doc; :func:`supports`).

    A non-contiguous ``q`` that the 16-byte copies can read (the absorbed layer's head-major one)
    is read in place by a kernel built with its strides (:func:`~.tilelang_common.row_major_inputs`),
    others are copied first: the same bits either way."""
    (q,), strided_q = row_major_inputs(q)
    kv, token_ids = kv.contiguous(), token_ids.contiguous()
    ids_dtype = "int32" if token_ids.dtype == torch.int32 else "int64"
    kernel = _kernel(q.shape[1], q.shape[2], float(scale), ids_dtype, strided_q)
    return kernel(q, kv, token_ids)
