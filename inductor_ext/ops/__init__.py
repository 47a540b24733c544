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
from inductor_ext.ops._checks import eager
from inductor_ext.ops import fp8_qdq as _fp8_qdq
from inductor_ext.ops import fp32_linear as _fp32_linear
from inductor_ext.ops import layer_norm_fp32 as _layer_norm_fp32
from inductor_ext.ops import mhc as _mhc
from inductor_ext.ops import swiglu as _swiglu
from inductor_ext.ops import round_to as _round_to  # noqa: F401  (the lowerings' rounding point)

__all__ = ["kda_chunk", "kda_recurrent"]


def _kda_args(q, k, v, g, beta, scale, initial_state, cu_seqlens, precision):
    _kda.validate_kda_inputs(q, k, v, g, beta, initial_state, cu_seqlens, precision)
    if eager():
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
    # residuals only when a backward can follow (a literal in a compiled graph: Dynamo guards on both)
    residuals = torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (q, k, v, g, beta, initial_state))
    out = torch.ops.glm53.kda_chunk(q, k, v, g, beta, scale, initial_state, cu_seqlens, precision, residuals)
    return out[0], out[1]


def kda_recurrent(q, k, v, g, beta, *, scale=None, initial_state=None, cu_seqlens=None):
    """Serving-reference KDA, ``glm53::kda_recurrent``: the token recurrence with FP32 state and
    FP32 math (inputs promoted before the L2 norm). Forward only; same arguments and returns as
    :func:`kda_chunk` without ``precision``."""
    scale = _kda_args(q, k, v, g, beta, scale, initial_state, cu_seqlens, "fp32")
    return torch.ops.glm53.kda_recurrent(q, k, v, g, beta, scale, initial_state, cu_seqlens)


__all__ += ["fp32_linear", "layer_norm_fp32", "swiglu", "fp8_qdq", "mhc_pre", "mhc_post"]


def fp32_linear(x, weight, bias=None):
    """Linear layer in IEEE FP32, ``glm53::fp32_linear``; autocast-safe (autocast is off inside).

    Args:
        x: ``[..., in]`` bf16, fp16 or fp32.
        weight: ``[out, in]`` bf16, fp16 or fp32.
        bias: optional ``[out]``.

    Returns:
        ``x.float() @ weight.float()ᵀ + bias.float()`` as FP32 ``[..., out]``. Differentiable in
        every input; gradients are computed in FP32 and returned in each input's dtype.
    """
    _fp32_linear.validate_fp32_linear_inputs(x, weight, bias)
    return torch.ops.glm53.fp32_linear(x, weight, bias)


def layer_norm_fp32(x, weight=None, bias=None, eps=1e-6):
    """LayerNorm over the last dim computed in FP32, ``glm53::layer_norm_fp32``.

    Args:
        x: ``[..., D]`` bf16, fp16 or fp32.
        weight, bias: optional ``[D]`` (any float dtype; promoted to FP32).
        eps: variance epsilon (default 1e-6, the GLM-5.3 indexer's key norm).

    Returns:
        ``[..., D]`` in x's dtype, rounded once from the FP32 result. Differentiable in x, weight
        and bias (FP32 backward, gradients in the inputs' dtypes).
    """
    _layer_norm_fp32.validate_layer_norm_fp32_inputs(x, weight, bias, eps)
    return torch.ops.glm53.layer_norm_fp32(x, weight, bias, float(eps))


def swiglu(gate, up, *, limit=10.0, mode="serving"):
    """Clamped SwiGLU ``silu(min(gate, limit)) · clamp(up, ±limit)``, ``glm53::swiglu``.

    Args:
        gate, up: same shape ``[...]`` and dtype (bf16, fp16 or fp32).
        limit: ``swiglu_limit`` (> 0, GLM-5.3: 10).
        mode: ``"native"`` (transformers: every step in the input dtype) or ``"serving"`` (FP32
            with silu as ``g / (1 + exp(-g))``, one rounding); ``PrecisionConfig.swiglu`` names it.

    Returns:
        ``[...]`` in the input dtype; differentiable in gate and up.
    """
    _swiglu.validate_swiglu_inputs(gate, up, limit, mode)
    return torch.ops.glm53.swiglu(gate, up, float(limit), mode)


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
    _fp8_qdq.validate_fp8_qdq_inputs(x, scale_fmt)
    out, scales = torch.ops.glm53.fp8_qdq(x, scale_fmt)
    return (out, scales) if return_scale else out


def mhc_pre(x, fn, base, scale, *, norm_eps=1e-5, hc_eps=1e-6, sinkhorn_iters=20):
    """mHC coefficients and stream collapse (transformers ``Glm5NextTextHyperConnection``),
    ``glm53::mhc_pre``; FP32 math.

    Args:
        x: streams ``[..., N, D]`` (GLM-5.3: N = 4), bf16, fp16 or fp32.
        fn: ``[(2+N)·N, N·D]``; base: ``[(2+N)·N]``; scale: ``[3]`` (the module's parameters).
        norm_eps: the stream RMSNorm's epsilon (``rms_norm_eps``); hc_eps: ``hc_eps``;
        sinkhorn_iters: ``hc_sinkhorn_iters``.

    Returns:
        ``(mixed, post, comb)``: the sublayer input ``[..., D]`` in x's dtype, post FP32
        ``[..., N]``, comb FP32 ``[..., N, N]`` (doubly stochastic, rows = input streams).
        Differentiable in x, fn, base and scale.
    """
    _mhc.validate_mhc_pre_inputs(x, fn, base, scale, norm_eps, hc_eps, sinkhorn_iters)
    return torch.ops.glm53.mhc_pre(x, fn, base, scale, float(norm_eps), float(hc_eps), sinkhorn_iters)


def mhc_post(f, residual, post, comb, *, precision=None):
    """mHC expansion ``out[o] = post[o]·f + Σ_s comb[s,o]·residual[s]``, ``glm53::mhc_post``.

    Args:
        f: sublayer output ``[..., D]``, residual's dtype.
        residual: the streams fed to :func:`mhc_pre`, ``[..., N, D]``.
        post ``[..., N]``, comb ``[..., N, N]``: from :func:`mhc_pre` (any float dtype).
        precision: ``"bf16"`` (transformers: in residual's dtype, several roundings) or ``"fp32"``
            (FP32, one rounding); ``None`` takes ``PrecisionConfig.mhc_post`` of the active config.

    Returns:
        ``[..., N, D]`` in residual's dtype; differentiable in every tensor input.
    """
    precision = active_config().mhc_post if precision is None else precision
    _mhc.validate_mhc_post_inputs(f, residual, post, comb, precision)
    return torch.ops.glm53.mhc_post(f, residual, post, comb, precision)


# KPool indexer (wrappers live in inductor_ext/ops/kpool.py)
from inductor_ext.ops.kpool import (  # noqa: E402
    kpool_compress,
    kpool_indexer,
    kpool_layout,
    kpool_logits,
    kpool_project,
    kpool_quant_query,
    kpool_select,
)

__all__ += ["kpool_project", "kpool_layout", "kpool_compress", "kpool_quant_query", "kpool_logits",
            "kpool_select", "kpool_indexer"]
