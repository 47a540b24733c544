"""Rounding points that survive Inductor's fusion.

Inductor computes BF16 pointwise work in FP32 and, when it fuses a producer with its consumer,
drops the FP32 → BF16 → FP32 round trip between them (the C++ backend reuses the FP32 value
from its CSE cache; Triton's ``to_dtype`` to BF16 is an FP32 cast), unless the global
``emulate_precision_casts`` is on; and a float8 cast ends a fused Triton kernel (torch 2.11),
materializing its FP32 input. An explicit ``.to(torch.bfloat16)`` in a decomposition is
therefore *not* a rounding point. The contracts of ``shared/DESIGN.md`` §4 round at given
places, so the decompositions round to BF16 / FP16 through ``glm53::round_to``
(``inductor_ext/ops/round_to.py``), lowered to the hardware conversion and back inside the fused
kernel (two instructions; the integer-bit emulation used before cost ~9 per rounding and made the
fused SwiGLU + FP8 QDQ kernel instruction-bound on the H200), and to e4m3 with integer bit
arithmetic (:func:`round_e4m3`): lowered the same way, the float8 conversion turned the fused
kernel from a one-pass persistent reduction into a two-pass one on the H200 (96 vs 78 µs).

- :func:`exact` on every input: the FP32 value the reference kernel reads (``x.float()``), even
  where the producer's own BF16 rounding was fused away. An identity on a materialized tensor.
- :func:`store` on every output and on intermediate roundings: round to nearest even, as the
  ``.to(dtype)`` of the reference does, then cast; the cast is exact, so a consumer that skips
  it still reads the rounded value.
- :func:`round_e4m3`: the e4m3 rounding of the FP8 QDQ.

A decomposition must cover every input it is given: Inductor refuses to keep an op opaque once it
has a decomposition.
"""

from __future__ import annotations

import torch

import inductor_ext.ops.round_to  # noqa: F401  (defines glm53::round_to)

__all__ = ["round_to", "round_e4m3", "exact", "store", "ulp_distance"]

_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_CANONICAL_NAN = 0x7FC00000
_E4M3_MANTISSA = -1048576  # 0xFFF00000 as int32: sign, exponent and the top 3 mantissa bits


def round_to(xf: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """FP32 ``xf`` rounded to ``dtype``'s nearest value (ties to even), kept as FP32; FP32 is the
    identity."""
    if dtype == torch.float32:
        return xf
    return torch.ops.glm53.round_to(xf, dtype)


def round_e4m3(vf: torch.Tensor) -> torch.Tensor:
    """FP32 ``vf`` with |vf| <= 448 (or NaN) → the nearest float8_e4m3fn value (ties to even), as
    FP32, from the bits. Normal range: round to nearest even on 20 dropped mantissa bits (NaN made
    canonical first, so the addition cannot overflow); below 2⁻⁶ the e4m3 quantum is the fixed 2⁻⁹
    (``round`` is half-to-even); NaN stays NaN."""
    bits = torch.where(torch.isnan(vf), _CANONICAL_NAN, vf.view(torch.int32))
    normal = ((bits + (0x7FFFF + ((bits >> 20) & 1))) & _E4M3_MANTISSA).view(torch.float32)
    tiny = torch.round(vf * 2.0**9) * 2.0**-9
    return torch.where(vf.abs() < 2.0**-6, tiny, normal)


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
