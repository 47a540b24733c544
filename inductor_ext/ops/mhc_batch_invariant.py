"""Batch-invariant mHC (``PrecisionConfig.batch_invariant``): :func:`mhc_pre_batch_invariant`,
:func:`mhc_post_batch_invariant` and their coefficient op ``glm53::bi_mhc_coefficients``.

Same arguments, outputs and formulas as :func:`~inductor_ext.ops.mhc.mhc_pre` /
:func:`~inductor_ext.ops.mhc.mhc_post` (see :mod:`inductor_ext.ops.mhc`), with every reduction in
an order fixed per row: the stream RMSNorm's mean through ``bi_row_sum``, the projection through
``bi_linear``, the stream sums as ordered FP32 chains (:mod:`inductor_ext.ops.ordered`), and the
coefficients (sigmoids, the softmax over ``o``, the Sinkhorn normalisations) through
``glm53::bi_mhc_coefficients``: one op, so the eager decode launches one kernel instead of ~340 small
ones per call, and a compiled training forward calls the very kernel the decode calls (Inductor does
not re-derive its arithmetic). Its CPU kernel is the ordered-chain reference
(:func:`~inductor_ext.ops.mhc_reference.coefficients_from_projection`, ``invariant=True``); its CUDA kernel is
Triton (:mod:`inductor_ext.kernels.batch_invariant.mhc`; the reference on CUDA when triton is
missing, logged once). Its backward is the FP32 VJP of the reference
(:func:`~inductor_ext.ops.mhc_reference.coefficient_vjp`): gradients are not part of the invariance contract.
"""

from __future__ import annotations

import functools

import torch

from inductor_ext import backends
from inductor_ext.config import active_config
from inductor_ext.ops._checks import input_error, integer, real, tensors
from inductor_ext.ops.batch_invariant import bi_linear, bi_row_sum
from inductor_ext.ops.mhc_reference import (
    coefficient_vjp,
    coefficients_from_projection,
    streams_from_width,
    validate_mhc_post_inputs,
    validate_mhc_pre_inputs,
)
from inductor_ext.ops.ordered import ordered_sum

__all__ = ["mhc_pre_batch_invariant", "mhc_post_batch_invariant", "bi_mhc_coefficients"]

_T = torch.Tensor


def _reference(proj, base, scale, hc_eps, iters):
    """The ordered-chain kernel (every device)."""
    with torch.no_grad():
        pre, post, comb, _ = coefficients_from_projection(proj, base, scale, hc_eps, iters, invariant=True)
    return pre.contiguous(), post.contiguous(), comb.contiguous()


@torch.library.custom_op("glm53::bi_mhc_coefficients", mutates_args=(), device_types="cpu")
def _bi_mhc_coefficients_op(proj: _T, base: _T, scale: _T, hc_eps: float, iters: int) -> tuple[_T, _T, _T]:
    """(pre ``[R, N]``, post ``[R, N]``, comb ``[R, N, N]``) FP32 from the projection ``[R, (2+N)·N]``
    FP32; see :func:`bi_mhc_coefficients`."""
    return _reference(proj, base, scale, hc_eps, iters)


@functools.cache
def _triton_kernel():
    from inductor_ext.kernels.batch_invariant.mhc import bi_mhc_coefficients_rows

    def kernel(proj, base, scale, hc_eps, iters):
        return bi_mhc_coefficients_rows(proj, base.float(), scale.float(), hc_eps, iters)

    return kernel


backends.register_triton("glm53::bi_mhc_coefficients", _triton_kernel, _reference, "the ordered-chain reference")


def _setup(ctx, inputs, output):
    proj, base, scale, hc_eps, iters = inputs
    ctx.consts = (hc_eps, iters)
    ctx.save_for_backward(proj, base, scale)


def _backward(ctx, dpre, dpost, dcomb):
    proj, base, scale = ctx.saved_tensors
    with torch.autocast(proj.device.type, enabled=False):
        *_, saved = coefficients_from_projection(proj, base, scale, *ctx.consts)
        dproj, dbase, dscale = coefficient_vjp(saved, dpre, dpost, dcomb)
    return dproj, dbase.to(base.dtype), dscale.to(scale.dtype), None, None


_bi_mhc_coefficients_op.register_autograd(_backward, setup_context=_setup)


