"""Rounding points and clamps that survive Inductor's fusion cheaply.

Inductor computes BF16 pointwise work in FP32 and, when it fuses a producer with its consumer,
drops the FP32 → BF16 → FP32 round trip between them (the C++ backend reuses the FP32 value
from its CSE cache; Triton's ``to_dtype`` to BF16 is an FP32 cast), unless the global
``emulate_precision_casts`` is on. The contracts of ``docs/DESIGN.md`` §4 round at given
places, so the decompositions round through ``glm53::round_to`` (``inductor_ext/ops/round_to.py``),
lowered to the hardware conversion and back inside the fused kernel: BF16 / FP16, and e4m3
(Triton's ``cvt.rn.satfinite.e4m3x2``; no float8 tensor appears in the graph, and on the
H200 the aligned SwiGLU + FP8 QDQ stays one kernel with it).

- :func:`exact` on every input: the FP32 value the reference kernel reads (``x.float()``), even
  where the producer's own BF16 rounding was fused away. An identity on a materialized tensor.
- :func:`store` on every output and on intermediate roundings: round to nearest even, as the
  ``.to(dtype)`` of the reference does, then cast; the cast is exact, so a consumer that skips
  it still reads the rounded value.
- :func:`clamp_select`: ``clamp`` as compare-and-select. Inductor's ``minimum`` / ``maximum``
  add a NaN test to each compare; these clamps keep NaN by construction (every compare with
  NaN is false); Triton compiles them to one ``min.NaN`` / ``max.NaN`` each. On the H200 the
  NaN-tested clamps were the largest per-element cost of the fused SwiGLU + FP8 QDQ kernel.

A decomposition must cover every input it is given: Inductor refuses to keep an op opaque once it
has a decomposition.
"""

from __future__ import annotations

import torch

import inductor_ext.ops.round_to  # noqa: F401  (defines glm53::round_to)

__all__ = ["round_to", "clamp_select", "exact", "store", "ulp_distance"]

_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def round_to(xf: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """FP32 ``xf`` rounded to ``dtype``'s nearest value (ties to even), kept as FP32; FP32 is the
    identity (see ``glm53::round_to`` for the e4m3 range)."""
    if dtype == torch.float32:
        return xf
    return torch.ops.glm53.round_to(xf, dtype)


def clamp_select(x: torch.Tensor, lo: float | None, hi: float | None) -> torch.Tensor:
    """``x.clamp(lo, hi)`` bitwise (NaN and −0 kept) as ``where(x > hi, hi, where(x < lo, lo, x))``;
    ``x`` a float tensor of any shape, the result in its dtype; None leaves that side open."""
    if lo is not None:
        x = torch.where(x < lo, lo, x)
    return x if hi is None else torch.where(x > hi, hi, x)


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
