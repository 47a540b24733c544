"""Batch-invariant ops of "true on-policy": ``glm53::bi_linear``, ``glm53::bi_grouped_linear`` (the
MoE experts; its weight gradient ``glm53::bi_grouped_linear_wgrad``), ``glm53::bi_rms_norm``,
``glm53::bi_layer_norm``, ``glm53::bi_log_softmax`` and ``glm53::bi_row_sum`` (the backward's
fixed-order reduction).

Contract (``docs/DESIGN.md`` §9): every output row is bitwise independent of how many rows share
the call (M = 1 or M = 16384, any position): each reduction runs in an order fixed by the reduced
length only (fixed K block, no split-K, one program per row for the row ops). Numerics and the
argument: :mod:`inductor_ext.ops.batch_invariant_reference` (the CPU kernels); CUDA kernels in
Triton (``inductor_ext/kernels/batch_invariant/``), with the reference on CUDA when triton is
missing (logged once; the reference is batch-invariant on every device, only slower).

Backward (``register_autograd``): gradients are deterministic (bitwise repeatable for fixed
shapes); batch invariance is a contract on forward values only (docs/DESIGN.md §9: gradients have no
serving twin), so the linear's GEMMs run the device's own:

- ``bi_linear``: ``dx = dy · weight`` and ``dweight = dyᵀ · x`` by ``torch.matmul`` (cuBLAS on CUDA:
  FP32 accumulation, deterministic for fixed shapes, its K order chosen by shape), in the
  gradient's dtype when both operands have it, else in FP32; ``dbias = bi_row_sum(dyᵀ)`` (lanes over rows,
  ascending, then the tree).
- ``bi_grouped_linear``: BF16 with N and K multiples of 8 (``torch._grouped_mm``'s own limits,
  static): ``dx`` and ``dweight`` by ``torch._grouped_mm`` (the plain experts' kernel; rows past the
  last offset get an exact 0, an empty group's dweight is 0). Other dtypes and shapes keep
  batch-invariant kernels: ``dx = bi_grouped_linear(dy, weightᵀ per group)`` (a strided view), so a
  dx row is ``bi_linear(dy row, weight[e]ᵀ)``; ``dweight[e] = dy[group e]ᵀ · x[group e]`` by
  ``bi_grouped_linear_wgrad``: the bi_linear reduction over the group's rows (blocks of ``BLOCK_K``
  rows ascending from the group's first row; on CPU the reference per group, on CUDA the same
  Triton kernel in its ragged-K mode: the same block order, the MMA's order inside a block, no
  split, deterministic), exact zeros for a group without rows. ``offs`` has no gradient.
- norms and log-softmax: the row statistics (``Σ g·x̂``, ``Σ dy``) through ``bi_row_sum`` over the
  last dim; ``dweight``/``dbias`` through ``bi_row_sum`` of the transposed ``[D, M]`` products.
  Elementwise steps are plain torch ops (per element, so invariant on any device).

Gradients are computed in FP32 and returned in each input's dtype. No host synchronisation, no
environment read, static output shapes: the ops trace into one graph and capture in CUDA graphs.
"""

from __future__ import annotations

import torch

import inductor_ext.ops.round_to  # noqa: F401  (glm53::round_to: a rounding Inductor cannot fold)
from inductor_ext import backends
from inductor_ext.ops import _checks
from inductor_ext.ops import batch_invariant_reference as ref
from inductor_ext.ops._checks import input_error

__all__ = ["bi_linear", "bi_grouped_linear", "bi_rms_norm", "bi_layer_norm", "bi_log_softmax", "bi_row_sum"]

_T = torch.Tensor
_DT = torch.dtype
_FALLBACK = "the plain-torch reference kernel (batch-invariant, slower)"


# ---------------------------------------------------------------------------------------------
# torch.library ops: the references are the CPU kernels
# ---------------------------------------------------------------------------------------------


