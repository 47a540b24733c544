"""KDA (Kimi delta attention) ops: ``glm53::kda_chunk`` (+ ``glm53::kda_chunk_bwd``) and
``glm53::kda_recurrent``: schemas, CPU and CUDA kernels, autograd and the public wrappers.

The contract (shapes, numerics, residual layouts) is stated in :mod:`inductor_ext.ops.kda_reference`,
which holds the constants and reference kernels that the GPU kernels share.
"""

from __future__ import annotations

import torch

from inductor_ext import backends
from inductor_ext.config import active_config
from inductor_ext.ops._checks import check_cu_seqlens, eager
from inductor_ext.ops.kda_reference import (
    FP32_KERNEL_MAX_DIM,
    FP32_PRECISIONS,
    OP_PRECISIONS,
    check_kda_values,
    fp32_kernels_apply,
    kda_chunk_bwd_reference_kernel,
    kda_chunk_reference_kernel,
    kda_recurrent_reference,
    validate_kda_inputs,
)

__all__ = ["kda_chunk", "kda_recurrent"]

_T = torch.Tensor


@torch.library.custom_op("glm53::kda_chunk", mutates_args=(), device_types="cpu",
                         tags=(torch.Tag.needs_contiguous_strides,))
def _kda_chunk_op(
    q: _T, k: _T, v: _T, g: _T, beta: _T, scale: float,
    initial_state: _T | None, cu_seqlens: _T | None, precision: str, residuals: bool,
) -> tuple[_T, _T, _T, _T, _T, _T, _T, _T, _T]:
    """KDA chunk forward: (o, final_state, qn, kn, q_rstd, k_rstd, g_cumsum, Aqk, Akk), the
    last seven empty unless ``residuals``. CPU kernel = :func:`kda_chunk_reference`; see the
    module docstring for the contract."""
    return kda_chunk_reference_kernel(q, k, v, g, beta, scale, initial_state, cu_seqlens, precision, residuals)


@torch.library.custom_op("glm53::kda_chunk_bwd", mutates_args=(), device_types="cpu",
                         tags=(torch.Tag.needs_contiguous_strides,))
def _kda_chunk_bwd_op(
    q: _T, k: _T, v: _T, g: _T, beta: _T, scale: float,
    initial_state: _T | None, cu_seqlens: _T | None, precision: str,
    qn: _T, kn: _T, q_rstd: _T, k_rstd: _T, g_cumsum: _T, Aqk: _T, Akk: _T,
    do: _T, dht: _T | None,
) -> tuple[_T, _T, _T, _T, _T, _T]:
    """KDA chunk backward: (dq, dk, dv, dg, dbeta, dh0), each in its input's dtype (dh0 FP32,
    zeros without an initial state). The CPU kernel is the VJP of :func:`kda_chunk_reference`
    recomputed from the inputs; the residuals serve the CUDA kernels."""
    return kda_chunk_bwd_reference_kernel(q, k, v, g, beta, scale, initial_state, cu_seqlens, precision,
                                           qn, kn, q_rstd, k_rstd, g_cumsum, Aqk, Akk, do, dht)


@torch.library.custom_op("glm53::kda_recurrent", mutates_args=(), device_types=("cpu", "cuda"))
def _kda_recurrent_op(
    q: _T, k: _T, v: _T, g: _T, beta: _T, scale: float,
    initial_state: _T | None, cu_seqlens: _T | None,
) -> tuple[_T, _T]:
    """Serving reference, forward only: (o, final_state) of the FP32 token recurrence
    (:func:`kda_recurrent_reference`, plain torch on every device)."""
    with torch.no_grad():
        return tuple(x.contiguous() for x in kda_recurrent_reference(
            q, k, v, g, beta, scale, initial_state, cu_seqlens))


# CUDA kernels through the back-end registry (inductor_ext.backends), in preference order per precision:
# "bf16" flash-linear-attention's kernels; "fp32" and "fp32_causal" the own FP32 kernels (head dims
# <= 128), else flash-linear-attention's on FP32 inputs; the plain-torch reference last.
_FALLBACK = "the plain-torch reference kernel (slow, synchronises with the host)"


def _fp32_why_not(q, v, precision, **_):
    if fp32_kernels_apply(q, v, precision):
        return None
    return (f"head dims K={q.shape[-1]}, V={v.shape[-1]} exceed {FP32_KERNEL_MAX_DIM} (flash-linear-attention's "
            "kernels run the FP32 inputs with TF32 dots, ~1e-3 relative error)")


def _fla_why_not(q, v, precision, **_):
    if fp32_kernels_apply(q, v, precision):  # only when the own kernels are unavailable
        return (f"precision {precision!r} with head dims <= {FP32_KERNEL_MAX_DIM} has the own FP32 kernels' "
                "residual layout")
    return None


