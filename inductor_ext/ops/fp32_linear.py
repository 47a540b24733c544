"""``glm53::fp32_linear``: a linear layer computed in IEEE FP32 whatever the input dtypes.

Contract (``docs/DESIGN.md`` §4): ``y = x.float() @ weight.float()ᵀ (+ bias.float())``, output
FP32. Autocast is switched off inside the kernel and the backward (a custom op without an autocast
kernel would otherwise run its matmul under the caller's autocast dtype), and nothing global is set:
on CUDA the FP32 matmul is IEEE as long as the caller keeps PyTorch's default
``torch.backends.cuda.matmul.allow_tf32 = False`` / ``float32_matmul_precision("highest")``.
Gradients are computed in FP32 and returned in each input's dtype.
"""

from __future__ import annotations

import torch

from inductor_ext.ops._checks import input_error, tensors

__all__ = ["fp32_linear", "fp32_linear_reference", "validate_fp32_linear_inputs"]

_FLOATS = (torch.bfloat16, torch.float16, torch.float32)


def validate_fp32_linear_inputs(x, weight, bias) -> None:
    """Static checks (types, shapes, dtypes, devices); raise ``ValueError`` naming the rule."""
    tensors("fp32_linear", optional=("bias",), x=x, weight=weight, bias=bias)
    named = {"x": x, "weight": weight}
    if bias is not None:
        named["bias"] = bias
    for name, t in named.items():
        if t.dtype not in _FLOATS:
            raise input_error(f"fp32_linear: {name} must be bfloat16, float16 or float32, got {t.dtype}")
    if x.dim() < 1:
        raise input_error("fp32_linear: x must have at least one dimension [..., in_features]")
    if weight.dim() != 2 or weight.shape[1] != x.shape[-1]:
        raise input_error(
            f"fp32_linear: weight must be [out_features, in_features={x.shape[-1]}], got {tuple(weight.shape)}"
        )
    if bias is not None and tuple(bias.shape) != (weight.shape[0],):
        raise input_error(f"fp32_linear: bias must be [out_features={weight.shape[0]}], got {tuple(bias.shape)}")
    devices = {t.device for t in named.values()}
    if len(devices) != 1:
        raise input_error(f"fp32_linear: all tensors must be on one device, got {sorted(map(str, devices))}")
    if x.device.type not in ("cpu", "cuda"):
        raise input_error(f"fp32_linear: tensors must be on cpu or cuda, got {x.device}")


def fp32_linear_reference(x, weight, bias):
    """Plain-torch kernel (every device): one FP32 GEMM with autocast off, the bias added by the GEMM
    (``addmm``, as ``F.linear`` does) rather than by a separate add: Inductor folds ``mm + bias``
    into ``addmm`` itself, so only this form gives the same bits compiled and eager. Returns FP32
    ``[..., out]``."""
    with torch.autocast(x.device.type, enabled=False):
        rows, w = x.float().reshape(-1, x.shape[-1]), weight.float().t()
        y = torch.mm(rows, w) if bias is None else torch.addmm(bias.float(), rows, w)
    return y.reshape(*x.shape[:-1], weight.shape[0])


_T = torch.Tensor


@torch.library.custom_op("glm53::fp32_linear", mutates_args=(), device_types=("cpu", "cuda"))
def _fp32_linear_op(x: _T, weight: _T, bias: _T | None) -> _T:
    """``x [..., in]`` (bf16/fp16/fp32) · ``weight [out, in]``ᵀ + ``bias [out]`` in IEEE FP32 →
    FP32 ``[..., out]``. Kernel: :func:`fp32_linear_reference`."""
    return fp32_linear_reference(x, weight, bias)


def _setup_context(ctx, inputs, output):
    x, weight, bias = inputs
    ctx.has_bias = bias is not None
    ctx.bias_dtype = bias.dtype if bias is not None else None
    ctx.save_for_backward(x, weight)


def _backward(ctx, dy):
    x, weight = ctx.saved_tensors
    dx = dw = db = None
    with torch.autocast(x.device.type, enabled=False):
        dyf = dy.float()
        if ctx.needs_input_grad[0]:
            dx = torch.matmul(dyf, weight.float()).to(x.dtype)
        if ctx.needs_input_grad[1]:
            dy2 = dyf.reshape(-1, dyf.shape[-1])
            dw = torch.matmul(dy2.t(), x.float().reshape(-1, x.shape[-1])).to(weight.dtype)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            db = dyf.reshape(-1, dyf.shape[-1]).sum(0).to(ctx.bias_dtype)
    return dx, dw, db


_fp32_linear_op.register_autograd(_backward, setup_context=_setup_context)


def fp32_linear(x, weight, bias=None):
    """Linear layer in IEEE FP32, ``glm53::fp32_linear``; autocast-safe (autocast is off inside).

    Args:
        x: ``[..., in]`` bf16, fp16 or fp32.
        weight: ``[out, in]`` bf16, fp16 or fp32.
        bias: optional ``[out]``.

    Returns:
        ``x.float() @ weight.float()ᵀ + bias.float()`` as FP32 ``[..., out]``. Differentiable in
        every input; gradients are computed in FP32 and returned in each input's dtype.
    """
    validate_fp32_linear_inputs(x, weight, bias)
    return torch.ops.glm53.fp32_linear(x, weight, bias)