@torch.library.custom_op("glm53::bi_linear", mutates_args=(), device_types="cpu")
def _bi_linear_op(x: _T, weight: _T, bias: _T | None, out_dtype: _DT) -> _T:
    """``x [..., K] · weight [N, K]ᵀ (+ bias)`` → ``[..., N]`` in ``out_dtype``; see :func:`bi_linear`."""
    with torch.no_grad():
        return ref.bi_linear_reference(x, weight, bias, out_dtype)


@torch.library.custom_op("glm53::bi_grouped_linear", mutates_args=(), device_types="cpu")
def _bi_grouped_linear_op(x: _T, weight: _T, offs: _T) -> _T:
    """Rows of group e of ``x [M, K]`` times ``weight[e]ᵀ`` → ``[M, N]`` in x's dtype; see
    :func:`bi_grouped_linear`. On CPU a loop over the groups (reads offs on the host: the op is
    opaque to Dynamo)."""
    with torch.no_grad():
        return ref.bi_grouped_linear_reference(x, weight, offs)


@torch.library.custom_op("glm53::bi_grouped_linear_wgrad", mutates_args=(), device_types="cpu")
def _bi_grouped_linear_wgrad_op(dy: _T, x: _T, offs: _T, out_dtype: _DT) -> _T:
    """``dweight[e] = dy[group e]ᵀ · x[group e]`` → ``[E, N, K]`` in ``out_dtype`` (zeros for empty
    groups), the weight gradient of ``bi_grouped_linear`` where ``torch._grouped_mm`` does not fit."""
    with torch.no_grad():
        return ref.bi_grouped_linear_wgrad_reference(dy, x, offs, out_dtype)


@torch.library.custom_op("glm53::bi_rms_norm", mutates_args=(), device_types="cpu")
def _bi_rms_norm_op(x: _T, weight: _T, eps: float) -> _T:
    """RMSNorm of ``x [..., D]``; see :func:`bi_rms_norm`."""
    with torch.no_grad():
        return ref.bi_rms_norm_reference(x, weight, eps)


@torch.library.custom_op("glm53::bi_layer_norm", mutates_args=(), device_types="cpu")
def _bi_layer_norm_op(x: _T, weight: _T | None, bias: _T | None, eps: float) -> _T:
    """LayerNorm of ``x [..., D]`` in FP32; see :func:`bi_layer_norm`."""
    with torch.no_grad():
        return ref.bi_layer_norm_reference(x, weight, bias, eps)


@torch.library.custom_op("glm53::bi_log_softmax", mutates_args=(), device_types="cpu")
def _bi_log_softmax_op(x: _T) -> _T:
    """FP32 log-softmax over the last dim; see :func:`bi_log_softmax`."""
    with torch.no_grad():
        return ref.bi_log_softmax_reference(x)


@torch.library.custom_op("glm53::bi_row_sum", mutates_args=(), device_types="cpu")
def _bi_row_sum_op(x: _T) -> _T:
    """FP32 fixed-order sum over the last dim; see :func:`bi_row_sum`."""
    with torch.no_grad():
        return ref.bi_row_sum_reference(x)


# CUDA kernels: Triton (inductor_ext/kernels/batch_invariant/), block sizes from the leaf.


def _kernels():
    from inductor_ext.kernels import batch_invariant

    return batch_invariant


def _cuda_linear(x, weight, bias, out_dtype):
    return _kernels().bi_matmul(x, weight, bias, out_dtype, ref.BLOCK_K)


def _cuda_grouped_linear(x, weight, offs):
    starts, ends = ref.group_bounds(offs, x.shape[0])  # device-side, no host read
    return _kernels().bi_grouped_matmul(x, weight, starts, ends, x.dtype, ref.BLOCK_K)


