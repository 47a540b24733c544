"""Batch-invariant matmul for ``glm53::bi_linear``: ``y = x · weightᵀ (+ bias)``, FP32 accumulation.

One program computes one ``[BLOCK_M, BLOCK_N]`` output tile over the full K: ``acc = dot(a_k, b_k,
acc)`` for K blocks of ``block_k`` in ascending order, then the bias, then one rounding. The tile
configuration is fixed per compute dtype (:data:`CONFIGS`), never chosen from M, and nothing is
autotuned: no split-K, no stream-K, no reduction split, so the MMA instructions that accumulate an
output element and their order are the same for every M, and an element's value depends only on
its row of x and its column of weightᵀ (rows beyond M are masked to zero inside the tile and never
reach another row's accumulator). Grouped tile order (``GROUP_M``) only changes which program
computes a tile, not how. ``M`` is not specialized, so every M runs the same compiled kernel.

FP32 inputs use ``input_precision="ieee"`` (no TF32); mixed input dtypes are upcast to FP32 in
registers (exact). Strided inputs are read in place, so the backward's transposed operands
(``dyᵀ``, ``xᵀ``) need no copies. Imports only torch and triton; the K block comes from the caller
(``inductor_ext.ops.batch_invariant_reference.BLOCK_K``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["CONFIGS", "bi_matmul"]

# compute dtype -> fixed launch configuration (BLOCK_M, BLOCK_N, GROUP_M, num_warps, num_stages).
# Changing an entry changes tiling only; the K order is fixed by the caller's block_k.
CONFIGS = {
    torch.bfloat16: (128, 128, 8, 8, 3),
    torch.float16: (128, 128, 8, 8, 3),
    torch.float32: (64, 64, 8, 4, 2),
}


@triton.jit(do_not_specialize=["M"])  # one compiled kernel for every M (no M == 1 / M % 16 variants)
def _bi_matmul_kernel(
    x_ptr, w_ptr, b_ptr, y_ptr, M, N, K,
    stride_xm, stride_xk, stride_wn, stride_wk, stride_ym, stride_yn,
    HAS_BIAS: tl.constexpr, UPCAST: tl.constexpr, IEEE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    pid = tl.program_id(0)
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    in_group = GROUP_M * num_n
    first_m = (pid // in_group) * GROUP_M
    group_m = tl.minimum(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % in_group) % group_m
    pid_n = (pid % in_group) // group_m

    rm = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    rn = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    rk = tl.arange(0, BLOCK_K)
    m_ok = rm < M
    n_ok = rn < N
    x_rows = x_ptr + rm[:, None] * stride_xm
    w_cols = w_ptr + rn[None, :] * stride_wn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):  # ascending K blocks, the whole K in this program
        kk = k0 + rk
        k_ok = kk < K
        a = tl.load(x_rows + kk[None, :] * stride_xk, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(w_cols + kk[:, None] * stride_wk, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        if UPCAST:
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        if IEEE:
            acc = tl.dot(a, b, acc, input_precision="ieee")
        else:
            acc = tl.dot(a, b, acc)
    if HAS_BIAS:
        acc = acc + tl.load(b_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    y_ptrs = y_ptr + rm[:, None] * stride_ym + rn[None, :] * stride_yn
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


def bi_matmul(x, weight, bias, out_dtype, block_k: int):
    """``x [..., K] · weight [N, K]ᵀ (+ bias [N])`` → contiguous ``[..., N]`` in ``out_dtype``; FP32
    accumulation over ascending K blocks of ``block_k``. Inputs may be strided (x must flatten to
    ``[M, K]`` without a copy for the in-place read; otherwise reshape copies it)."""
    K, N = x.shape[-1], weight.shape[0]
    x2 = x.reshape(-1, K)
    M = x2.shape[0]
    y = torch.empty((M, N), device=x.device, dtype=out_dtype)
    if M == 0:
        return y.reshape(*x.shape[:-1], N)
    compute = x.dtype if x.dtype == weight.dtype else torch.float32
    block_m, block_n, group_m, num_warps, num_stages = CONFIGS[compute]
    grid = (triton.cdiv(M, block_m) * triton.cdiv(N, block_n),)
    _bi_matmul_kernel[grid](
        x2, weight, bias if bias is not None else y, y, M, N, K,
        x2.stride(0), x2.stride(1), weight.stride(0), weight.stride(1), y.stride(0), y.stride(1),
        HAS_BIAS=bias is not None, UPCAST=x.dtype != weight.dtype, IEEE=compute == torch.float32,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, GROUP_M=group_m,
        num_warps=num_warps, num_stages=num_stages,
    )
    return y.reshape(*x.shape[:-1], N)
