"""Public entry points of the ``glm53`` ops: thin wrappers over ``torch.ops.glm53.*``.

Each wrapper checks its inputs (``ValueError`` naming the rule), resolves ``precision=None`` from
the active :class:`~inductor_ext.PrecisionConfig` while tracing (so the choice is a literal in the
graph) and calls the op. Data-dependent checks (finite gates, sorted offsets) synchronise with the
host, so they run only in eager mode: never while Dynamo traces or a CUDA graph is captured.
"""

from __future__ import annotations

import torch

import fake_impls  # noqa: F401  (registers the fake kernels)
from inductor_ext.config import active_config
from inductor_ext.ops import kda as _kda

__all__ = ["kda_chunk", "kda_recurrent"]


def _eager() -> bool:
    if torch.compiler.is_compiling():
        return False
    return not (torch.cuda.is_available() and torch.cuda.is_current_stream_capturing())


def _kda_args(q, k, v, g, beta, scale, initial_state, cu_seqlens, precision):
    _kda.validate_kda_inputs(q, k, v, g, beta, initial_state, cu_seqlens, precision)
    if _eager():
        _kda.check_kda_values(g, cu_seqlens, q.shape[1])
    return q.shape[-1] ** -0.5 if scale is None else float(scale)


def kda_chunk(q, k, v, g, beta, *, scale=None, initial_state=None, cu_seqlens=None, precision=None):
    """KDA chunk computation for training (forward + backward), ``glm53::kda_chunk``.

    Args:
        q, k: ``[B,T,H,K]`` bf16 or fp32 (same dtype), L2-normalized inside; K <= 256.
        v: ``[B,T,H,V]`` bf16 or fp32.
        g: ``[B,T,H,K]`` fp32 log-decay (<= 0, already activated), finite.
        beta: ``[B,T,H]`` bf16 or fp32.
        scale: query scale, default ``K ** -0.5``.
        initial_state: optional fp32 ``[N,H,K,V]``.
        cu_seqlens: optional int64 ``[N+1]`` document offsets (0 ... T, non-decreasing); needs B = 1.
        precision: ``"bf16"`` (flash-linear-attention's BF16 intermediates) or ``"fp32"`` (inputs
            promoted before the L2 norm, every intermediate and the backward in FP32); ``None``
            takes ``PrecisionConfig.kda`` of the active config.

    Returns:
        ``(o, final_state)``: o ``[B,T,H,V]`` in v's dtype, final_state fp32 ``[N,H,K,V]``
        (N = B without cu_seqlens). Differentiable in q, k, v, g, beta and initial_state.
    """
    precision = active_config().kda if precision is None else precision
    scale = _kda_args(q, k, v, g, beta, scale, initial_state, cu_seqlens, precision)
    out = torch.ops.glm53.kda_chunk(q, k, v, g, beta, scale, initial_state, cu_seqlens, precision)
    return out[0], out[1]


def kda_recurrent(q, k, v, g, beta, *, scale=None, initial_state=None, cu_seqlens=None):
    """Serving-reference KDA, ``glm53::kda_recurrent``: the token recurrence with FP32 state and
    FP32 math (inputs promoted before the L2 norm). Forward only; same arguments and returns as
    :func:`kda_chunk` without ``precision``."""
    scale = _kda_args(q, k, v, g, beta, scale, initial_state, cu_seqlens, "fp32")
    return torch.ops.glm53.kda_recurrent(q, k, v, g, beta, scale, initial_state, cu_seqlens)