def _cuda_grouped_linear_wgrad(dy, x, offs, out_dtype):
    starts, ends = ref.group_bounds(offs, x.shape[0])
    return _kernels().bi_grouped_matmul_wgrad(dy, x, starts, ends, out_dtype, ref.BLOCK_K)


def _cuda_rms_norm(x, weight, eps):
    out_dtype = ref.rms_norm_output_dtype(x.dtype, weight.dtype)
    return _kernels().bi_rms_norm_rows(x, weight, eps, out_dtype, ref.ROW_BLOCK)


def _cuda_layer_norm(x, weight, bias, eps):
    return _kernels().bi_layer_norm_rows(x, weight, bias, eps, ref.ROW_BLOCK)


def _cuda_log_softmax(x):
    return _kernels().bi_log_softmax_rows(x, ref.ROW_BLOCK)


def _cuda_row_sum(x):
    return _kernels().bi_row_sum_rows(x, ref.ROW_BLOCK)


def _register_cuda(name: str, reference, triton_kernel) -> None:
    def plain(*args):
        with torch.no_grad():
            return reference(*args)

    backends.register_triton(f"glm53::{name}", lambda: triton_kernel, plain, _FALLBACK)


_register_cuda("bi_linear", ref.bi_linear_reference, _cuda_linear)
_register_cuda("bi_grouped_linear", ref.bi_grouped_linear_reference, _cuda_grouped_linear)
_register_cuda("bi_grouped_linear_wgrad", ref.bi_grouped_linear_wgrad_reference, _cuda_grouped_linear_wgrad)
_register_cuda("bi_rms_norm", ref.bi_rms_norm_reference, _cuda_rms_norm)
_register_cuda("bi_layer_norm", ref.bi_layer_norm_reference, _cuda_layer_norm)
_register_cuda("bi_log_softmax", ref.bi_log_softmax_reference, _cuda_log_softmax)
_register_cuda("bi_row_sum", ref.bi_row_sum_reference, _cuda_row_sum)


# ---------------------------------------------------------------------------------------------
# autograd: deterministic; the row statistics through the batch-invariant ops, the linear's GEMMs plain
# ---------------------------------------------------------------------------------------------


def _rows(t: _T) -> _T:
    return t.reshape(-1, t.shape[-1])


def _col_sum(t2: _T) -> _T:
    """FP32 sum over the rows of ``t2 [M, D]`` → ``[D]``: lanes over rows in ascending order, then the tree."""
    return torch.ops.glm53.bi_row_sum(t2.t())


def _row_sum(t: _T) -> _T:
    """FP32 fixed-order sum over the last dim, keeping it (``[..., 1]``)."""
    return torch.ops.glm53.bi_row_sum(t).unsqueeze(-1)


def _plain_mm(a: _T, b: _T, out_dtype: _DT) -> _T:
    """``a · b`` → ``out_dtype`` by ``torch.matmul`` in that dtype when both operands have it, else in
    FP32 (no intermediate rounding: CPU matmul has no ``out_dtype``)."""
    compute = out_dtype if a.dtype == b.dtype == out_dtype else torch.float32
    return torch.matmul(a.to(compute), b.to(compute)).to(out_dtype)


def _linear_setup(ctx, inputs, output):
    x, weight, bias, _ = inputs
    ctx.bias_dtype = bias.dtype if bias is not None else None
    ctx.save_for_backward(x, weight)


def _linear_backward(ctx, dy):
    x, weight = ctx.saved_tensors
    dx = dw = db = None
    dy2 = _rows(dy)
    if ctx.needs_input_grad[0]:
        dx = _plain_mm(dy, weight, x.dtype)
    if ctx.needs_input_grad[1]:
        dw = _plain_mm(dy2.t(), _rows(x), weight.dtype)
    if ctx.bias_dtype is not None and ctx.needs_input_grad[2]:
        db = _col_sum(dy2).to(ctx.bias_dtype)
    return dx, dw, db, None


