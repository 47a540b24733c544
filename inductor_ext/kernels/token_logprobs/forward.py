"""Triton forward of ``glm53::token_logprobs``: per vocabulary chunk, the chunk's logits ``[T, c]``
(hidden's dtype) come from the caller's GEMM, then one launch of :func:`_chunk_kernel` (one program
per ``BLOCK_T`` rows) walks the chunk in ``BLOCK_V``-column tiles and updates each row's online
state in place: the max ``m``, ``s = Σ exp(z − m)``, ``a = Σ exp(z − m)·(z − m)`` (entropy) and the
target's logit ``t``, with ``z = float(logit) / τ`` (IEEE ``div_rn``, the reference's division).
The last chunk's launch writes ``lse = m + log s``, ``logprob = (t − m) − log s`` and
``entropy = log s − a / s`` (0 for ignored rows) instead of the state.

The arithmetic is the reference's (``inductor_ext.ops.token_logprobs_reference``) with the max and
the sums taken per tile instead of per chunk, so results agree within a few FP32 ulps; on the GPU
``exp``/``log`` are the hardware approximations. Each row's sequence of operations is fixed by the
constant tile and chunk sizes, never by the number of rows, so with a batch-invariant GEMM the
results are batch-invariant. Grids come from static shapes; no launch reads device data.
Imports only torch and triton.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["token_logprobs_fwd"]

_NUM_WARPS = 4


@triton.jit
def _chunk_kernel(logits_ptr, stride_t, targets_ptr, m_ptr, s_ptr, a_ptr, t_ptr, lp_ptr, ent_ptr, lse_ptr,
                  T, C, v0, temperature,
                  ENTROPY: tl.constexpr, FINAL: tl.constexpr, IGNORE: tl.constexpr,
                  BLOCK_T: tl.constexpr, BLOCK_V: tl.constexpr):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    rmask = rows < T
    m = tl.load(m_ptr + rows, mask=rmask, other=float("-inf"))
    s = tl.load(s_ptr + rows, mask=rmask, other=0.0)
    a = tl.load(a_ptr + rows, mask=rmask, other=0.0)
    t = tl.load(t_ptr + rows, mask=rmask, other=float("nan"))
    target = tl.load(targets_ptr + rows, mask=rmask, other=IGNORE)
    local = target - v0  # the target's column in this chunk (outside [0, C) when elsewhere)
    tau = tl.full((BLOCK_T, BLOCK_V), 1.0, tl.float32) * temperature
    for c0 in range(0, C, BLOCK_V):
        cols = c0 + tl.arange(0, BLOCK_V)
        cmask = cols < C
        x = tl.load(logits_ptr + rows[:, None] * stride_t + cols[None, :],
                    mask=rmask[:, None] & cmask[None, :], other=0.0).to(tl.float32)
        z = tl.math.div_rn(x, tau)
        hit = (cols[None, :] == local[:, None]) & cmask[None, :]
        found = tl.max(hit.to(tl.int32), axis=1) > 0
        t = tl.where(found, tl.sum(tl.where(hit, z, 0.0), axis=1), t)
        z = tl.where(cmask[None, :], z, float("-inf"))
        m_new = tl.maximum(m, tl.max(z, axis=1))
        alpha = tl.exp(m - m_new)
        zs = z - m_new[:, None]
        e = tl.exp(zs)
        if ENTROPY:
            shift = (tl.where(s > 0, m, m_new) - m_new) * s  # 0 before the first tile (m = -inf, s = 0)
            a = alpha * (a + shift) + tl.sum(e * tl.where(cmask[None, :], zs, 0.0), axis=1)
        s = alpha * s + tl.sum(e, axis=1)
        m = m_new
    if FINAL:
        log_s = tl.log(s)
        valid = target != IGNORE
        tl.store(lse_ptr + rows, m + log_s, mask=rmask)
        tl.store(lp_ptr + rows, tl.where(valid, (t - m) - log_s, 0.0), mask=rmask)
        if ENTROPY:
            tl.store(ent_ptr + rows, tl.where(valid, log_s - tl.math.div_rn(a, s), 0.0), mask=rmask)
    else:
        tl.store(m_ptr + rows, m, mask=rmask)
        tl.store(s_ptr + rows, s, mask=rmask)
        tl.store(a_ptr + rows, a, mask=rmask)
        tl.store(t_ptr + rows, t, mask=rmask)


def token_logprobs_fwd(hidden, weight, targets, temperature: float, return_entropy: bool, matmul, chunk: int,
                       block_t: int, block_v: int, ignore_index: int):
    """``(logprobs [T], entropy [T] or [0], lse [T])`` FP32 of ``glm53::token_logprobs``:
    ``matmul(hidden, weight[v0:v0 + chunk])`` gives each chunk's logits in hidden's dtype (rounded
    once from FP32 accumulation), the Triton kernel the rest; rows whose target is ``ignore_index``
    get 0. ``block_t`` and ``block_v`` powers of two."""
    T, V = hidden.shape[0], weight.shape[0]
    f32 = {"device": hidden.device, "dtype": torch.float32}
    m = torch.full((T,), float("-inf"), **f32)
    s, a = torch.zeros(T, **f32), torch.zeros(T, **f32)
    t = torch.full((T,), float("nan"), **f32)
    logprobs, lse = torch.empty(T, **f32), torch.empty(T, **f32)
    entropy = torch.empty(T if return_entropy else 0, **f32)
    targets = targets.contiguous()
    grid = (triton.cdiv(T, block_t),)
    for v0 in range(0, V, chunk):
        raw = matmul(hidden, weight[v0:v0 + chunk])
        raw = raw if raw.stride(1) == 1 else raw.contiguous()
        _chunk_kernel[grid](raw, raw.stride(0), targets, m, s, a, t, logprobs, entropy, lse,
                            T, raw.shape[1], v0, float(temperature),
                            ENTROPY=return_entropy, FINAL=v0 + chunk >= V, IGNORE=ignore_index,
                            BLOCK_T=block_t, BLOCK_V=block_v, num_warps=_NUM_WARPS)
    return logprobs, entropy, lse
