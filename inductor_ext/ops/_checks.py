"""Input checks shared by the op families."""

from __future__ import annotations

import torch

__all__ = ["eager", "check_cu_seqlens_values"]


def eager() -> bool:
    """True outside Dynamo tracing and CUDA-graph capture: only then may a check read data
    (which synchronises with the host)."""
    if torch.compiler.is_compiling():
        return False
    return not (torch.cuda.is_available() and torch.cuda.is_current_stream_capturing())


def check_cu_seqlens_values(op: str, cu_seqlens: torch.Tensor, num_tokens: int) -> None:
    """``cu_seqlens`` must be non-decreasing from 0 to ``num_tokens`` (reads the data: call it in
    eager mode only); ``ValueError`` prefixed with ``op`` otherwise."""
    cu = cu_seqlens.tolist()
    if cu[0] != 0 or cu[-1] != num_tokens or any(b < a for a, b in zip(cu, cu[1:])):
        raise ValueError(f"{op}: cu_seqlens must be non-decreasing from 0 to T={num_tokens}, got {cu}")