def _grouped_linear_setup(ctx, inputs, output):
    x, weight, offs = inputs
    ctx.save_for_backward(x, weight, offs)


def _grouped_mm_fits(x: _T, weight: _T) -> bool:
    """Whether ``bi_grouped_linear``'s backward runs ``torch._grouped_mm``: BF16 operands whose rows
    are 16-byte aligned (N and K multiples of 8). Static: dtypes and shapes only."""
    return x.dtype == weight.dtype == torch.bfloat16 and weight.shape[1] % 8 == 0 and weight.shape[2] % 8 == 0


def _grouped_linear_backward(ctx, dy):
    x, weight, offs = ctx.saved_tensors
    dx = dw = None
    plain = _grouped_mm_fits(x, weight)
    dy = dy.to(x.dtype).contiguous() if plain else dy
    if ctx.needs_input_grad[0]:
        if plain:
            dx = torch._grouped_mm(dy, weight.contiguous(), offs=offs)
            grouped = torch.arange(x.shape[0], device=x.device) < offs[-1]
            dx = torch.where(grouped[:, None], dx, 0)  # rows past the last group: not written by _grouped_mm
        else:
            dx = torch.ops.glm53.bi_grouped_linear(dy.to(x.dtype), weight.transpose(1, 2), offs)
    if ctx.needs_input_grad[1]:
        if plain:
            dw = torch._grouped_mm(dy.t(), x.contiguous(), offs=offs)
        else:
            dw = torch.ops.glm53.bi_grouped_linear_wgrad(dy, x, offs, weight.dtype)
    return dx, dw, None


def _rms_norm_setup(ctx, inputs, output):
    x, weight, eps = inputs
    ctx.eps = eps
    ctx.save_for_backward(x, weight)


def _rms_norm_backward(ctx, dy):
    x, weight = ctx.saved_tensors
    D = x.shape[-1]
    xf = x.float()
    s = ref.sqrt_rn(_row_sum(xf * xf) / D + ctx.eps)
    n = xf / s
    dyf = dy.float()
    dx = dw = None
    if ctx.needs_input_grad[0]:
        g = dyf * weight.float()  # through the rounding of x̂ as the identity
        dx = ((g - n * (_row_sum(g * n) / D)) / s).to(x.dtype)
    if ctx.needs_input_grad[1]:
        n_rounded = n if x.dtype == torch.float32 else torch.ops.glm53.round_to(n, x.dtype)  # x̂ as the forward used it
        dw = _col_sum(_rows(dyf * n_rounded)).to(weight.dtype)
    return dx, dw, None


def _layer_norm_setup(ctx, inputs, output):
    x, weight, bias, eps = inputs
    ctx.eps = eps
    ctx.bias_dtype = bias.dtype if bias is not None else None
    ctx.save_for_backward(x, weight)


def _layer_norm_backward(ctx, dy):
    x, weight = ctx.saved_tensors
    D = x.shape[-1]
    xf = x.float()
    xc = xf - _row_sum(xf) / D
    s = ref.sqrt_rn(_row_sum(xc * xc) / D + ctx.eps)
    n = xc / s
    dyf = dy.float()
    dx = dw = db = None
    if ctx.needs_input_grad[0]:
        g = dyf * weight.float() if weight is not None else dyf
        dx = ((g - _row_sum(g) / D - n * (_row_sum(g * n) / D)) / s).to(x.dtype)
    if weight is not None and ctx.needs_input_grad[1]:
        dw = _col_sum(_rows(dyf * n)).to(weight.dtype)
    if ctx.bias_dtype is not None and ctx.needs_input_grad[2]:
        db = _col_sum(_rows(dyf)).to(ctx.bias_dtype)
    return dx, dw, db, None


def _log_softmax_setup(ctx, inputs, output):
    (x,) = inputs
    ctx.x_dtype = x.dtype
    ctx.save_for_backward(output)


