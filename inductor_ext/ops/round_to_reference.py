"""Rounding point: the dtypes, input check and plain-torch reference kernel of ``glm53::round_to``
(:mod:`inductor_ext.ops.round_to`).

A leaf module: the op definition and its fake kernel import it."""

from __future__ import annotations

import torch

from inductor_ext.ops._checks import input_error

__all__ = ["ROUNDING_DTYPES", "round_to_reference", "validate_round_to_inputs"]

ROUNDING_DTYPES = (torch.bfloat16, torch.float16, torch.float8_e4m3fn)


def validate_round_to_inputs(x: torch.Tensor, dtype: torch.dtype) -> None:
    """x FP32 and dtype one of :data:`ROUNDING_DTYPES`; raise ``ValueError``."""
    if x.dtype != torch.float32 or dtype not in ROUNDING_DTYPES:
        raise input_error(f"round_to: x must be float32 and dtype one of {ROUNDING_DTYPES}, got {x.dtype}, {dtype}")


def round_to_reference(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Plain-torch kernel (every device): FP32 ``x`` → ``x.to(dtype).float()``."""
    validate_round_to_inputs(x, dtype)
    return x.to(dtype).float()
