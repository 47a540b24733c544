"""Rounding points that survive Inductor's fusion.

Inductor computes BF16 pointwise work in FP32 and, when it fuses a producer with its consumer,
drops the FP32 → BF16 → FP32 round trip between them (the C++ backend reuses the FP32 value
from its CSE cache; Triton's ``to_dtype`` to BF16 is an FP32 cast), unless the global
``emulate_precision_casts`` is on. An explicit ``.to(torch.bfloat16)`` in a decomposition is
therefore *not* a rounding point. The contracts of ``shared/DESIGN.md`` §4 round at given
places, so the decompositions round with integer arithmetic on the FP32 bits instead, which
no backend elides:

- :func:`exact` on every input: the FP32 value the reference kernel reads (``x.float()``), even
  where the producer's own BF16 rounding was fused away. An identity on a materialized tensor.
- :func:`store` on every output and on intermediate roundings: round to nearest even, as the
  ``.to(torch.bfloat16)`` of the reference does (NaN → the canonical ``0x7FC0``), then cast;
  the cast is exact, so a consumer that skips it still reads the rounded value.

BF16, FP16 and FP32 are covered (the dtypes the ops accept). A decomposition must cover every
input it is given: Inductor refuses to keep an op opaque once it has a decomposition.
"""

from __future__ import annotations

import torch

__all__ = ["round_bf16", "round_fp16", "round_e4m3", "round_to", "exact", "store", "ulp_distance"]

_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_CANONICAL_NAN = 0x7FC00000
_HIGH_HALF = -65536  # 0xFFFF0000 as int32
_E4M3_MANTISSA = -1048576  # 0xFFF00000 as int32: sign, exponent and the top 3 mantissa bits


def round_bf16(xf: torch.Tensor) -> torch.Tensor:
    """FP32 → the nearest BF16 value (ties to even), as FP32, computed on the bits.

    NaN becomes the canonical quiet NaN first, so the integer addition cannot overflow (the
    largest magnitude left is inf, 0x7F800000, and 0x7F800000 + 0x8000 < 2³¹).
    """
    bits = torch.where(torch.isnan(xf), _CANONICAL_NAN, xf.view(torch.int32))
    bits = (bits + (0x7FFF + ((bits >> 16) & 1))) & _HIGH_HALF
    return bits.view(torch.float32)


def round_fp16(xf: torch.Tensor) -> torch.Tensor:
    """FP32 → the nearest FP16 value (ties to even), as FP32. Normal range: the BF16 trick on 13
    dropped bits; below 2⁻¹⁴ the FP16 quantum is the fixed 2⁻²⁴ (``round`` is half-to-even);
    from 65520 (the tie between 65504 and 2¹⁶) up: ±inf; NaN stays NaN."""
    bits = torch.where(torch.isnan(xf), _CANONICAL_NAN, xf.view(torch.int32))
    normal = ((bits + (0xFFF + ((bits >> 13) & 1))) & -8192).view(torch.float32)
    tiny = torch.round(xf * 2.0**24) * 2.0**-24
    mag = xf.abs()
    out = torch.where(mag < 2.0**-14, tiny, normal)
    return torch.where(mag >= 65520.0, xf.sign() * float("inf"), out)


def round_e4m3(vf: torch.Tensor) -> torch.Tensor:
    """FP32 ``vf`` with |vf| <= 448 (or NaN) → the nearest float8_e4m3fn value (ties to even), as
    FP32, without a float8 cast: Inductor (torch 2.11, Triton) ends a fused kernel at a cast to
    float8 and materializes its FP32 input, so a cast inside a decomposition costs an extra full
    write and read. Normal range: the BF16 trick on 20 dropped mantissa bits; below 2⁻⁶ the
    e4m3 quantum is the fixed 2⁻⁹ (``round`` is half-to-even); NaN stays NaN."""
    bits = torch.where(torch.isnan(vf), _CANONICAL_NAN, vf.view(torch.int32))
    normal = ((bits + (0x7FFFF + ((bits >> 20) & 1))) & _E4M3_MANTISSA).view(torch.float32)
    tiny = torch.round(vf * 2.0**9) * 2.0**-9
    return torch.where(vf.abs() < 2.0**-6, tiny, normal)


def round_to(xf: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """FP32 ``xf`` rounded to ``dtype``'s nearest value, kept as FP32."""
    if dtype == torch.bfloat16:
        return round_bf16(xf)
    if dtype == torch.float16:
        return round_fp16(xf)
    if dtype != torch.float32:
        raise ValueError(f"round_to: dtype must be bfloat16, float16 or float32, got {dtype}")
    return xf


def exact(t: torch.Tensor | None) -> torch.Tensor | None:
    """``t.float()`` with ``t``'s own rounding enforced (None passes)."""
    return None if t is None else round_to(t.float(), t.dtype)


def store(yf: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Round FP32 ``yf`` once to ``dtype`` so that fusion cannot skip the rounding."""
    return round_to(yf, dtype).to(dtype)


def ulp_distance(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Per-element distance in units in the last place of ``a``'s dtype: the number of
    representable values between a and b (0 where both are NaN), as int64."""
    if a.dtype != b.dtype or a.dtype not in _DTYPES:
        raise ValueError(f"ulp_distance: need two tensors of one float dtype, got {a.dtype} and {b.dtype}")
    bits, sign = (torch.int32, 0x7FFFFFFF) if a.dtype == torch.float32 else (torch.int16, 0x7FFF)

    def ordered(t):
        i = t.contiguous().view(bits).long()
        return torch.where(i < 0, -(i & sign), i)

    return (ordered(a) - ordered(b)).abs().masked_fill(a.isnan() & b.isnan(), 0)