def _log_softmax_backward(ctx, dy):
    (out,) = ctx.saved_tensors
    dyf = dy.float()
    return (dyf - torch.exp(out) * _row_sum(dyf)).to(ctx.x_dtype)


def _row_sum_setup(ctx, inputs, output):
    (x,) = inputs
    ctx.x_shape, ctx.x_dtype = x.shape, x.dtype


def _row_sum_backward(ctx, dy):
    return dy.unsqueeze(-1).expand(ctx.x_shape).to(ctx.x_dtype)


_bi_linear_op.register_autograd(_linear_backward, setup_context=_linear_setup)
_bi_grouped_linear_op.register_autograd(_grouped_linear_backward, setup_context=_grouped_linear_setup)
_bi_rms_norm_op.register_autograd(_rms_norm_backward, setup_context=_rms_norm_setup)
_bi_layer_norm_op.register_autograd(_layer_norm_backward, setup_context=_layer_norm_setup)
_bi_log_softmax_op.register_autograd(_log_softmax_backward, setup_context=_log_softmax_setup)
_bi_row_sum_op.register_autograd(_row_sum_backward, setup_context=_row_sum_setup)


# ---------------------------------------------------------------------------------------------
# public wrappers
# ---------------------------------------------------------------------------------------------


def bi_linear(x, weight, bias=None, *, out_dtype=None):
    """Batch-invariant linear layer, ``glm53::bi_linear``.

    Args:
        x: ``[..., K]`` bf16, fp16 or fp32.
        weight: ``[N, K]`` bf16, fp16 or fp32 (a dtype other than x's computes in FP32 in the kernel).
        bias: optional ``[N]``, added in FP32 after the K reduction.
        out_dtype: the output dtype; ``None`` → x's dtype (FP32 e.g. for the logits of a log-softmax).

    Returns:
        ``x · weightᵀ + bias`` as ``[..., N]`` in ``out_dtype``: FP32 accumulation over K blocks of
        ``BLOCK_K`` (64) in ascending order, one rounding. Invariance contract: each output row is
        bitwise the same whatever the number of rows of ``x`` and the row's position among them.
        Differentiable in every input (deterministic backward by torch.matmul, not batch-invariant;
        see the module docstring).
    """
    out_dtype = getattr(x, "dtype", None) if out_dtype is None else out_dtype  # (x checked below)
    ref.validate_bi_linear_inputs(x, weight, bias, out_dtype)
    return torch.ops.glm53.bi_linear(x, weight, bias, out_dtype)


def bi_grouped_linear(x, weight, offs):
    """Batch-invariant grouped linear layer (the MoE experts), ``glm53::bi_grouped_linear``.

    Args:
        x: ``[M, K]`` bf16, fp16 or fp32, rows sorted by group.
        weight: ``[E, N, K]`` bf16, fp16 or fp32 (a dtype other than x's computes in FP32), one
            ``[N, K]`` weight per group (``Experts.gate_up_proj`` / ``down_proj``).
        offs: int32 ``[E]``, ``offs[e]`` the END row of group e (``torch._grouped_mm``'s ``offs``):
            group e is rows ``[offs[e-1], offs[e])`` (``offs[-1] := 0``); non-decreasing, at most M.

    Returns:
        ``[M, N]`` in x's dtype: row r of group e is ``x[r] · weight[e]ᵀ``, FP32 accumulation over
        K blocks of ``BLOCK_K`` (64) in ascending order, one rounding; rows past ``offs[E-1]`` are 0.
        Invariance contract: every row is BITWISE ``bi_linear(x[r:r+1], weight[e])`` (that row
        alone), so it does not depend on how many rows each group has nor on the other groups (on
        CPU against the CPU reference, on CUDA against the Triton ``bi_linear``). Differentiable in
        x and weight (deterministic; ``torch._grouped_mm`` for BF16 with N, K multiples of 8, else
        batch-invariant kernels; exact zeros for an empty group; see the module docstring); offs
        has no gradient.

    ``ValueError`` on bad dims, dtypes, devices, offs dtype/length or K mismatch; in eager mode
    (never while tracing or capturing) also on offsets that decrease or leave ``[0, M]`` (reads
    offs: a host sync on CUDA). No host read inside the CUDA op: one graph, CUDA-graph capturable.
    """
    ref.validate_bi_grouped_linear_inputs(x, weight, offs)
    if _checks.eager(offs):
        ends = offs.tolist()
        if any(e < 0 or e > x.shape[0] for e in ends) or any(b < a for a, b in zip(ends, ends[1:])):
            raise input_error(f"bi_grouped_linear: offs must be non-decreasing end rows in [0, M={x.shape[0]}], "
                              f"got {ends}")
    return torch.ops.glm53.bi_grouped_linear(x, weight, offs)


