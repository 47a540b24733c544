"""FP8 quantize-dequantize: constants, input checks and the plain-torch reference kernel of
``glm53::fp8_qdq`` (the contract: :mod:`inductor_ext.ops.fp8_qdq`), with its per-128-group scale,
quotient and e4m3 cast.

A leaf module: the op definition, its lowering (:mod:`lowerings.fp8_qdq`), its fake kernel and the
KPool indexer's FP8 reference (:mod:`inductor_ext.ops.kpool_reference`) import it."""

from __future__ import annotations

import torch

from inductor_ext.ops._checks import input_error, tensors

__all__ = ["GROUP", "FP8_MAX", "AMAX_FLOOR", "SCALE_FMTS", "e4m3_cast", "fp8_qdq_reference", "pow2_ceil",
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
