"""CUDA kernels of ``glm53::kda_chunk`` / ``kda_chunk_bwd`` on flash-linear-attention's KDA chunk kernels
(fla-core 0.6.0): :func:`kda_chunk_fwd` and :func:`kda_chunk_bwd` (from :mod:`.glue`), and the glue's own
Triton kernel :func:`.mask.zero_above_chunk_diagonal`.

:mod:`.glue` imports fla; it is imported on the first access to ``kda_chunk_fwd`` or ``kda_chunk_bwd``, so
that :mod:`.mask` imports without fla.
"""

from __future__ import annotations

__all__ = ["kda_chunk_fwd", "kda_chunk_bwd"]


def __getattr__(name: str):
    if name in __all__:
        from inductor_ext.kernels.kda_fla import glue

        return getattr(glue, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
