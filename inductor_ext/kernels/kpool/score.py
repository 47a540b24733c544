"""Triton MQA scorer of ``glm53::kpool_logits`` (CUDA): BF16 and FP8 pool scores written into the
padded logits workspace (:func:`inductor_ext.workspace.logits_view`, the layout the fake returns).

Contract: ``logit[m, s] = c_s · Σ_h w[m, h] · relu(q[m, h] · pool[s])`` with ``c_s = pool_scale[s]``
(``"fp8"``) or ``128^-0.5`` (``"bf16"``; positive, so it moves out of the relu). The head-weighted
sum is FP32 CUDA-core math; the dots run on the tensor cores:

- ``"bf16"``: BF16 MMA, exact products, FP32 accumulation: within 1e-6 relative of the FP32
  reference (only the summation order differs).
- ``"fp8"``: e4m3 operands on the FP8 MMA, one chain of wgmma k32 steps over the 128 dims per head
  into a fresh accumulator (``max_num_imprecise_acc=128``: no promotion inside a head's dot). That
  is how the serving engines' scorer, DeepGEMM's SM90 ``fp8_mqa_logits``, accumulates: the FP8
  tensor core keeps about 14 mantissa bits while it sums (DeepSeek-V3 report), so scores sit
  about 1e-4 (relative L2) from the exact FP32 reference, far inside the normalized-error
  contract of the FP8 path (DeepGEMM's ``calc_diff`` <= 5e-6). Exact FP32 sums would need the
  FP16 MMA on widened operands, at about half this kernel's speed (measured on the H200:
  ``docs/kpool-indexer.md``).

Main kernel: one program = ``BQ=64`` tokens × ``BN=128`` pools, one warpgroup, a loop over the H
heads. The pool tile is loaded once and stays in shared memory as the MMA's B operand (MQA: all
heads share it); per head, ``q[:, h]`` ``[BQ, 128]`` streams in through ``cp.async``
(``NUM_STAGES`` deep), one ``[BQ,128]×[128,BN]`` wgmma chain runs, and ``w[:, h]·relu(s)`` is added
to the FP32 accumulator in the MMA's register layout (one FMNMX + one FFMA per score, no
cross-warp reduction). Bytes per FLOP: q is re-read once per pool block, ``bytes(q)/(2·BN)`` =
1/256 B for FP8 (BF16 twice that); the pool ``1/(2·BQ·H)`` and the FP32 output ``4/(256·H)`` are
negligible. Programs run pool-block-fastest, so those sharing a q tile are resident together and
q comes from HBM once. The wgmma wait serialises MMA and epilogue inside a program, so the kernel
relies on the second program per SM to fill the gaps.

Small grids (decode: a few query rows against many pools, or few tiles overall) run
:func:`_kpool_logits_fold_kernel` instead: it folds ``128/H`` tokens × H heads into the 128 MMA
rows and reduces over heads per pool block, wasting no MMA rows at tiny M; its dots accumulate the
same way. Both kernels use fixed configurations (no autotuning): capturable and deterministic.
"""

from __future__ import annotations

import triton
import triton.language as tl

from inductor_ext import workspace

__all__ = ["kpool_logits_fwd"]

_BQ = 64  # query tokens per program: the M of one warpgroup's wgmma
_BN = 128  # pools per program: the wgmma N; sets q's L2 bytes per FLOP, 1 / (2·BN) per q byte
_NUM_WARPS = 4  # one warpgroup; two programs per SM overlap one's MMA with the other's epilogue
_NUM_STAGES = 4  # q tiles in flight (8 KB FP8 / 16 KB BF16 each) beside the pool tile (16 / 32 KB)
# head loop only when it fills the tile rows and the GPU reasonably; else the head-folding kernel
_LOOP_MIN_ROWS = 32
_LOOP_MIN_PROGRAMS = 32
_FOLD_TARGET_PROGRAMS = 4 * 132  # H200: 132 SMs; split the pool axis only when token tiles are few


@triton.jit
def _dot(a, b, FP8: tl.constexpr):
    """FP32 ``a @ b`` over K = 128; FP8: one imprecise chain, as DeepGEMM (module docstring)."""
    if FP8:
        return tl.dot(a, b, max_num_imprecise_acc=128)
    return tl.dot(a, b)


@triton.jit
def _kpool_logits_kernel(
    q_ptr, w_ptr, pool_ptr, pool_scale_ptr, out_ptr,
    M, S, stride_qm, stride_qh, stride_wm, stride_out,
    H: tl.constexpr, BQ: tl.constexpr, BN: tl.constexpr, FP8: tl.constexpr, NUM_STAGES: tl.constexpr,
):
    pid_n = tl.program_id(0)  # pool block fastest: the programs of one q tile run together
    pid_m = tl.program_id(1)
    tok = pid_m * BQ + tl.arange(0, BQ)
    cols = pid_n * BN + tl.arange(0, BN)
    tok_ok = tok < M
    col_ok = cols < S
    d = tl.arange(0, 128)
    k = tl.load(pool_ptr + cols[:, None] * 128 + d[None, :], mask=col_ok[:, None], other=0.0)
    kt = tl.trans(k)  # [128, BN]: the loop-invariant B operand, in shared memory
    q_rows = q_ptr + tok[:, None].to(tl.int64) * stride_qm + d[None, :]
    w_rows = w_ptr + tok.to(tl.int64) * stride_wm
    acc = tl.zeros((BQ, BN), dtype=tl.float32)
    for h in tl.range(0, H, num_stages=NUM_STAGES):
        qh = tl.load(q_rows + h * stride_qh, mask=tok_ok[:, None], other=0.0)
        wh = tl.load(w_rows + h, mask=tok_ok, other=0.0)
        s = _dot(qh, kt, FP8)  # [BQ, BN] fp32
        acc += tl.maximum(s, 0.0) * wh[:, None]
    if FP8:
        acc *= tl.load(pool_scale_ptr + cols, mask=col_ok, other=0.0)[None, :]
    else:
        acc *= 0.08838834764831845  # 128^-0.5
    out = out_ptr + tok[:, None].to(tl.int64) * stride_out + cols[None, :]
    tl.store(out, acc, mask=tok_ok[:, None] & col_ok[None, :])