def _preference(entry: str, reference_kernel) -> dict:
    """The back-ends of the op whose kernels are ``entry`` of the kernel packages, per precision."""

    def fp32_kernel():
        from inductor_ext.kernels import kda_fp32

        return getattr(kda_fp32, entry)

    def fla_kernel():
        from inductor_ext.kernels import kda_fla

        return getattr(kda_fla, entry)

    own = backends.triton(fp32_kernel, "the own FP32 Triton kernels", why_not=_fp32_why_not)
    fla = backends.Backend("fla", "flash-linear-attention's kernels", fla_kernel, packages=("fla",),
                           why_not=_fla_why_not)
    plain = backends.reference(reference_kernel, _FALLBACK)
    return {p: (own, fla, plain) if p in FP32_PRECISIONS else (fla, plain) for p in OP_PRECISIONS}


backends.register("glm53::kda_chunk", _preference("kda_chunk_fwd", kda_chunk_reference_kernel), by="precision")
backends.register("glm53::kda_chunk_bwd", _preference("kda_chunk_bwd", kda_chunk_bwd_reference_kernel),
                  by="precision")


# autograd: residual outputs are non-differentiable, grads of unused outputs stay None
def _setup_context(ctx, inputs, output):
    q, k, v, g, beta, scale, initial_state, cu_seqlens, precision, residuals = inputs
    ctx.mark_non_differentiable(*output[2:])
    ctx.set_materialize_grads(False)
    ctx.scale, ctx.precision, ctx.residuals = scale, precision, residuals
    ctx.has_initial_state = initial_state is not None
    ctx.save_for_backward(q, k, v, g, beta, initial_state, cu_seqlens, *output[2:])


def _backward(ctx, do, dht, *_residual_grads):
    if not ctx.residuals:
        raise RuntimeError("glm53::kda_chunk ran with residuals=False (forward only); call it with "
                           "residuals=True (inductor_ext.ops.kda_chunk does when a gradient is needed)")
    q, k, v, g, beta, initial_state, cu_seqlens, *residuals = ctx.saved_tensors
    if do is None:
        do = torch.zeros_like(v)
    dq, dk, dv, dg, dbeta, dh0 = torch.ops.glm53.kda_chunk_bwd(
        q, k, v, g, beta, ctx.scale, initial_state, cu_seqlens, ctx.precision, *residuals, do, dht
    )
    return dq, dk, dv, dg, dbeta, None, (dh0 if ctx.has_initial_state else None), None, None, None


_kda_chunk_op.register_autograd(_backward, setup_context=_setup_context)


# ---------------------------------------------------------------------------------------------
# public wrappers (re-exported by inductor_ext.ops)
# ---------------------------------------------------------------------------------------------


def _kda_args(q, k, v, g, beta, scale, initial_state, cu_seqlens, precision):
    """Static checks always; data checks (g, beta, cu_seqlens values) in eager mode, where they read
    the data; traced or captured, the cu_seqlens values are asserted on the device instead."""
    scale = validate_kda_inputs(q, k, v, g, beta, initial_state, cu_seqlens, precision, scale)
    if eager(g, beta, cu_seqlens):
        check_kda_values(g, beta, cu_seqlens, q.shape[1])
    elif cu_seqlens is not None:
        check_cu_seqlens("kda", cu_seqlens, q.shape[1])
    return q.shape[-1] ** -0.5 if scale is None else scale


def kda_chunk(q, k, v, g, beta, *, scale=None, initial_state=None, cu_seqlens=None, precision=None):
    """KDA chunk computation for training (forward + backward), ``glm53::kda_chunk``.

    Args:
        q, k: ``[B,T,H,K]`` bf16 or fp32 (same dtype), L2-normalized inside; K <= 256.
        v: ``[B,T,H,V]`` bf16 or fp32.
        g: ``[B,T,H,K]`` fp32 log-decay (<= 0, already activated), finite.
        beta: ``[B,T,H]`` bf16 or fp32, the write strength, in [0, 1] (a sigmoid in the layer).
        scale: query scale, a finite number > 0; default ``K ** -0.5``.
        initial_state: optional fp32 ``[N,H,K,V]``.
        cu_seqlens: optional int64 ``[N+1]`` document offsets (0 ... T, non-decreasing); needs B = 1.
        precision: ``"bf16"`` (flash-linear-attention's BF16 intermediates) or ``"fp32"`` (inputs
            promoted before the L2 norm, every intermediate and the backward in FP32) or
            ``"fp32_causal"`` (``"fp32"``'s arithmetic; on CUDA the kernel's row-causal decay path,
            so a row never depends on the later rows of its chunk: what ``batch_invariant`` layers
            pass); ``None`` takes ``PrecisionConfig.kda`` of the active config.

    Returns:
        ``(o, final_state)``: o ``[B,T,H,V]`` in v's dtype, final_state fp32 ``[N,H,K,V]``
        (N = B without cu_seqlens). Differentiable in q, k, v, g, beta and initial_state.

    Checks: types, shapes, dtypes, devices and ``scale`` always (``ValueError``, compiled too); the
    data rules (g finite and <= 0, beta in [0, 1], the cu_seqlens values) in eager mode only, as
    they read the data (a host synchronisation). Traced or captured, the cu_seqlens values are
    asserted on the device (``RuntimeError``; on CUDA a device-side assert).
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
