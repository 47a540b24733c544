"""mHC (manifold-constrained hyper-connections) ops: ``glm53::mhc_pre`` and ``glm53::mhc_post``.

Semantics of transformers ``Glm5NextTextHyperConnection`` and its use in
``Glm5NextTextDecoderLayer`` (N = ``hc_mult`` = 4 streams, ``hc_sinkhorn_iters`` = 20, ``hc_eps`` =
1e-6, the stream RMSNorm uses ``rms_norm_eps``). Parameters carry transformers' names: ``fn``
``[(2+N)·N, N·D]``, ``base`` ``[(2+N)·N]``, ``scale`` ``[3]``.

``mhc_pre(x [..., N, D])``, all in FP32 from x::

    z = flatten(x) · rsqrt(mean(flatten(x)²) + norm_eps)          [..., N·D]
    pre_w, post_w, comb_w = split(z · fnᵀ, [N, N, N·N])
    pre  = σ(pre_w·scale[0] + base_pre) + hc_eps                  [..., N]
    post = 2·σ(post_w·scale[1] + base_post)                       [..., N]
    comb = softmax(comb_w·scale[2] + base_comb, over o) + hc_eps  [..., N(s), N(o)]
    comb ← comb / (colsum + hc_eps); then (iters − 1) × (row, column) normalisations
    mixed = Σ_s pre[s] · x[s]  → x's dtype                        [..., D]

returns ``(mixed, post, comb)`` (post, comb FP32): the sublayer input and the coefficients of
``mhc_post``. Its backward is written out in FP32 (Sinkhorn steps recomputed), each gradient
rounded once to its input's dtype.

``mhc_post(f [..., D], residual [..., N, D], post, comb, precision)``: out ``[..., N, D]`` =
``post[o]·f + Σ_s comb[s,o]·residual[s]``. ``"bf16"``: transformers semantics in the residual's dtype
(post and comb rounded to it, product and matmul rounded, then the sum rounded); its backward is
the chain of autograd formulas transformers gets. ``"fp32"``: computed in FP32, one rounding; the
backward in FP32, one rounding per gradient.

The batch-invariant variants (``PrecisionConfig.batch_invariant``) live in
:mod:`inductor_ext.ops.mhc_batch_invariant`; they share the coefficient math
(:func:`~inductor_ext.ops.mhc_reference.coefficients_from_projection`,
:func:`~inductor_ext.ops.mhc_reference.coefficient_vjp`) with these ops. Checks and reference
kernels: :mod:`inductor_ext.ops.mhc_reference`.
"""

from __future__ import annotations

import torch

from inductor_ext.config import active_config
from inductor_ext.ops.mhc_reference import (
    mhc_post_backward_reference,
    mhc_post_reference,
    mhc_pre_backward_reference,
    mhc_pre_reference,
    validate_mhc_post_inputs,
    validate_mhc_pre_inputs,
)

__all__ = ["mhc_pre", "mhc_post"]

_T = torch.Tensor


@torch.library.custom_op("glm53::mhc_pre", mutates_args=(), device_types=("cpu", "cuda"))
def _mhc_pre_op(x: _T, fn: _T, base: _T, scale: _T, norm_eps: float, hc_eps: float,
            sinkhorn_iters: int) -> tuple[_T, _T, _T]:
    """mHC collapse: (mixed ``[..., D]`` x's dtype, post FP32 ``[..., N]``, comb FP32 ``[..., N, N]``)
    from streams ``x [..., N, D]``. Kernel: :func:`mhc_pre_reference`."""
    return mhc_pre_reference(x, fn, base, scale, norm_eps, hc_eps, sinkhorn_iters)