@triton.jit
def _kpool_logits_fold_kernel(
    q_ptr, w_ptr, pool_ptr, pool_scale_ptr, out_ptr,
    M, S, stride_qm, stride_qh, stride_wm, stride_out, n_iters, n_split,
    H: tl.constexpr, BM: tl.constexpr, BLOCK_N: tl.constexpr, FP8: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    R: tl.constexpr = BM * H
    r = tl.arange(0, R)
    tok = pid_m * BM + r // H
    head = r % H
    ok = tok < M
    d = tl.arange(0, 128)
    q = tl.load(q_ptr + tok[:, None].to(tl.int64) * stride_qm + head[:, None] * stride_qh + d[None, :],
                mask=ok[:, None], other=0.0)
    w = tl.load(w_ptr + tok * stride_wm + head, mask=ok, other=0.0)
    out_tok = pid_m * BM + tl.arange(0, BM)
    for i in range(n_iters):
        cols = (pid_n + i * n_split) * BLOCK_N + tl.arange(0, BLOCK_N)
        cok = cols < S
        kt = tl.load(pool_ptr + cols[None, :] * 128 + d[:, None], mask=cok[None, :], other=0.0)
        s = _dot(q, kt, FP8)  # [R, BLOCK_N] fp32
        if not FP8:
            s = s * 0.08838834764831845
        s = tl.maximum(s, 0.0) * w[:, None]
        logit = tl.sum(tl.reshape(s, (BM, H, BLOCK_N)), axis=1)
        if FP8:
            logit = logit * tl.load(pool_scale_ptr + cols, mask=cok, other=0.0)[None, :]
        tl.store(out_ptr + out_tok[:, None].to(tl.int64) * stride_out + cols[None, :], logit,
                 mask=(out_tok < M)[:, None] & cok[None, :])


def kpool_logits_fwd(q, w, pool, pool_scale, precision: str, layout: str, block_n: int = 64):
    """MQA pool scores into the padded workspace.

    Args:
        q: ``[M, H, 128]`` bf16 (``"bf16"``) or float8_e4m3fn (``"fp8"``), unit stride on the last dim
            after a copy if needed; H in 32, 64, 128.
        w: ``[M, H]`` fp32 head weights (``"fp8"``: ``w_eff``).
        pool: ``[S, 128]`` same dtype as q; pool_scale ``[S]`` fp32 (used by ``"fp8"``).
        precision: ``"bf16"`` (Σ_h w·relu(q·k·128^-0.5)) or ``"fp8"`` (scale·Σ_h w·relu(q8·k8)).
        layout: ``"compact"`` | ``"legacy"`` workspace layout.
        block_n: pool block of the head-folding kernel (small grids only); the main kernel's tile
            is fixed (module docstring).

    Returns:
        FP32 ``[M, S]`` view with row stride ``workspace.mqa_logits_stride(S, layout)`` (padding rows
        and columns are left unwritten, as in the reference).
    """
    M, H, _ = q.shape
    S = pool.shape[0]
    out = workspace.logits_view(M, S, H, layout, q.device)
    if M == 0 or S == 0:
        return out
    if q.stride(-1) != 1:
        q = q.contiguous()
    if w.stride(-1) != 1:
        w = w.contiguous()
    fp8 = precision == "fp8"
    pool, pool_scale = pool.contiguous(), pool_scale.contiguous()
    args = (q, w, pool, pool_scale, out, M, S, q.stride(0), q.stride(1), w.stride(0), out.stride(0))
    grid = (triton.cdiv(S, _BN), triton.cdiv(M, _BQ))
    if M >= _LOOP_MIN_ROWS and grid[0] * grid[1] >= _LOOP_MIN_PROGRAMS:
        _kpool_logits_kernel[grid](*args, H=H, BQ=_BQ, BN=_BN, FP8=fp8, NUM_STAGES=_NUM_STAGES,
                                   num_warps=_NUM_WARPS)
        return out
    bq = workspace.mqa_row_block(H)
    n_blocks = triton.cdiv(S, block_n)
    m_tiles = triton.cdiv(M, bq)
    n_split = max(1, min(n_blocks, triton.cdiv(_FOLD_TARGET_PROGRAMS, m_tiles)))
    _kpool_logits_fold_kernel[(m_tiles, n_split)](
        *args, triton.cdiv(n_blocks, n_split), n_split, H=H, BM=bq, BLOCK_N=block_n, FP8=fp8, num_warps=8)
    return out