def bi_mhc_coefficients(proj, base, scale, *, hc_eps=1e-6, sinkhorn_iters=20):
    """mHC's coefficients from its projection, each row on its own (``glm53::bi_mhc_coefficients``).

    Args:
        proj: ``z · fnᵀ`` ``[R, (2+N)·N]`` FP32 (z: the RMS-normalised flattened streams); on CUDA,
            N must be a power of two.
        base: ``[(2+N)·N]``; scale: ``[3]`` (the module's parameters, any float dtype).
        hc_eps, sinkhorn_iters: as :func:`~inductor_ext.ops.mhc.mhc_pre`.

    Returns:
        ``(pre, post, comb)`` FP32 ``[R, N]``, ``[R, N]``, ``[R, N, N]`` (the module docstring of
        :mod:`inductor_ext.ops.mhc`); every row bitwise independent of the other rows.
        Differentiable in proj, base and scale.
    """
    tensors("bi_mhc_coefficients", proj=proj, base=base, scale=scale)
    real("bi_mhc_coefficients", "hc_eps", hc_eps, ge=0)
    integer("bi_mhc_coefficients", "sinkhorn_iters", sinkhorn_iters, ge=1)
    if proj.dim() != 2 or proj.dtype != torch.float32:
        raise input_error(f"bi_mhc_coefficients: proj must be [R, (2+N)*N] float32, got "
                          f"{tuple(proj.shape)} {proj.dtype}")
    width = proj.shape[1]
    if tuple(base.shape) != (width,) or tuple(scale.shape) != (3,):
        raise input_error(f"bi_mhc_coefficients: base must be [{width}] and scale [3], got "
                          f"{tuple(base.shape)} and {tuple(scale.shape)}")
    streams_from_width(width)
    return torch.ops.glm53.bi_mhc_coefficients(proj, base, scale, float(hc_eps), sinkhorn_iters)


def mhc_pre_batch_invariant(x, fn, base, scale, *, norm_eps=1e-5, hc_eps=1e-6, sinkhorn_iters=20):
    """:func:`~inductor_ext.ops.mhc.mhc_pre` with batch-invariant reductions (module docstring):
    same arguments, outputs and formula; every row's result is bitwise independent of how many rows
    share the call. Within FP32 rounding of ``mhc_pre``; differentiable."""
    validate_mhc_pre_inputs(x, fn, base, scale, norm_eps, hc_eps, sinkhorn_iters, op="mhc_pre_batch_invariant")
    lead, width = x.shape[:-2], (2 + x.shape[-2]) * x.shape[-2]
    with torch.autocast(x.device.type, enabled=False):
        flat = x.flatten(-2).float()
        mean_square = bi_row_sum(flat.square()).unsqueeze(-1) / flat.shape[-1]
        z = flat * torch.rsqrt(mean_square + float(norm_eps))
        proj = bi_linear(z, fn, out_dtype=torch.float32).reshape(-1, width)
        pre, post, comb = bi_mhc_coefficients(proj, base, scale, hc_eps=hc_eps, sinkhorn_iters=sinkhorn_iters)
        n = pre.shape[1]  # (not view(..., -1): ambiguous with no token)
        pre, post, comb = pre.view(*lead, n), post.view(*lead, n), comb.view(*lead, n, n)
        mixed = ordered_sum(pre.unsqueeze(-1) * x, -2).to(x.dtype)
    return mixed, post, comb


def mhc_post_batch_invariant(f, residual, post, comb, *, precision=None):
    """:func:`~inductor_ext.ops.mhc.mhc_post` with the sum over the N streams in a fixed order (an
    FP32 chain, rounded once to the residual's dtype; the products of ``"bf16"`` taken from comb
    rounded to the residual's dtype, like the matmul's), for ``PrecisionConfig.batch_invariant``;
    same arguments and outputs; differentiable by autograd."""
    precision = active_config().mhc_post if precision is None else precision
    validate_mhc_post_inputs(f, residual, post, comb, precision, op="mhc_post_batch_invariant")
    dtype = residual.dtype
    with torch.autocast(residual.device.type, enabled=False):
        c = comb.to(dtype).float() if precision == "bf16" else comb.float()
        r = residual.float()
        mixed = ordered_sum(c.unsqueeze(-1) * r.unsqueeze(-2), -3)  # Σ_s comb[s, o] · residual[s]
        if precision == "bf16":
            return post.to(dtype).unsqueeze(-1) * f.unsqueeze(-2) + mixed.to(dtype)
        return (post.float().unsqueeze(-1) * f.float().unsqueeze(-2) + mixed).to(dtype)
