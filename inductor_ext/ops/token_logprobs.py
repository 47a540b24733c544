"""``glm53::token_logprobs`` and ``glm53::token_logprobs_bwd``: per-token log-probabilities (and
entropy) of the next-token targets straight from the final hidden state and the lm_head weight,
chunked over the vocabulary so no ``[T, V]`` tensor exists in the forward or the backward.

Contract (``docs/DESIGN.md`` §4 "token_logprobs"), the serving engine's arithmetic::

    logits  = (hidden · weightᵀ)            FP32 accumulation, rounded to hidden's dtype
    z       = logits.float() / temperature  cast first, then an FP32 (IEEE) division
    lse     = log Σ_v exp(z_v)              FP32, max-subtracted, accumulated over the chunks
    logprob = z[target] − lse
    entropy = lse − Σ_v p_v·z_v             (p = exp(z − lse)), FP32

``targets == -100`` (transformers' ``ignore_index``) gives logprob 0 and entropy 0 and no gradient.
Vocabulary chunks of ``CHUNK_V`` (4096) weight rows with an online log-sum-exp: memory
``O(T·D + T·CHUNK_V)``. Numerics and the backward formula: :mod:`inductor_ext.ops.token_logprobs_reference`
(the CPU kernels). The op returns ``(logprobs, entropy, lse)`` (entropy ``[0]`` unless asked for;
``lse`` is saved for the backward, which recomputes each chunk's logits); gradients of hidden and
weight (FP32 GEMMs, rounded once), none for targets.

``batch_invariant=True``: each row's results bitwise independent of the other rows of the call —
the logits by the fixed-K-order product (``bi_linear``'s arithmetic: the CPU reference; on CUDA the
``glm53::bi_linear`` Triton kernel), the row reductions in a fixed order. The backward is
deterministic, not batch-invariant (``docs/DESIGN.md`` §9).

CUDA: the chunk's logits by ``torch.matmul`` (``F.linear``; ``glm53::bi_linear`` when batch-invariant),
the online log-sum-exp, gather and the final values in a Triton kernel (one program per
``BLOCK_T`` rows, ``BLOCK_V``-column tiles; :mod:`inductor_ext.kernels.token_logprobs`); without
triton the plain-torch reference (logged once). The backward is the chunked reference on every
device. No host synchronisation and static output shapes: one graph under ``torch.compile``.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from inductor_ext import backends
from inductor_ext.ops import token_logprobs_reference as ref
from inductor_ext.ops._checks import eager

__all__ = ["token_logprobs", "IGNORE_INDEX", "CHUNK_V"]

IGNORE_INDEX, CHUNK_V = ref.IGNORE_INDEX, ref.CHUNK_V
_T = torch.Tensor
_FALLBACK = "the plain-torch reference kernel (chunked)"


@torch.library.custom_op("glm53::token_logprobs", mutates_args=(), device_types="cpu")
def _token_logprobs_op(hidden: _T, weight: _T, targets: _T, temperature: float, batch_invariant: bool,
                       return_entropy: bool) -> tuple[_T, _T, _T]:
    """``(logprobs [T], entropy [T] or [0], lse [T])`` FP32; see :func:`token_logprobs`."""
    with torch.no_grad():
        return ref.token_logprobs_reference(hidden, weight, targets, temperature, batch_invariant, return_entropy)


@torch.library.custom_op("glm53::token_logprobs_bwd", mutates_args=(), device_types="cpu")
def _token_logprobs_bwd_op(hidden: _T, weight: _T, targets: _T, lse: _T, entropy: _T, grad_logprobs: _T,
                           grad_entropy: _T, grad_lse: _T, temperature: float, batch_invariant: bool,
                           return_entropy: bool) -> tuple[_T, _T]:
    """``(grad_hidden [T, D], grad_weight [V, D])`` in the inputs' dtypes, the logits recomputed chunk
    by chunk; see :func:`~inductor_ext.ops.token_logprobs_reference.token_logprobs_bwd_reference`."""
    with torch.no_grad():
        return ref.token_logprobs_bwd_reference(hidden, weight, targets, lse, entropy, grad_logprobs, grad_entropy,
                                                grad_lse, temperature, batch_invariant, return_entropy)


# CUDA: the logits of a chunk from the device's GEMM (glm53::bi_linear's Triton kernel when
# batch-invariant), the rest in Triton; the backward: the reference with the same logits.


def _cuda_matmul(batch_invariant: bool):
    if batch_invariant:
        return lambda h, w: torch.ops.glm53.bi_linear(h, w, None, h.dtype)
    return F.linear


def _plain_fwd(hidden, weight, targets, temperature, batch_invariant, return_entropy):
    with torch.no_grad():
        return ref.token_logprobs_reference(hidden, weight, targets, temperature, batch_invariant, return_entropy,
                                            matmul=_cuda_matmul(batch_invariant))


@functools.cache
def _triton_fwd():
    from inductor_ext.kernels.token_logprobs import token_logprobs_fwd

    def kernel(hidden, weight, targets, temperature, batch_invariant, return_entropy):
        with torch.no_grad():
            return token_logprobs_fwd(hidden, weight, targets, temperature, return_entropy,
                                      _cuda_matmul(batch_invariant), ref.CHUNK_V, ref.BLOCK_T, ref.BLOCK_V,
                                      ref.IGNORE_INDEX)

    return kernel


def _cuda_bwd(hidden, weight, targets, lse, entropy, grad_logprobs, grad_entropy, grad_lse, temperature,
              batch_invariant, return_entropy):
    with torch.no_grad():
        return ref.token_logprobs_bwd_reference(hidden, weight, targets, lse, entropy, grad_logprobs, grad_entropy,
                                                grad_lse, temperature, batch_invariant, return_entropy,
                                                matmul=_cuda_matmul(batch_invariant))


backends.register_triton("glm53::token_logprobs", _triton_fwd, _plain_fwd, _FALLBACK)
_token_logprobs_bwd_op.register_kernel("cuda")(_cuda_bwd)  # plain torch on every device: no back-end to miss


def _setup_context(ctx, inputs, output):
    hidden, weight, targets, temperature, batch_invariant, return_entropy = inputs
    _, entropy, lse = output
    ctx.save_for_backward(hidden, weight, targets, lse, entropy)
    ctx.temperature, ctx.batch_invariant, ctx.return_entropy = temperature, batch_invariant, return_entropy
    ctx.set_materialize_grads(True)


def _backward(ctx, grad_logprobs, grad_entropy, grad_lse):
    hidden, weight, targets, lse, entropy = ctx.saved_tensors
    grad_hidden, grad_weight = torch.ops.glm53.token_logprobs_bwd(
        hidden, weight, targets, lse, entropy, grad_logprobs, grad_entropy, grad_lse, ctx.temperature,
        ctx.batch_invariant, ctx.return_entropy)
    return grad_hidden, grad_weight, None, None, None, None


_token_logprobs_op.register_autograd(_backward, setup_context=_setup_context)


def token_logprobs(hidden, weight, targets, *, temperature=1.0, return_entropy=False, batch_invariant=False):
    """Log-probabilities of ``targets`` under ``softmax((hidden · weightᵀ).float() / temperature)``,
    ``glm53::token_logprobs`` (forward + backward), without materialising ``[T, V]``.

    Args:
        hidden: ``[T, D]`` bf16, fp16 or fp32: the final hidden state (the lm_head input).
        weight: ``[V, D]`` in hidden's dtype: the lm_head weight.
        targets: int64 ``[T]``: the token whose log-probability row t gets, in ``[0, V)``, or
            ``-100`` (ignored: logprob 0, entropy 0, no gradient). Checked in eager mode only
            (reading them synchronises with the host); out of range in a compiled call gives NaN.
        temperature: a python float, finite and > 0 (a literal of the graph; not a tensor).
        return_entropy: also return the entropy of each row's distribution.
        batch_invariant: each row's results bitwise independent of the other rows of the call
            (``PrecisionConfig.batch_invariant``; ``docs/DESIGN.md`` §9).

    Returns:
        ``logprobs`` FP32 ``[T]``, or ``(logprobs, entropy)`` with ``return_entropy``. Both
        differentiable in hidden and weight (gradients in their dtypes).

    Arithmetic: the module docstring (the logits rounded to hidden's dtype, then cast, then divided
    by the temperature; FP32 log-sum-exp). Memory ``O(T·D + T·CHUNK_V)`` in forward and backward.
    """
    ref.validate_token_logprobs_inputs(hidden, weight, targets, temperature, return_entropy, batch_invariant)
    if eager(targets):
        ref.check_token_logprobs_targets(targets, weight.shape[0])
    logprobs, entropy, _ = torch.ops.glm53.token_logprobs(hidden, weight, targets, float(temperature),
                                                          batch_invariant, return_entropy)
    return (logprobs, entropy) if return_entropy else logprobs