def bi_rms_norm(x, weight, eps: float = 1e-6):
    """Batch-invariant RMSNorm with the model's semantics, ``glm53::bi_rms_norm``.

    Args:
        x: ``[..., D]`` bf16, fp16 or fp32.
        weight: ``[D]`` bf16, fp16 or fp32.
        eps: added to the mean square (> 0).

    Returns:
        ``weight · (x / sqrt(mean(x²) + eps)).to(x.dtype)``, normalized in FP32 and rounded to x's dtype,
        then scaled in FP32 and rounded to ``promote_types(x.dtype, weight.dtype)`` (what
        ``graphs.modules.RMSNorm`` returns), ``[..., D]``. Invariance contract: each row bitwise
        independent of the other rows of the call. Differentiable in x and weight.
    """
    ref.validate_bi_rms_norm_inputs(x, weight, eps)
    return torch.ops.glm53.bi_rms_norm(x, weight, float(eps))


def bi_layer_norm(x, weight=None, bias=None, eps: float = 1e-5):
    """Batch-invariant LayerNorm in FP32, ``glm53::bi_layer_norm``.

    Args:
        x: ``[..., D]`` bf16, fp16 or fp32.
        weight, bias: optional ``[D]`` (any float dtype).
        eps: added to the biased variance (> 0).

    Returns:
        ``(x − μ) / sqrt(var + eps) · weight + bias`` computed in FP32 with one rounding to x's dtype,
        ``[..., D]``. Invariance contract: each row bitwise independent of the other rows of the
        call. Differentiable in every input.
    """
    ref.validate_bi_layer_norm_inputs(x, weight, bias, eps)
    return torch.ops.glm53.bi_layer_norm(x, weight, bias, float(eps))


def bi_log_softmax(x):
    """Batch-invariant log-softmax over the last dim, ``glm53::bi_log_softmax``.

    Args:
        x: ``[..., V]`` bf16, fp16 or fp32 (e.g. the FP32 logits of ``bi_linear(..., out_dtype=float32)``).

    Returns:
        FP32 ``[..., V]``: ``(x − m) − log Σ exp(x − m)`` with the fixed-order max ``m`` and sum.
        Invariance contract: each row bitwise independent of the other rows of the call (the
        rollout's and the trainer's log-probabilities of a token agree bitwise whatever the batch).
        Differentiable; the gradient is returned in x's dtype.
    """
    ref.validate_bi_log_softmax_inputs(x)
    return torch.ops.glm53.bi_log_softmax(x)


def bi_row_sum(x):
    """Batch-invariant FP32 sum over the last dim, ``glm53::bi_row_sum`` (the reductions of the
    backward passes above; usable for losses and statistics).

    Args:
        x: ``[..., L]`` bf16, fp16 or fp32.

    Returns:
        FP32 ``[...]``: ``ROW_BLOCK`` lanes accumulated in ascending order, then a halving tree.
    """
    ref.validate_bi_row_sum_inputs(x)
    return torch.ops.glm53.bi_row_sum(x)
