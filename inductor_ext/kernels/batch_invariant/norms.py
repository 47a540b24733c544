"""Batch-invariant row kernels: RMSNorm, LayerNorm, log-softmax and the row sum of the backward.

One program per row (grid = number of rows), so no reduction is ever split across programs, and
every row statistic is computed by the same fixed loop: ``BLOCK`` FP32 lanes, lane ``j``
accumulating elements ``j, j + BLOCK, …`` in ascending order (masked tails add the identity), then
:func:`_tree_sum` / :func:`_tree_max`, an explicit halving tree (``v[:h] ⊕ v[h:]`` via a
``[2, h]`` reshape, whose two-element reductions are exact in either order). ``BLOCK`` comes from
the caller (``inductor_ext.ops.batch_invariant_reference.ROW_BLOCK``); nothing depends on the
number of rows. Square roots and divisions are IEEE (``sqrt_rn``, ``div_rn``).

Under ``TRITON_INTERPRET=1`` (numpy, no fused multiply-add) the norms and the row sum are bitwise
equal to the CPU reference; on the GPU the compiler may contract ``acc + v·v`` into an FMA and
``exp``/``log`` are the hardware approximations, so GPU results match the reference within a
tolerance, while staying batch-invariant (one compiled kernel for every M).
Imports only torch and triton.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["bi_rms_norm_rows", "bi_layer_norm_rows", "bi_log_softmax_rows", "bi_row_sum_rows", "MAX_BLOCK"]

MAX_BLOCK = 1024  # the halving trees below are written out up to this many lanes
_NUM_WARPS = 4


@triton.jit
def _halve_sum(v, H: tl.constexpr):
    return tl.sum(tl.reshape(v, (2, H)), axis=0)


@triton.jit
def _halve_max(v, H: tl.constexpr):
    return tl.max(tl.reshape(v, (2, H)), axis=0)


@triton.jit
def _tree_sum(v, BLOCK: tl.constexpr):
    """Sum of ``v [BLOCK]`` (a power of two, 2..1024) by the halving tree of ``tree_sum``."""
    if BLOCK >= 1024:
        v = _halve_sum(v, 512)
    if BLOCK >= 512:
        v = _halve_sum(v, 256)
    if BLOCK >= 256:
        v = _halve_sum(v, 128)
    if BLOCK >= 128:
        v = _halve_sum(v, 64)
    if BLOCK >= 64:
        v = _halve_sum(v, 32)
    if BLOCK >= 32:
        v = _halve_sum(v, 16)
    if BLOCK >= 16:
        v = _halve_sum(v, 8)
    if BLOCK >= 8:
        v = _halve_sum(v, 4)
    if BLOCK >= 4:
        v = _halve_sum(v, 2)
    return tl.sum(v, axis=0)


@triton.jit
def _tree_max(v, BLOCK: tl.constexpr):
    """Max of ``v [BLOCK]`` by the halving tree of ``tree_max``."""
    if BLOCK >= 1024:
        v = _halve_max(v, 512)
    if BLOCK >= 512:
        v = _halve_max(v, 256)
    if BLOCK >= 256:
        v = _halve_max(v, 128)
    if BLOCK >= 128:
        v = _halve_max(v, 64)
    if BLOCK >= 64:
        v = _halve_max(v, 32)
    if BLOCK >= 32:
        v = _halve_max(v, 16)
    if BLOCK >= 16:
        v = _halve_max(v, 8)
    if BLOCK >= 8:
        v = _halve_max(v, 4)
    if BLOCK >= 4:
        v = _halve_max(v, 2)
    return tl.max(v, axis=0)


@triton.jit
def _rms_norm_kernel(x_ptr, w_ptr, y_ptr, D, d, stride_x, stride_y, eps, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * stride_x
    y_row = y_ptr + row * stride_y
    lanes = tl.arange(0, BLOCK)
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for c in range(0, D, BLOCK):
        v = tl.load(x_row + c + lanes, mask=c + lanes < D, other=0.0).to(tl.float32)
        acc = acc + v * v
    s = tl.sqrt_rn(tl.div_rn(_tree_sum(acc, BLOCK), d) + eps)
    for c in range(0, D, BLOCK):
        ok = c + lanes < D
        v = tl.load(x_row + c + lanes, mask=ok, other=0.0)
        n = tl.div_rn(v.to(tl.float32), s).to(v.dtype).to(tl.float32)  # rounded to x's dtype
        w = tl.load(w_ptr + c + lanes, mask=ok, other=0.0).to(tl.float32)
        tl.store(y_row + c + lanes, (n * w).to(y_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _layer_norm_kernel(x_ptr, w_ptr, b_ptr, y_ptr, D, d, stride_x, stride_y, eps,
                       HAS_W: tl.constexpr, HAS_B: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * stride_x
    y_row = y_ptr + row * stride_y
    lanes = tl.arange(0, BLOCK)
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for c in range(0, D, BLOCK):
        acc = acc + tl.load(x_row + c + lanes, mask=c + lanes < D, other=0.0).to(tl.float32)
    mean = tl.div_rn(_tree_sum(acc, BLOCK), d)
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for c in range(0, D, BLOCK):
        ok = c + lanes < D
        xc = tl.where(ok, tl.load(x_row + c + lanes, mask=ok, other=0.0).to(tl.float32) - mean, 0.0)
        acc = acc + xc * xc
    s = tl.sqrt_rn(tl.div_rn(_tree_sum(acc, BLOCK), d) + eps)
    for c in range(0, D, BLOCK):
        ok = c + lanes < D
        y = tl.div_rn(tl.load(x_row + c + lanes, mask=ok, other=0.0).to(tl.float32) - mean, s)
        if HAS_W:
            y = y * tl.load(w_ptr + c + lanes, mask=ok, other=0.0).to(tl.float32)
        if HAS_B:
            y = y + tl.load(b_ptr + c + lanes, mask=ok, other=0.0).to(tl.float32)
        tl.store(y_row + c + lanes, y.to(y_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _log_softmax_kernel(x_ptr, y_ptr, V, stride_x, stride_y, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * stride_x
    y_row = y_ptr + row * stride_y
    lanes = tl.arange(0, BLOCK)
    acc = tl.full((BLOCK,), float("-inf"), dtype=tl.float32)
    for c in range(0, V, BLOCK):
        v = tl.load(x_row + c + lanes, mask=c + lanes < V, other=float("-inf")).to(tl.float32)
        acc = tl.maximum(acc, v)
    m = _tree_max(acc, BLOCK)
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for c in range(0, V, BLOCK):
        ok = c + lanes < V
        z = tl.load(x_row + c + lanes, mask=ok, other=0.0).to(tl.float32) - m
        acc = acc + tl.where(ok, tl.exp(z), 0.0)
    log_s = tl.log(_tree_sum(acc, BLOCK))
    for c in range(0, V, BLOCK):
        ok = c + lanes < V
        z = tl.load(x_row + c + lanes, mask=ok, other=0.0).to(tl.float32) - m
        tl.store(y_row + c + lanes, z - log_s, mask=ok)


@triton.jit
def _row_sum_kernel(x_ptr, y_ptr, L, stride_r, stride_c, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * stride_r
    lanes = tl.arange(0, BLOCK)
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for c in range(0, L, BLOCK):
        cols = (c + lanes).to(tl.int64)
        acc = acc + tl.load(x_row + cols * stride_c, mask=cols < L, other=0.0).to(tl.float32)
    tl.store(y_ptr + row, _tree_sum(acc, BLOCK))


def _rows(x):
    """``x [..., D]`` as ``[R, D]`` with unit column stride (a copy only when it must)."""
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def _check_block(block: int) -> None:
    if block < 2 or block > MAX_BLOCK or block & (block - 1):
        raise ValueError(f"batch_invariant kernels: block must be a power of two in [2, {MAX_BLOCK}], got {block}")


def bi_rms_norm_rows(x, weight, eps: float, out_dtype, block: int):
    """RMSNorm of ``x [..., D]`` (model semantics, see the reference) → contiguous ``[..., D]`` in
    ``out_dtype``; one program per row, ``block`` FP32 lanes."""
    _check_block(block)
    x2 = _rows(x)
    y = torch.empty(x2.shape, device=x.device, dtype=out_dtype)
    if x2.shape[0]:
        _rms_norm_kernel[(x2.shape[0],)](x2, weight, y, x2.shape[1], float(x2.shape[1]), x2.stride(0), y.stride(0), eps,
                                         BLOCK=block, num_warps=_NUM_WARPS)
    return y.reshape(x.shape)


def bi_layer_norm_rows(x, weight, bias, eps: float, block: int):
    """LayerNorm of ``x [..., D]`` in FP32 (optional weight, bias) → contiguous ``[..., D]`` in x's dtype."""
    _check_block(block)
    x2 = _rows(x)
    y = torch.empty(x2.shape, device=x.device, dtype=x.dtype)
    if x2.shape[0]:
        _layer_norm_kernel[(x2.shape[0],)](
            x2, weight if weight is not None else x2, bias if bias is not None else x2, y, x2.shape[1],
            float(x2.shape[1]), x2.stride(0), y.stride(0), eps, HAS_W=weight is not None, HAS_B=bias is not None,
            BLOCK=block, num_warps=_NUM_WARPS)
    return y.reshape(x.shape)


def bi_log_softmax_rows(x, block: int):
    """FP32 log-softmax over the last dim of ``x [..., V]`` → contiguous FP32 ``[..., V]``."""
    _check_block(block)
    x2 = _rows(x)
    y = torch.empty(x2.shape, device=x.device, dtype=torch.float32)
    if x2.shape[0]:
        _log_softmax_kernel[(x2.shape[0],)](x2, y, x2.shape[1], x2.stride(0), y.stride(0),
                                            BLOCK=block, num_warps=_NUM_WARPS)
    return y.reshape(x.shape)


def bi_row_sum_rows(x, block: int):
    """FP32 sum over the last dim of ``x [..., L]`` (any strides when 2-D: a transposed view is read
    in place) → FP32 ``[...]``."""
    _check_block(block)
    x2 = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])
    y = torch.empty(x2.shape[0], device=x.device, dtype=torch.float32)
    if x2.shape[0]:
        _row_sum_kernel[(x2.shape[0],)](x2, y, x2.shape[1], x2.stride(0), x2.stride(1),
                                        BLOCK=block, num_warps=_NUM_WARPS)
    return y.reshape(x.shape[:-1])
