"""Triton kernel of ``glm53::bi_mhc_coefficients``: mHC's coefficients from its projection, per row.

One program per ``BLOCK_R`` rows; a row's ``(2+N)·N`` projection values stay in registers as an
``[N, N]`` tile (comb) and two ``[N]`` vectors (pre, post), and every step is elementwise or a sum
over N written as a chain in index order, so a row's result never depends on the other rows of
the call. The order of operations is the ordered-chain reference's
(:func:`inductor_ext.ops.mhc_reference.coefficients_from_projection` with ``invariant=True``): sigmoids, the
softmax over ``o`` (max chain, exp, sum chain, divide), ``+ hc_eps``, then the Sinkhorn
normalisations (a column sum, then ``iters − 1`` row and column sums, each ``+ hc_eps`` and a
divide). Elements of a chain are taken out of the tile by a masked sum over N, exact (one value
plus zeros). Divisions are IEEE (``div_rn``: Triton's ``/`` is ``div.full.f32`` on CUDA, 2 ulp);
exp and sigmoid are Triton's (``ex2.approx``), so the values may differ from the CPU reference by
FP32 ulps; the contract is the invariance.

Imports only torch and triton; runs on CPU tensors under ``TRITON_INTERPRET=1``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["bi_mhc_coefficients_rows", "BLOCK_ROWS"]

BLOCK_ROWS = 64


@triton.jit
def _take(t, idx, j, AXIS: tl.constexpr):
    """``t`` at position ``j`` of ``AXIS`` (exact: one value plus zeros), the axis kept."""
    return tl.sum(tl.where(idx == j, t, 0.0), AXIS, keep_dims=True)


@triton.jit
def _chain_sum(t, idx, AXIS: tl.constexpr, N: tl.constexpr):
    """``((t₀ + t₁) + t₂) + …`` over ``AXIS`` (size N), the axis kept."""
    acc = _take(t, idx, 0, AXIS)
    for j in tl.static_range(1, N):
        acc = acc + _take(t, idx, j, AXIS)
    return acc


@triton.jit
def _chain_max(t, idx, AXIS: tl.constexpr, N: tl.constexpr):
    acc = _take(t, idx, 0, AXIS)
    for j in tl.static_range(1, N):
        acc = tl.maximum(acc, _take(t, idx, j, AXIS))
    return acc


@triton.jit
def _bi_mhc_coefficients_kernel(proj_ptr, base_ptr, scale_ptr, pre_ptr, post_ptr, comb_ptr, R, s_pr, hc_eps,
                                ITERS: tl.constexpr, N: tl.constexpr, BLOCK_R: tl.constexpr):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    rmask = rows < R
    n = tl.arange(0, N)
    s0 = tl.load(scale_ptr)
    s1 = tl.load(scale_ptr + 1)
    s2 = tl.load(scale_ptr + 2)

    vec = proj_ptr + rows[:, None] * s_pr + n[None, :]  # [BLOCK_R, N]
    a_pre = tl.load(vec, mask=rmask[:, None], other=0.0) * s0 + tl.load(base_ptr + n)[None, :]
    a_post = tl.load(vec + N, mask=rmask[:, None], other=0.0) * s1 + tl.load(base_ptr + N + n)[None, :]
    pre = tl.sigmoid(a_pre) + hc_eps
    post = 2 * tl.sigmoid(a_post)
    out = rows[:, None] * N + n[None, :]
    tl.store(pre_ptr + out, pre, mask=rmask[:, None])
    tl.store(post_ptr + out, post, mask=rmask[:, None])

    si = n[None, :, None]  # input stream s (axis 1)
    oi = n[None, None, :]  # output stream o (axis 2)
    cw = tl.load(proj_ptr + rows[:, None, None] * s_pr + 2 * N + si * N + oi, mask=rmask[:, None, None], other=0.0)
    logits = cw * s2 + tl.load(base_ptr + 2 * N + si * N + oi)
    e = tl.exp(logits - _chain_max(logits, oi, 2, N))
    comb = tl.div_rn(e, _chain_sum(e, oi, 2, N)) + hc_eps
    comb = tl.div_rn(comb, _chain_sum(comb, si, 1, N) + hc_eps)  # the first normalisation: over s (columns)
    for _ in tl.static_range(ITERS - 1):
        comb = tl.div_rn(comb, _chain_sum(comb, oi, 2, N) + hc_eps)
        comb = tl.div_rn(comb, _chain_sum(comb, si, 1, N) + hc_eps)
    tl.store(comb_ptr + rows[:, None, None] * (N * N) + si * N + oi, comb, mask=rmask[:, None, None])


def bi_mhc_coefficients_rows(proj: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, hc_eps: float,
                             iters: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(pre [R, N], post [R, N], comb [R, N, N])`` FP32 from ``proj [R, (2+N)·N]`` FP32 (rows
    with unit stride in the last dim), ``base [(2+N)·N]`` and ``scale [3]`` FP32 (module doc).
    N must be a power of two (Triton's block shapes)."""
    R, width = proj.shape
    N = int(round((1 + width) ** 0.5 - 1))
    if (2 + N) * N != width or N & (N - 1):
        raise ValueError(f"bi_mhc_coefficients: width {width} must be (2+N)*N with N a power of two")
    if proj.stride(-1) != 1:
        proj = proj.contiguous()
    pre = torch.empty((R, N), dtype=torch.float32, device=proj.device)
    post = torch.empty_like(pre)
    comb = torch.empty((R, N, N), dtype=torch.float32, device=proj.device)
    if R:
        _bi_mhc_coefficients_kernel[(triton.cdiv(R, BLOCK_ROWS),)](
            proj, base.contiguous(), scale.contiguous(), pre, post, comb, R, proj.stride(0), float(hc_eps),
            ITERS=int(iters), N=N, BLOCK_R=BLOCK_ROWS)
    return pre, post, comb
