"""``glm53::sparse_mla`` (DSA sparse attention, absorbed MLA form) and ``glm53::sparse_mla_bwd``.

Contract: ``docs/DESIGN.md`` §4 "sparse_mla"; numerics and input rules:
:mod:`inductor_ext.ops.sparse_mla_reference` (the CPU kernels, plain torch). CUDA kernels
(:mod:`inductor_ext.kernels.sparse_mla`), chosen per call by the back-end registry
(:mod:`inductor_ext.backends`) in the order ``tilelang`` (TileLang's warp-specialised kernels, where
they support the geometry: sm_90, H a multiple of 64, D = d_v ∈ {256, 512}, BF16; the ``tilelang``
extra), ``triton``, ``reference`` (plain torch), alike for forward and backward; a back-end passed
over is logged once with its reason. Static output shapes and no host
synchronisation in the ops, so a layer that calls them compiles into one graph and captures into a
CUDA graph. ``token_ids`` get no gradient.
"""

from __future__ import annotations

import torch

from inductor_ext import backends
from inductor_ext.ops import sparse_mla_reference as ref
from inductor_ext.ops._checks import eager

__all__ = ["sparse_mla"]

_T = torch.Tensor
# CPU kernel here, CUDA kernel through the back-end registry below
_DEVICES = "cpu"


@torch.library.custom_op("glm53::sparse_mla", mutates_args=(), device_types=_DEVICES)
def _sparse_mla_op(q: _T, kv: _T, token_ids: _T, scale: float, d_v: int, deterministic: bool) -> tuple[_T, _T]:
    """(out [T, H, d_v] q.dtype, lse [T, H] fp32); see :func:`sparse_mla`. ``deterministic`` only
    selects the backward's dkv accumulation (saved for it)."""
    with torch.no_grad():
        return ref.sparse_mla_reference(q, kv, token_ids, scale, d_v)


@torch.library.custom_op("glm53::sparse_mla_bwd", mutates_args=(), device_types=_DEVICES)
def _sparse_mla_bwd_op(
    q: _T, kv: _T, token_ids: _T, out: _T, lse: _T, dout: _T, dlse: _T, scale: float, d_v: int,
    deterministic: bool,
) -> tuple[_T, _T]:
    """(dq [T, H, D] q.dtype, dkv [S, D] kv.dtype) from the forward's out/lse and the gradients
    (dout, dlse) at them; see :func:`~inductor_ext.ops.sparse_mla_reference.sparse_mla_bwd_reference`."""
    with torch.no_grad():
        return ref.sparse_mla_bwd_reference(q, kv, token_ids, out, lse, dout, dlse, scale, d_v)


def _plain_fwd(q, kv, token_ids, scale, d_v, deterministic):
    with torch.no_grad():
        return ref.sparse_mla_reference(q, kv, token_ids, scale, d_v)


def _plain_bwd(q, kv, token_ids, out, lse, dout, dlse, scale, d_v, deterministic):
    with torch.no_grad():
        return ref.sparse_mla_bwd_reference(q, kv, token_ids, out, lse, dout, dlse, scale, d_v)


def _triton_fwd():
    from inductor_ext.kernels.sparse_mla import sparse_mla_fwd

    def kernel(q, kv, token_ids, scale, d_v, deterministic):
        return sparse_mla_fwd(q, kv, token_ids, scale, d_v)

    return kernel


def _tilelang_fwd():
    from inductor_ext.kernels.sparse_mla.tilelang_forward import sparse_mla_fwd_tilelang

    def kernel(q, kv, token_ids, scale, d_v, deterministic):
        return sparse_mla_fwd_tilelang(q, kv, token_ids, scale, d_v)

    return kernel


def _triton_bwd():
    from inductor_ext.kernels.sparse_mla import sparse_mla_bwd

    def kernel(q, kv, token_ids, out, lse, dout, dlse, scale, d_v, deterministic):
        return sparse_mla_bwd(q, kv, token_ids, out, lse, dout, dlse, scale, d_v, deterministic=deterministic)

    return kernel


def _tilelang_bwd():
    from inductor_ext.kernels.sparse_mla.tilelang_backward import sparse_mla_bwd_tilelang

    def kernel(q, kv, token_ids, out, lse, dout, dlse, scale, d_v, deterministic):
        return sparse_mla_bwd_tilelang(q, kv, token_ids, out, lse, dout, dlse, scale, deterministic=deterministic)

    return kernel


def _tilelang_why_not(q, kv, token_ids, d_v, **_):
    """The geometries of the TileLang forward and backward (one rule for both)."""
    from inductor_ext.kernels.sparse_mla.tilelang_common import unsupported

    return unsupported(q, kv, token_ids, d_v, torch.cuda.get_device_capability(q.device))


def _preference(tilelang_kernel, triton_kernel, plain_kernel):
    """TileLang where it supports the geometry, else Triton, else the reference."""
    # the kernel package imports triton, so the TileLang back-end needs it too
    tilelang = backends.Backend("tilelang", "the TileLang kernels", tilelang_kernel, packages=("triton", "tilelang"),
                                why_not=_tilelang_why_not)
    return (tilelang, backends.triton(triton_kernel, "the Triton kernels"), backends.reference(plain_kernel))


