"""KDA (``glm53::kda_chunk``) under context parallelism (``docs/DESIGN.md`` §4 kda_chunk, §8).

The KDA state recurrence ``S_t = (I − β_t k_t k_tᵀ)·Diag(exp g_t)·S_{t−1} + β_t k_t v_tᵀ`` is affine
in the state entering a segment: ``S_end = P·S_0 + E`` with ``E`` the end state from a zero start
and ``P [K, K]`` the segment's transition (the product of the per-token factors). Running the op
with ``v = 0`` (so V = K) from ``S_0 = I`` returns exactly ``P``: the transition comes from the
project's own op, in both precisions, differentiable through the op's autograd.

Algorithm of :func:`kda_chunk_cp` (per rank, per layer; every step traced, no host sync):

1. ``kda_chunk`` over the local segments from a zero state (``precision``) → ``E`` of the last
   segment of each local shard.
2. ``kda_chunk`` with ``v = 0`` from the identity, precision ``"fp32"`` → ``P`` of those segments.
3. ONE all-gather of ``[E | P]`` (FP32 ``[n_local, H, K, V+K]`` per rank: ``n_local·H·K·(V+K)·4``
   bytes sent, W times that received), reordered into global shard order.
4. Fold, in global shard order, FP32: ``S_j = P_j·S_{j−1} + E_j`` when shard j's last segment
   continues the document entering it, else ``S_j = E_j`` (a document start stops the fold).
   The fold runs over all S global shards on every rank (S small matmuls ``[H,K,K]·[H,K,V]``), so
   the graph is the same on every rank; zigzag folds over its 2W shards in global order.
5. Correction, the exact way: ``kda_chunk`` again over the local segments, the first segment of
   each local shard starting from ``S_{j−1}`` when it continues a document (zeros otherwise).

Cost per layer: three ``kda_chunk`` forwards over the local tokens (two at width V, one at K) and
their backwards, one all-gather. Backward: autograd of the three ops and the all-gather's
reduce-scatter (the mirror of the forward by construction).

Numerics against one rank (``tests/parallel/test_kda_cp.py`` measures them): where no document
crosses a shard boundary the arithmetic is the single-rank's, bitwise. A segment that continues a
document starts a new 64-token chunk at the shard boundary (one rank's chunks start at the
document start) and enters with ``P·S + E`` instead of the carried state: FP32 differences at
FP32 rounding level (~1e-6 relative); BF16 ones at the level of the op's BF16 intermediates
(the per-chunk state ``h`` and ``v_new`` are rounded at different chunk boundaries), the same order as
one rank's own BF16 error against FP64.
"""

from __future__ import annotations

import torch

from inductor_ext import ops
from inductor_ext.config import active_config
from inductor_ext.parallel.collectives import all_gather
from inductor_ext.parallel.context import CPContext

__all__ = ["kda_chunk_cp", "fold_states", "collect_document_states"]


def fold_states(ends: torch.Tensor, transitions: torch.Tensor, carries: torch.Tensor) -> torch.Tensor:
    """States leaving every global shard, FP32 ``[S, H, K, V]``.

    ``ends [S,H,K,V]``: end state of each shard's last segment from a zero start; ``transitions
    [S,H,K,K]``: its transition; ``carries [S]`` bool: the last segment continues the document
    entering the shard. ``S_j = P_j·S_{j−1} + E_j`` if ``carries[j]`` else ``E_j`` (exactly).
    """
    state = ends[0]
    states = [state]
    for j in range(1, ends.shape[0]):
        state = torch.where(carries[j], torch.matmul(transitions[j], state) + ends[j], ends[j])
        states.append(state)
    return torch.stack(states)


def kda_chunk_cp(q, k, v, g, beta, cp: CPContext, *, scale=None, precision=None):
    """``glm53::kda_chunk`` of the local tokens of a context-parallel batch.

    Args:
        q, k ``[1,T_local,H,K]``; v ``[1,T_local,H,V]``; g ``[1,T_local,H,K]`` FP32; beta
            ``[1,T_local,H]``: the local tokens (:meth:`CPContext.shard` of the global tensors),
            dtypes as :func:`inductor_ext.ops.kda_chunk`.
        cp: the batch's :class:`CPContext`; its ``local_cu_seqlens`` replace ``cu_seqlens``.
        scale: query scale (default K^-0.5); precision: ``"bf16"`` | ``"fp32"`` | None (active
            config's ``kda``).

    Returns:
        ``(o, final_state)``: o ``[1,T_local,H,V]`` in v's dtype, equal to the single-rank op's
        rows at ``cp.positions``; final_state FP32 ``[M,H,K,V]``, the state leaving each local
        segment (M = ``cp.num_segments``; padded segments hold zeros). A document's final state is
        the row of its last segment (``cp.seg_doc_end``); :func:`collect_document_states` gathers
        them in global document order. Differentiable in q, k, v, g, beta.

    Collectives: one all-gather (module docstring); no host sync, traceable with
    ``fullgraph=True``.
    """
    precision = active_config().kda if precision is None else precision
    if q.dim() != 4 or q.shape[0] != 1 or q.shape[1] != cp.local_tokens:
        raise ValueError(f"kda_chunk_cp: q must be [1, T_local={cp.local_tokens}, H, K], got {tuple(q.shape)}")
    _, T, H, K = q.shape
    V = v.shape[-1]
    M, cu = cp.num_segments, cp.local_cu_seqlens
    _, zero_start = ops.kda_chunk(q, k, v, g, beta, scale=scale, cu_seqlens=cu, precision=precision)
    eye = torch.eye(K, dtype=torch.float32, device=q.device).expand(M, H, K, K).contiguous()
    _, trans = ops.kda_chunk(q, k, q.new_zeros(1, T, H, K, dtype=torch.float32), g, beta, scale=scale,
                             initial_state=eye, cu_seqlens=cu, precision="fp32")
    last = cp.shard_last_seg
    packed = torch.cat([zero_start.index_select(0, last), trans.index_select(0, last)], -1)
    ends, transitions = cp.gather_shards(packed).split([V, K], -1)
    states = fold_states(ends, transitions, cp.shard_carries)
    entering = states.index_select(0, (cp.shard_global - 1).clamp_min(0))
    continues = cp.shard_continues.index_select(0, cp.shard_global).view(-1, 1, 1, 1)
    init = torch.where(continues, entering, torch.zeros((), dtype=torch.float32, device=q.device))
    h0 = q.new_zeros(M, H, K, V, dtype=torch.float32).index_copy(0, cp.shard_first_seg, init)
    return ops.kda_chunk(q, k, v, g, beta, scale=scale, initial_state=h0, cu_seqlens=cu, precision=precision)


def collect_document_states(final_state: torch.Tensor, cp: CPContext) -> torch.Tensor:
    """Every global document's final state in document order, FP32 ``[N,H,K,V]``, on every rank.

    ``final_state``: the per-segment states ``[M,H,K,V]`` of :func:`kda_chunk_cp`. One all-gather
    (``W·M·H·K·V·4`` bytes received); an empty document gets zeros. Differentiable; its backward
    sums the gradients of every rank, so put it in ONE rank's loss (or weight each rank by 1/W).
    """
    gathered = all_gather(final_state, cp.group_name)
    gathered = torch.cat([gathered, gathered.new_zeros(1, *gathered.shape[1:])], 0)
    return gathered.index_select(0, cp.doc_state_slot)