@torch.library.custom_op("glm53::mhc_post", mutates_args=(), device_types=("cpu", "cuda"))
def _mhc_post_op(f: _T, residual: _T, post: _T, comb: _T, precision: str) -> _T:
    """mHC expansion: ``[..., N, D]`` = post[o]·f + Σ_s comb[s,o]·residual[s] in residual's dtype;
    precision "bf16" | "fp32". Kernel: :func:`mhc_post_reference`."""
    return mhc_post_reference(f, residual, post, comb, precision)


def _pre_setup(ctx, inputs, output):
    x, fn, base, scale, norm_eps, hc_eps, iters = inputs
    ctx.consts = (norm_eps, hc_eps, iters)
    ctx.save_for_backward(x, fn, base, scale)


def _pre_backward(ctx, dmixed, dpost, dcomb):
    x, fn, base, scale = ctx.saved_tensors
    with torch.autocast(x.device.type, enabled=False):
        grads = mhc_pre_backward_reference(x, fn, base, scale, *ctx.consts, dmixed, dpost, dcomb)
    return (*grads, None, None, None)


def _post_setup(ctx, inputs, output):
    f, residual, post, comb, precision = inputs
    ctx.precision = precision
    ctx.save_for_backward(f, residual, post, comb)


def _post_backward(ctx, dout):
    f, residual, post, comb = ctx.saved_tensors
    with torch.autocast(f.device.type, enabled=False):
        df, dres, dpost, dcomb = mhc_post_backward_reference(f, residual, post, comb, ctx.precision, dout)
    return (df.to(f.dtype), dres.to(residual.dtype), dpost.to(post.dtype),
            dcomb.to(comb.dtype), None)


_mhc_pre_op.register_autograd(_pre_backward, setup_context=_pre_setup)
_mhc_post_op.register_autograd(_post_backward, setup_context=_post_setup)


def mhc_pre(x, fn, base, scale, *, norm_eps=1e-5, hc_eps=1e-6, sinkhorn_iters=20):
    """mHC coefficients and stream collapse (transformers ``Glm5NextTextHyperConnection``),
    ``glm53::mhc_pre``; FP32 math.

    Args:
        x: streams ``[..., N, D]`` (GLM-5.3: N = 4), bf16, fp16 or fp32.
        fn: ``[(2+N)·N, N·D]``; base: ``[(2+N)·N]``; scale: ``[3]`` (the module's parameters).
        norm_eps: the stream RMSNorm's epsilon (``rms_norm_eps``); hc_eps: ``hc_eps``;
        sinkhorn_iters: ``hc_sinkhorn_iters``.

    Returns:
        ``(mixed, post, comb)``: the sublayer input ``[..., D]`` in x's dtype, post FP32
        ``[..., N]``, comb FP32 ``[..., N, N]`` (doubly stochastic, rows = input streams).
        Differentiable in x, fn, base and scale.
    """
    validate_mhc_pre_inputs(x, fn, base, scale, norm_eps, hc_eps, sinkhorn_iters)
    return torch.ops.glm53.mhc_pre(x, fn, base, scale, float(norm_eps), float(hc_eps), sinkhorn_iters)


def mhc_post(f, residual, post, comb, *, precision=None):
    """mHC expansion ``out[o] = post[o]·f + Σ_s comb[s,o]·residual[s]``, ``glm53::mhc_post``.

    Args:
        f: sublayer output ``[..., D]``, residual's dtype.
        residual: the streams fed to :func:`mhc_pre`, ``[..., N, D]``.
        post ``[..., N]``, comb ``[..., N, N]``: from :func:`mhc_pre` (any float dtype).
        precision: ``"bf16"`` (transformers: in residual's dtype, several roundings) or ``"fp32"``
            (FP32, one rounding); ``None`` takes ``PrecisionConfig.mhc_post`` of the active config.

    Returns:
        ``[..., N, D]`` in residual's dtype; differentiable in every tensor input.
    """
    precision = active_config().mhc_post if precision is None else precision
    validate_mhc_post_inputs(f, residual, post, comb, precision)
    return torch.ops.glm53.mhc_post(f, residual, post, comb, precision)
