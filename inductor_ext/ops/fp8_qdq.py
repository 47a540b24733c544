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

from inductor_ext.ops._checks import input_error, tensors

__all__ = ["fp8_qdq", "GROUP", "FP8_MAX", "AMAX_FLOOR", "SCALE_FMTS", "e4m3_cast", "fp8_qdq_reference", "pow2_ceil",
           "pow2_reciprocal", "scaled_quotient", "validate_fp8_qdq_inputs"]

GROUP = 128
FP8_MAX = 448.0
AMAX_FLOOR = 1e-6
SCALE_FMTS = ("ue8m0", "fp32")
_FLOATS = (torch.bfloat16, torch.float16, torch.float32)


def validate_fp8_qdq_inputs(x, scale_fmt) -> None:
    """Static checks (a tensor, scale format, dtype, device, last dim % 128); raise ``ValueError``."""
    tensors("fp8_qdq", x=x)
    if scale_fmt not in SCALE_FMTS:
        raise input_error(f"fp8_qdq: scale_fmt must be one of {SCALE_FMTS}, got {scale_fmt!r}")
    if x.dtype not in _FLOATS:
        raise input_error(f"fp8_qdq: x must be bfloat16, float16 or float32, got {x.dtype}")
    if x.dim() < 1 or x.shape[-1] % GROUP != 0:
        raise input_error(
            f"fp8_qdq: the last dim must be divisible by the group size {GROUP}, got shape {tuple(x.shape)}"
        )
    if x.device.type not in ("cpu", "cuda"):
        raise input_error(f"fp8_qdq: x must be on cpu or cuda, got {x.device}")


def pow2_ceil(r: torch.Tensor) -> torch.Tensor:
    """2^ceil(log2 r) for positive normal FP32 r (inf for r above 2^127 and for inf), exactly, from
    the bit pattern: adding 2^23 − 1 carries into the exponent unless the mantissa is zero."""
    return ((r.view(torch.int32) + 0x7FFFFF) & 0x7F800000).view(torch.float32)


def pow2_reciprocal(s: torch.Tensor) -> torch.Tensor:
    """1/s for a power of two s in [2^-126, 2^126] (every ue8m0 scale of a finite input), exactly,
    from the bit pattern: ``a · (1/s)`` is then bitwise ``a / s`` at the cost of a multiply.
    0 for s >= 2^127, inf and positive NaN."""
    return ((254 << 23) - s.view(torch.int32)).clamp_min(0).view(torch.float32)


def e4m3_cast(v: torch.Tensor) -> torch.Tensor:
    """FP32 → the FP32 value of its float8_e4m3fn cast (round to nearest even)."""
    return v.to(torch.float8_e4m3fn).float()


def scaled_quotient(a: torch.Tensor, amax: torch.Tensor, scale_fmt: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``(s, a / s)`` for groups ``a [..., G, 128]`` with floored ``amax [..., G, 1]``, FP32.

    ``ue8m0``: ``a · (1/s)``, bitwise ``a / s`` for a power of two. A non-finite amax keeps its
    value as the scale (inf from :func:`pow2_ceil`, NaN by a select) and 1/s is 0, so such a
    group's quotient is 0 or NaN and its output ``q · s`` NaN.
    Both formats give ``|a / s| <= 448·(1 + 2⁻²²)`` (s is ``amax/448`` or above it), which
    e4m3 rounds to 448: the contract's clamp is a no-op that a fused kernel may skip."""
    ratio = amax / FP8_MAX
    if scale_fmt != "ue8m0":
        return ratio, a / ratio
    s = torch.where(ratio.isnan(), ratio, pow2_ceil(ratio))
    return s, a * pow2_reciprocal(s)


def fp8_qdq_reference(x, scale_fmt):
    """Plain-torch kernel (every device): returns (â in x's dtype, FP32 scales ``[..., D/128]``)."""
    a = x.float().reshape(*x.shape[:-1], x.shape[-1] // GROUP, GROUP)
    amax = a.abs().amax(-1, keepdim=True).clamp_min(AMAX_FLOOR)
    s, quotient = scaled_quotient(a, amax, scale_fmt)
    q = e4m3_cast(quotient.clamp(-FP8_MAX, FP8_MAX))
    out = (q * s).to(x.dtype).reshape(x.shape)
    return out.contiguous(), s.squeeze(-1).contiguous()


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
