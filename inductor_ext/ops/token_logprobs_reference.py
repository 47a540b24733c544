"""Leaf of the ``token_logprobs`` family: constants, input checks and the chunked plain-torch
reference kernels of ``glm53::token_logprobs`` and ``glm53::token_logprobs_bwd`` (imports only torch
and the ``batch_invariant`` leaf).

Arithmetic (the serving engine's; contract in :mod:`inductor_ext.ops.token_logprobs`), per
vocabulary chunk of :data:`CHUNK_V` weight rows, ``z = (hidden · W_chunkᵀ).float() / τ``: the
product accumulated in FP32 and rounded to hidden's dtype (``F.linear``; with ``batch_invariant``
``bi_linear_reference``, a fixed K order), then cast to FP32 and divided by the temperature in FP32
(an IEEE division by ``float32(τ)``). An online log-sum-exp carries four FP32 numbers per row across
the chunks (never a ``[T, V]`` tensor):

- ``m``: the running max;
- ``s = Σ exp(z − m)``: rescaled by ``exp(m_old − m_new)`` when the max grows;
- ``a = Σ exp(z − m)·(z − m)`` (entropy only): rescaled as ``exp(m_old − m_new)·(a + (m_old − m_new)·s)``;
- ``t``: the target's logit ``z[target]``, gathered from the chunk holding it (NaN until found).

At the end ``lse = m + log s``, ``logprob = (t − m) − log s`` and ``entropy = log s − a / s``
(``lse − Σ p·z`` with the max subtracted, so a peaked row loses no digits to cancellation). Rows
whose target is :data:`IGNORE_INDEX` give 0 for both.

The backward recomputes each chunk's ``z`` with the same arithmetic, ``p = exp(z − lse)`` and

    dz = g_lp·(onehot − p) + g_lse·p − g_H·p·(z − lse + H)

(``z − lse + H = z − Σp·z``), ``draw = dz / τ`` (the rounding to hidden's dtype passes the gradient
unchanged), then ``grad_hidden += draw · W_chunk`` and ``grad_weight[chunk] = drawᵀ · hidden``: GEMMs
in FP32 (FP32 operands, ``torch.matmul``), ``grad_hidden`` accumulated in FP32 over the chunks and
each gradient rounded once to its input's dtype. Memory: ``O(T·D + T·CHUNK_V)`` forward and backward.

Batch invariance (``batch_invariant=True``): the logits by the fixed-K-order product, the chunk's
max and sum by the fixed lane order of :mod:`inductor_ext.ops.batch_invariant_reference`; every
other step is elementwise per row, and the chunk size is the constant :data:`CHUNK_V`, so each row's
results are bitwise independent of the other rows of the call.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from inductor_ext.ops import batch_invariant_reference as bi_ref
from inductor_ext.ops._checks import input_error, tensors

__all__ = [
    "CHUNK_V",
    "IGNORE_INDEX",
    "BLOCK_T",
    "BLOCK_V",
    "FLOATS",
    "validate_token_logprobs_inputs",
    "check_token_logprobs_targets",
    "raw_logits",
    "token_logprobs_reference",
    "token_logprobs_bwd_reference",
]

CHUNK_V = 4096  # vocabulary rows per chunk: fixed (never chosen from T), so the bi path stays invariant
IGNORE_INDEX = -100  # transformers' ignore_index: logprob 0, entropy 0, no gradient
BLOCK_T, BLOCK_V = 16, 256  # the Triton forward's tile (rows x vocabulary columns), fixed
FLOATS = (torch.bfloat16, torch.float16, torch.float32)


# ---------------------------------------------------------------------------------------------
# input checks (static: shapes, dtypes, devices, python arguments; never data)
# ---------------------------------------------------------------------------------------------


def validate_token_logprobs_inputs(hidden, weight, targets, temperature, return_entropy, batch_invariant) -> None:
    """``hidden [T >= 1, D >= 1]`` and ``weight [V >= 1, D]`` of one float dtype (bf16, fp16, fp32),
    ``targets`` int64 ``[T]``, all on one cpu or cuda device; ``temperature`` a python number
    (not a tensor, not bool), finite and > 0; the flags python bools. ``ValueError`` naming the rule."""
    op = "token_logprobs"
    tensors(op, hidden=hidden, weight=weight, targets=targets)
    if hidden.dim() != 2 or hidden.shape[0] < 1 or hidden.shape[1] < 1:
        raise input_error(f"{op}: hidden must be [T >= 1, D >= 1], got {tuple(hidden.shape)}")
    T, D = hidden.shape
    if weight.dim() != 2 or weight.shape[0] < 1 or weight.shape[1] != D:
        raise input_error(f"{op}: weight must be [V >= 1, D={D}] (the lm_head weight), got {tuple(weight.shape)}")
    if hidden.dtype not in FLOATS:
        raise input_error(f"{op}: hidden must be bfloat16, float16 or float32, got {hidden.dtype}")
    if weight.dtype != hidden.dtype:
        raise input_error(f"{op}: weight must have hidden's dtype {hidden.dtype} (the logits are rounded to it), "
                          f"got {weight.dtype}")
    if targets.dtype != torch.int64 or tuple(targets.shape) != (T,):
        raise input_error(f"{op}: targets must be int64 [T={T}], got {targets.dtype} {tuple(targets.shape)}")
    devices = {hidden.device, weight.device, targets.device}
    if len(devices) != 1:
        raise input_error(f"{op}: hidden, weight and targets must be on one device, got {sorted(map(str, devices))}")
    if hidden.device.type not in ("cpu", "cuda"):
        raise input_error(f"{op}: tensors must be on cpu or cuda, got {hidden.device}")
    if isinstance(temperature, torch.Tensor):
        raise input_error(f"{op}: temperature must be a python float, not a tensor (it is a literal of the graph)")
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) \
            or not 0 < temperature < math.inf:  # comparisons: a symbolic float only guards
        raise input_error(f"{op}: temperature must be a finite python float > 0, got {temperature!r}")
    for name, flag in (("return_entropy", return_entropy), ("batch_invariant", batch_invariant)):
        if not isinstance(flag, bool):
            raise input_error(f"{op}: {name} must be a bool, got {flag!r}")


def check_token_logprobs_targets(targets: torch.Tensor, vocab: int) -> None:
    """Every target in ``[0, V)`` or :data:`IGNORE_INDEX` (reads the data: eager mode only)."""
    bad = (targets != IGNORE_INDEX) & ((targets < 0) | (targets >= vocab))
    if bool(bad.any()):
        first = int(bad.nonzero()[0, 0])
        raise input_error(f"token_logprobs: targets must be in [0, V={vocab}) or {IGNORE_INDEX} (ignored), "
                         f"got {int(targets[first])} at row {first}")


# ---------------------------------------------------------------------------------------------
# reference kernels (plain torch, every device, chunked over the vocabulary)
# ---------------------------------------------------------------------------------------------


def raw_logits(hidden: torch.Tensor, w_chunk: torch.Tensor, batch_invariant: bool) -> torch.Tensor:
    """``hidden · w_chunkᵀ`` accumulated in FP32, rounded once to hidden's dtype → ``[T, c]``:
    ``F.linear``, or with ``batch_invariant`` the fixed-K-order ``bi_linear_reference``."""
    if batch_invariant:
        return bi_ref.bi_linear_reference(hidden, w_chunk, None, hidden.dtype)
    return F.linear(hidden, w_chunk)


def _scaled(raw: torch.Tensor, temperature: float) -> torch.Tensor:
    """The cast, then the temperature: ``raw.float() / τ`` in FP32 (``raw``, the matmul's fresh
    output, is divided in place when it is FP32 already; the callers change the result in place)."""
    z = raw.float()
    return z.div_(temperature) if temperature != 1.0 else z


def _reductions(batch_invariant: bool):
    """Row max and row sum of ``[T, c]``: the fixed lane order with ``batch_invariant``, else torch's."""
    if batch_invariant:
        return bi_ref.lane_max, bi_ref.lane_sum
    return (lambda x: x.amax(1)), (lambda x: x.sum(1))


