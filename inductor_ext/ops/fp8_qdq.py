"""``glm53::fp8_qdq``: per-128-group FP8 (e4m3) quantize-dequantize of activations.

Contract (``docs/DESIGN.md`` §4), per contiguous group ``a`` of 128 elements of the last dim,
computed in FP32 from the input::

    amax = max(max|a|, 1e-6)
    s    = 2^ceil(log2(amax / 448))      scale_fmt "ue8m0" (a power of two, UE8M0-representable)
         = amax / 448                     scale_fmt "fp32"
    q    = clamp(a / s, −448, 448) → float8_e4m3fn (round to nearest even)
    â    = (q.float() · s) → x's dtype

``ceil(log2(·))`` is taken from the FP32 bits (exponent, plus one when the mantissa is non-zero),
as the serving quantizers do: ``torch.log2`` rounds values just above a power of two down onto it
and would pick a scale half as large. A group holding inf or NaN gets the scale inf or NaN
(``1/s`` = 0 or NaN) and comes out all NaN. The op returns ``(â, s)``; s is FP32 ``[..., D/128]`` and not
differentiable. The backward is the straight-through identity, ``dx = dâ`` in x's dtype.
"""

from __future__ import annotations

import torch

from inductor_ext.ops.fp8_qdq_reference import fp8_qdq_reference, validate_fp8_qdq_inputs

__all__ = ["fp8_qdq"]

_T = torch.Tensor


@torch.library.custom_op("glm53::fp8_qdq", mutates_args=(), device_types=("cpu", "cuda"))
def _fp8_qdq_op(x: _T, scale_fmt: str) -> tuple[_T, _T]:
    """FP8 e4m3 quantize-dequantize of ``x [..., D]`` (D % 128 == 0) per 128 group:
    (â ``[..., D]`` in x's dtype, scales FP32 ``[..., D/128]``). Kernel: :func:`fp8_qdq_reference`."""
    return fp8_qdq_reference(x, scale_fmt)


def _setup_context(ctx, inputs, output):
    ctx.mark_non_differentiable(output[1])
    ctx.set_materialize_grads(False)
    ctx.x_dtype = inputs[0].dtype


def _backward(ctx, dout, _dscale):
    if dout is None:
        return None, None
    return dout.to(ctx.x_dtype), None  # straight-through estimator


_fp8_qdq_op.register_autograd(_backward, setup_context=_setup_context)


def fp8_qdq(x, *, scale_fmt="ue8m0", return_scale=False):
    """FP8 e4m3 quantize-dequantize per contiguous 128 group of the last dim, ``glm53::fp8_qdq``.

    Args:
        x: ``[..., D]`` bf16, fp16 or fp32 with D % 128 == 0.
        scale_fmt: ``"ue8m0"`` (scale ``2^ceil(log2(amax/448))``) or ``"fp32"`` (``amax/448``);
            amax = max|group| floored at 1e-6. Computed in FP32 from x.
        return_scale: also return the FP32 scales ``[..., D/128]``.

    Returns:
        â ``[..., D]`` in x's dtype (``e4m3(clamp(x/s, ±448)) · s``), or ``(â, scales)``. The
        backward is the straight-through identity.
    """
    validate_fp8_qdq_inputs(x, scale_fmt)
    out, scales = torch.ops.glm53.fp8_qdq(x, scale_fmt)
    return (out, scales) if return_scale else out
