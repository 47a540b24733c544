"""``glm53::layer_norm_fp32``: LayerNorm over the last dim computed in FP32, output in x's dtype.

Contract (``docs/DESIGN.md`` §4): ``x̂ = (x.float() − μ) / sqrt(σ² + eps)`` with the biased
variance, ``y = x̂ · weight.float() + bias.float()`` (each optional), one rounding to x's dtype.
Autocast is off inside. The backward recomputes μ and rstd in FP32 and returns every gradient in
its input's dtype (one rounding each).
"""

from __future__ import annotations

import torch

from inductor_ext.ops._checks import floats_on_one_device, input_error, real, tensors

__all__ = ["layer_norm_fp32", "layer_norm_fp32_reference", "validate_layer_norm_fp32_inputs"]



def validate_layer_norm_fp32_inputs(x, weight, bias, eps) -> float:
    """Static checks (types, shapes, dtypes, devices, eps a finite number > 0); raise ``ValueError``
    naming the rule. Returns eps as a float."""
    tensors("layer_norm_fp32", optional=("weight", "bias"), x=x, weight=weight, bias=bias)
    eps = real("layer_norm_fp32", "eps", eps, gt=0)
    if x.dim() < 1:
        raise input_error("layer_norm_fp32: x must have at least one dimension [..., D]")
    named = {"x": x}
    for name, t in (("weight", weight), ("bias", bias)):
        if t is None:
            continue
        if tuple(t.shape) != (x.shape[-1],):
            raise input_error(f"layer_norm_fp32: {name} must be [D={x.shape[-1]}], got {tuple(t.shape)}")
        named[name] = t
    floats_on_one_device("layer_norm_fp32", named)
    return eps


def _normalize(xf, eps):
    mean = xf.mean(-1, keepdim=True)
    xc = xf - mean
    rstd = torch.rsqrt(xc.square().mean(-1, keepdim=True) + eps)
    return xc * rstd, rstd


def layer_norm_fp32_reference(x, weight, bias, eps):
    """Plain-torch kernel (every device): FP32 statistics and affine, one rounding to x's dtype."""
    with torch.autocast(x.device.type, enabled=False):
        y, _ = _normalize(x.float(), eps)
        if weight is not None:
            y = y * weight.float()
        if bias is not None:
            y = y + bias.float()
    return y.to(x.dtype).contiguous()


_T = torch.Tensor


@torch.library.custom_op("glm53::layer_norm_fp32", mutates_args=(), device_types=("cpu", "cuda"))
def _layer_norm_fp32_op(x: _T, weight: _T | None, bias: _T | None, eps: float) -> _T:
    """LayerNorm of ``x [..., D]`` with optional ``weight [D]``, ``bias [D]``, computed in FP32;
    output ``[..., D]`` in x's dtype. Kernel: :func:`layer_norm_fp32_reference`."""
    return layer_norm_fp32_reference(x, weight, bias, eps)


def _setup_context(ctx, inputs, output):
    x, weight, bias, eps = inputs
    ctx.eps = eps
    ctx.has_weight, ctx.has_bias = weight is not None, bias is not None
    ctx.bias_dtype = bias.dtype if bias is not None else None
    ctx.save_for_backward(x, weight)


def _backward(ctx, dy):
    x, weight = ctx.saved_tensors
    dx = dw = db = None
    with torch.autocast(x.device.type, enabled=False):
        xhat, rstd = _normalize(x.float(), ctx.eps)
        dyf = dy.float()
        rows = lambda t: t.reshape(-1, t.shape[-1])  # noqa: E731  (sum(()) would reduce every dim)
        if ctx.has_weight and ctx.needs_input_grad[1]:
            dw = rows(dyf * xhat).sum(0).to(weight.dtype)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            db = rows(dyf).sum(0).to(ctx.bias_dtype)
        if ctx.needs_input_grad[0]:
            g = dyf * weight.float() if ctx.has_weight else dyf
            dx = rstd * (g - g.mean(-1, keepdim=True) - xhat * (g * xhat).mean(-1, keepdim=True))
            dx = dx.to(x.dtype)
    return dx, dw, db, None


_layer_norm_fp32_op.register_autograd(_backward, setup_context=_setup_context)


def layer_norm_fp32(x, weight=None, bias=None, eps=1e-6):
    """LayerNorm over the last dim computed in FP32, ``glm53::layer_norm_fp32``.

    Args:
        x: ``[..., D]`` bf16, fp16 or fp32.
        weight, bias: optional ``[D]`` (any float dtype; promoted to FP32).
        eps: variance epsilon, a finite number > 0 (default 1e-6, the GLM-5.3 indexer's key norm).

    Returns:
        ``[..., D]`` in x's dtype, rounded once from the FP32 result. Differentiable in x, weight
        and bias (FP32 backward, gradients in the inputs' dtypes).
    """
    eps = validate_layer_norm_fp32_inputs(x, weight, bias, eps)
    return torch.ops.glm53.layer_norm_fp32(x, weight, bias, eps)