def token_logprobs_reference(hidden, weight, targets, temperature, batch_invariant, return_entropy, *,
                             matmul=None, chunk: int | None = None):
    """``(logprobs [T], entropy [T] or [0], lse [T])``, FP32, by the online log-sum-exp over chunks of
    ``chunk`` vocabulary rows (default :data:`CHUNK_V`; module docstring). ``matmul(hidden, w_chunk)``
    → the chunk's logits in hidden's dtype (default :func:`raw_logits`); entropy is ``[0]`` without
    ``return_entropy``. A target outside ``[0, V)`` (other than ignored) gives NaN."""
    matmul = matmul or (lambda h, w: raw_logits(h, w, batch_invariant))
    chunk = chunk or CHUNK_V
    rowmax, rowsum = _reductions(batch_invariant)
    T, V = hidden.shape[0], weight.shape[0]
    f32 = {"device": hidden.device, "dtype": torch.float32}
    m = torch.full((T,), float("-inf"), **f32)
    s, a = torch.zeros(T, **f32), torch.zeros(T, **f32)
    t = torch.full((T,), float("nan"), **f32)
    for v0 in range(0, V, chunk):
        z = _scaled(matmul(hidden, weight[v0:v0 + chunk]), temperature)
        c = z.shape[1]
        idx = targets - v0
        t = torch.where((idx >= 0) & (idx < c), z.gather(1, idx.clamp(0, c - 1)[:, None])[:, 0], t)
        m_new = torch.maximum(m, rowmax(z))
        alpha = torch.exp(m - m_new)
        if return_entropy:
            shift = (torch.where(s > 0, m, m_new) - m_new) * s  # 0 for the first chunk (m = -inf, s = 0)
        zs = z.sub_(m_new[:, None])  # z − m_new, in place
        e = torch.exp(zs)
        s = alpha * s + rowsum(e)
        if return_entropy:
            a = alpha * (a + shift) + rowsum(zs.mul_(e))
        m = m_new
    log_s = torch.log(s)
    valid = targets != IGNORE_INDEX
    logprobs = torch.where(valid, (t - m) - log_s, 0.0)
    entropy = torch.where(valid, log_s - a / s, 0.0) if return_entropy else hidden.new_empty(0, dtype=torch.float32)
    return logprobs, entropy, m + log_s


