"""``glm53::round_to``: an FP32 tensor rounded to a narrower float dtype, returned as FP32.

The rounding point of the Inductor decompositions (:mod:`lowerings._rounding`), not a precision
path of its own: ``round_to(x, dtype) == x.to(dtype).float()`` (round to nearest even; NaN stays
NaN) for ``dtype`` in bfloat16, float16 and float8_e4m3fn (e4m3 only for ``|x| <= 464`` or NaN:
beyond, the CPU cast gives NaN and the GPU's saturating conversion 448). Inductor fuses a plain
``x.to(bfloat16).float()`` into one FP32 value (it drops the round trip), so the decompositions
call this op instead: its Inductor lowering (:func:`lowerings._compat.register_rounding_lowering`)
emits the hardware conversion and back *inside* the fused kernel, where no pass removes it.
"""

from __future__ import annotations

import torch

from inductor_ext.ops.round_to_reference import round_to_reference

__all__ = ["round_to"]


@torch.library.custom_op("glm53::round_to", mutates_args=(), device_types=("cpu", "cuda"))
def round_to(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """FP32 ``x`` rounded to ``dtype`` (bfloat16, float16 or float8_e4m3fn), as FP32.
    Kernel: :func:`round_to_reference`."""
    return round_to_reference(x, dtype)
