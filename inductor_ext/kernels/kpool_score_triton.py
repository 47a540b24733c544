"""Triton MQA scorer of ``glm53::kpool_logits`` (CUDA): BF16 and FP8 pool scores written into the
padded logits workspace (:func:`inductor_ext.workspace.logits_view`, the layout the fake returns).

One program owns ``bq = 128 / H`` query tokens (a 128-row tile of (token, head) pairs, H in 32, 64,
128) and walks pool blocks of ``BLOCK_N``: ``relu(q·kᵀ)`` on the tensor cores, then the head-weighted
sum over H in FP32. FP8 operands are widened to BF16 (exact) before the MMA: Hopper's FP8 MMA
accumulates with ~14 mantissa bits (DeepSeek-V3 report), which cannot meet the 1e-6 contract; the
BF16 MMA accumulates in FP32. Scores differ from the reference only by FP32 summation order.
"""

from __future__ import annotations

import triton
import triton.language as tl

from inductor_ext import workspace

__all__ = ["kpool_logits_fwd"]

_TARGET_PROGRAMS = 4 * 132  # H200: 132 SMs; split the pool axis only when token tiles are few


@triton.jit
def _kpool_logits_kernel(
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
    q = tl.load(q_ptr + tok[:, None] * stride_qm + head[:, None] * stride_qh + d[None, :],
                mask=ok[:, None], other=0.0)
    w = tl.load(w_ptr + tok * stride_wm + head, mask=ok, other=0.0)
    if FP8:
        q = q.to(tl.bfloat16)  # exact widening; see the module docstring
    out_tok = pid_m * BM + tl.arange(0, BM)
    for i in range(n_iters):
        cols = (pid_n + i * n_split) * BLOCK_N + tl.arange(0, BLOCK_N)
        cok = cols < S
        kt = tl.load(pool_ptr + cols[None, :] * 128 + d[:, None], mask=cok[None, :], other=0.0)
        if FP8:
            kt = kt.to(tl.bfloat16)
        s = tl.dot(q, kt)  # [R, BLOCK_N] fp32
        if not FP8:
            s = s * 0.08838834764831845
        s = tl.maximum(s, 0.0) * w[:, None]
        logit = tl.sum(tl.reshape(s, (BM, H, BLOCK_N)), axis=1)
        if FP8:
            logit = logit * tl.load(pool_scale_ptr + cols, mask=cok, other=0.0)[None, :]
        tl.store(out_ptr + out_tok[:, None] * stride_out + cols[None, :], logit,
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

    Returns:
        FP32 ``[M, S]`` view with row stride ``workspace.mqa_logits_stride(S, layout)`` (padding rows
        and columns are left unwritten, as in the reference).
    """
    M, H, _ = q.shape
    S = pool.shape[0]
    bq = workspace.mqa_row_block(H)
    out = workspace.logits_view(M, S, H, layout, q.device)
    if M == 0 or S == 0:
        return out
    if q.stride(-1) != 1:
        q = q.contiguous()
    if w.stride(-1) != 1:
        w = w.contiguous()
    fp8 = precision == "fp8"
    pool = pool.contiguous()
    n_blocks = triton.cdiv(S, block_n)
    m_tiles = triton.cdiv(M, bq)
    n_split = max(1, min(n_blocks, triton.cdiv(_TARGET_PROGRAMS, m_tiles)))
    _kpool_logits_kernel[(m_tiles, n_split)](
        q, w, pool, pool_scale.contiguous(), out, M, S, q.stride(0), q.stride(1), w.stride(0),
        out.stride(0), triton.cdiv(n_blocks, n_split), n_split, H=H, BM=bq, BLOCK_N=block_n, FP8=fp8, num_warps=8)
    return out