backends.register("glm53::sparse_mla", _preference(_tilelang_fwd, _triton_fwd, _plain_fwd))
backends.register("glm53::sparse_mla_bwd", _preference(_tilelang_bwd, _triton_bwd, _plain_bwd))


def _setup_context(ctx, inputs, output):
    q, kv, token_ids, scale, d_v, deterministic = inputs
    out, lse = output
    # q saved contiguous: a head-major q (the absorbed form's per-head GEMM output, read in place by
    # the forward) saved as is makes Inductor's backward of a graph with a symbolic token count
    # assert the stride it saw at compile time (torch 2.13: "stride 2048==1696" at the next length).
    # One [T, H, D] copy when a gradient is needed; the backward kernels read either layout.
    ctx.save_for_backward(q.contiguous(), kv, token_ids, out, lse)
    ctx.scale, ctx.d_v, ctx.deterministic = scale, d_v, deterministic
    ctx.set_materialize_grads(True)


def _backward(ctx, dout, dlse):
    q, kv, token_ids, out, lse = ctx.saved_tensors
    dq, dkv = torch.ops.glm53.sparse_mla_bwd(q, kv, token_ids, out, lse, dout, dlse, ctx.scale, ctx.d_v,
                                            ctx.deterministic)
    return dq, dkv, None, None, None, None


_sparse_mla_op.register_autograd(_backward, setup_context=_setup_context)


def sparse_mla(q, kv, token_ids, *, scale, d_v=None, return_lse=False, deterministic=True):
    """DSA sparse attention in the absorbed MLA form, ``glm53::sparse_mla`` (forward + backward).

    Every query row ``t`` attends, with all its heads, only to the latent rows listed in
    ``token_ids[t]``; the latent row is the key (all ``D`` columns, shared by the heads) and its
    first ``d_v`` columns the value::

        s[t,h,j] = scale · q[t,h] · kv[ids[t,j]]
        out[t,h] = Σ_j softmax_j(s[t,h,:]) · kv[ids[t,j], :d_v],   lse[t,h] = log Σ_j exp s[t,h,j]

    Args:
        q: ``[T, H, D]`` bf16 (fp16 and fp32 also accepted), the absorbed query; H >= 1.
        kv: ``[S, D]`` in q's dtype, the latent (kv_a_layernorm output) shared by all heads.
        token_ids: ``[T, W]`` int32 or int64, W >= 1: the key rows each query attends to, in any
            order; ``-1`` (anywhere in a row) is padding. Ids must be -1 or in ``[0, S)`` (checked
            in eager mode only: reading them synchronises with the host). An id listed twice
            counts twice. A row of only ``-1`` gives ``out = 0`` and ``lse = -inf``; a NaN in q or in
            a listed kv row gives NaN (never 0). T = 0 gives empty ``out`` and ``lse``.
        scale: the score scale (GLM-5.3: ``qk_nope_head_dim ** -0.5``), a finite number with
            ``0 < scale <= 1e4`` (:data:`~inductor_ext.ops.sparse_mla_reference.MAX_SCALE`: a larger one
            overflows the FP32 scores).
        d_v: value width, ``1 <= d_v <= D``; ``None`` means D.
        return_lse: also return ``lse`` (differentiable).
        deterministic: the backward's ``dkv`` is bitwise repeatable (CUDA: integer atomics into
            an int32 fixed point with one scale per latent row, two fields per 64-bit atomic).
            ``False`` lets the CUDA kernel add FP32 contributions with FP32 atomics (faster,
            order-dependent rounding). No effect on the forward or on the CPU.

    Returns:
        ``out [T, H, d_v]`` in q's dtype, and with ``return_lse`` the tuple ``(out, lse)``,
        ``lse [T, H]`` FP32 natural log.

    Precision: scores, softmax and accumulation in FP32, ``out`` rounded once. The CPU kernel
    computes everything in FP32; the CUDA forward feeds the probabilities to the value MMA rounded
    to the input dtype (one extra rounding per probability; measured ~1.1x the BF16 rounding floor
    of out against FP64). Gradients ``dq``, ``dkv`` (in q's / kv's dtype) are accumulated in
    FP32 (CUDA dkv: fixed point at 2^-29 of each row's bound, measured ~2^-15 of an element) and
    rounded once; ``token_ids`` get none.
    Memory: nothing ``[T, S]`` is ever built; the CPU kernel works on chunks of query rows
    (:data:`~inductor_ext.ops.sparse_mla_reference.CHUNK_BYTES`), the CUDA backward holds an
    ``[S, D]`` accumulator of 4 bytes an element.
    """
    if isinstance(kv, torch.Tensor) and kv.dim() == 2 and d_v is None:
        d_v = kv.shape[1]
    ref.validate_sparse_mla_inputs(q, kv, token_ids, scale, d_v)
    if eager(token_ids):
        ref.check_sparse_mla_ids(token_ids, kv.shape[0])
    out, lse = torch.ops.glm53.sparse_mla(q, kv, token_ids, float(scale), int(d_v), bool(deterministic))
    return (out, lse) if return_lse else out