def token_logprobs_bwd_reference(hidden, weight, targets, lse, entropy, grad_logprobs, grad_entropy, grad_lse,
                                 temperature, batch_invariant, return_entropy, *, matmul=None,
                                 chunk: int | None = None):
    """``(grad_hidden, grad_weight)`` in hidden's / weight's dtype: each chunk's logits recomputed
    (the forward's arithmetic, ``matmul`` as there), ``dz`` as in the module docstring (the one-hot
    term added at the target's column only), FP32 GEMMs."""
    matmul = matmul or (lambda h, w: raw_logits(h, w, batch_invariant))
    chunk = chunk or CHUNK_V
    V = weight.shape[0]
    valid = targets != IGNORE_INDEX
    g_lp = torch.where(valid, grad_logprobs.float(), 0.0)
    coef = (grad_lse.float() - g_lp)[:, None]  # p·(g_lse − g_lp): the softmax terms of lse and logprob
    g_h = torch.where(valid, grad_entropy.float(), 0.0)[:, None] if return_entropy else None
    hidden_f = hidden.float()
    grad_hidden = torch.zeros(hidden.shape, device=hidden.device, dtype=torch.float32)
    grad_weight = torch.empty(weight.shape, device=weight.device, dtype=weight.dtype)
    for v0 in range(0, V, chunk):
        w = weight[v0:v0 + chunk]
        c = w.shape[0]
        logp = _scaled(matmul(hidden, w), temperature).sub_(lse[:, None])  # z − lse
        p = torch.exp(logp)
        if return_entropy:  # − g_H·p·(z − lse + H), in place on logp
            dz = p.mul_(logp.add_(entropy[:, None]).mul_(g_h).neg_().add_(coef))
        else:
            dz = p.mul_(coef)
        idx = targets - v0
        hit = (idx >= 0) & (idx < c)
        dz.scatter_add_(1, idx.clamp(0, c - 1)[:, None], torch.where(hit, g_lp, 0.0)[:, None])  # + g_lp·onehot
        if temperature != 1.0:
            dz = dz.div_(temperature)
        grad_hidden += dz @ w.float()
        grad_weight[v0:v0 + chunk] = (dz.t() @ hidden_f).to(weight.dtype)
    return grad_hidden.to(hidden.dtype), grad_weight
