"""The KPool indexer (``inductor_ext.ops.kpool_indexer``) under context parallelism
(``docs/DESIGN.md`` §4 "KPool indexer", §8).

Pools restart at every document start and a pool may straddle a shard boundary, so the per-token
indexer keys and compression gates are all-gathered into GLOBAL token order before pooling; every
rank then builds all the pools of the batch (``kpool_compress`` over global keys) and scores only
its LOCAL queries against them. The per-token layout metadata (visible pools, tail) is computed for
the global batch and its local rows taken at ``cp.positions``, so the selected ids are global token
ids and each local row equals the single-rank indexer's row of that token.

Stages, on each rank (``kpool_indexer``'s stages with global keys and local queries)::

    k, gate, w = kpool_project(x_local)                      # per token, local
    q          = wq_b(q_resid_local)                         # local queries [T_local, H, 128]
    k, gate    = gather_indexer_keys(k, gate, cp)            # ONE all-gather → global [T, 128] each
    layout     = local_query_layout(cp, P)                   # global pools, local query rows
    pool       = kpool_compress(k, gate, ape, pool_token)    # all S = T//P global pool slots
    q, w       = kpool_quant_query(q, w)                     # fp8 only, local
    ids        = kpool_select(kpool_logits(q, w, pool), local rows of the layout)

Communication per call: one all-gather of ``[T_local, 256]`` BF16 (keys and gates side by side:
``T_local·512`` bytes sent, W times that received). Forward only (the indexer is frozen, integer
outputs), no host sync: traceable with ``fullgraph=True`` like the single-rank indexer.
"""

from __future__ import annotations

import torch

from inductor_ext.ops import kpool as _kpool
from inductor_ext.ops import kpool_pipeline as _pipeline
from inductor_ext.parallel.context import CPContext

__all__ = ["GatheredKeys", "gather_indexer_keys", "local_query_layout", "kpool_indexer_cp"]


def gather_indexer_keys(k: torch.Tensor, gate: torch.Tensor, cp: CPContext) -> tuple[torch.Tensor, torch.Tensor]:
    """Local indexer keys and compression gates ``[T_local, 128]`` → global ``[T, 128]`` each, BF16.

    Both are rounded to BF16 first (the pools are built from BF16 keys and gates in every precision,
    as :func:`~inductor_ext.ops.kpool_indexer` does, so rounding before the gather is the same
    arithmetic) and gathered in one all-gather (:meth:`CPContext.unshard` of ``[T_local, 256]``).
    """
    both = torch.cat([k.to(torch.bfloat16), gate.to(torch.bfloat16)], -1)
    k_glob, gate_glob = cp.unshard(both).split([k.shape[-1], gate.shape[-1]], -1)
    return k_glob.contiguous(), gate_glob.contiguous()


def local_query_layout(cp: CPContext, pool_size: int):
    """:func:`~inductor_ext.ops.kpool_layout` of the global batch with the per-token rows of the
    local queries: int64 ``(pool_token [S], q_lo, q_n, tail_start, tail_len)``, S = T // P global
    pool slots, the four row tensors ``[T_local]`` (global slot / token numbering)."""
    pool_token, *rows = _kpool.kpool_layout(cp.cu_seqlens, cp.num_tokens, pool_size)
    return (pool_token, *(r.index_select(0, cp.positions) for r in rows))


class GatheredKeys:
    """The indexer's key source under context parallel: this rank's keys and gates all-gathered
    into global order (:func:`gather_indexer_keys`), all the batch's pools built on every rank, the
    local query rows' layout (:func:`local_query_layout`)."""

    num_tokens = None  # ids are global; the eager id bound is the single-rank indexer's concern

    def __init__(self, cp: CPContext):
        self.cp = cp

    def pools(self, k, gate, ape, opts: _pipeline.IndexerOptions):
        """``(pool [S, 128], scale [S], (q_lo, q_n, tail_start, tail_len) of the local rows)``."""
        k, gate = gather_indexer_keys(k, gate, self.cp)
        pool_token, *rows = local_query_layout(self.cp, opts.pool_size)
        return (*_pipeline.indexer_pools(k, gate, ape, pool_token, opts), rows)


def kpool_indexer_cp(
    x, q_resid, wq_b, wk, k_norm_weight, k_norm_bias, weights_proj, compress_gate, compress_ape, cp: CPContext,
    *, topk, pool_size=4, kpool=None, kpool_pooling=None, head_proj=None, mqa_layout=None, logits_budget_mb=None,
    scale_fmt=_kpool.INDEXER_SCALE_FMT, tail="compact", eps=_kpool.INDEXER_EPS, batch_invariant=False,
):
    """:func:`inductor_ext.ops.kpool_indexer` for the local tokens of a context-parallel batch:
    :func:`~inductor_ext.ops.kpool_pipeline.run_indexer` with :class:`GatheredKeys`.

    Args:
        x: LOCAL hidden states ``[T_local, hidden]``; q_resid: LOCAL ``[T_local, Qr]``.
        wq_b, wk, k_norm_weight, k_norm_bias, weights_proj, compress_gate, compress_ape: the
            indexer parameters, as :func:`~inductor_ext.ops.kpool_indexer`.
        cp: the batch's :class:`CPContext` (replaces ``cu_seqlens``: the global offsets are
            ``cp.cu_seqlens``).
        topk, pool_size, kpool, kpool_pooling, head_proj, mqa_layout, logits_budget_mb, scale_fmt,
            tail, eps, batch_invariant: as :func:`~inductor_ext.ops.kpool_indexer` (``None``: the active config);
            ``kpool`` is ``"bf16"`` or ``"fp8"`` (``PrecisionConfig.kpool``).

    Returns:
        int32 ``[T_local, topk + P − 1]`` GLOBAL token ids of the local queries, equal to rows
        ``cp.positions`` of the single-rank ``kpool_indexer`` on the global batch. The logits are
        ``[T_local, T//P]`` per rank, chunked over local rows to fit ``logits_budget_mb``.

    Collectives: one all-gather (:func:`gather_indexer_keys`). Runs under no_grad.
    """
    weights = _pipeline.IndexerWeights(wq_b, wk, k_norm_weight, k_norm_bias, weights_proj, compress_gate,
                                       compress_ape)
    opts = _pipeline.IndexerOptions.resolve(
        topk=topk, pool_size=pool_size, tail=tail, kpool=kpool, kpool_pooling=kpool_pooling, head_proj=head_proj,
        mqa_layout=mqa_layout, logits_budget_mb=logits_budget_mb, batch_invariant=batch_invariant,
        scale_fmt=scale_fmt, eps=eps)
    if x.dim() != 2 or x.shape[0] != cp.local_tokens or q_resid.shape[0] != cp.local_tokens:
        raise ValueError(f"kpool_indexer_cp: x and q_resid must hold the T_local={cp.local_tokens} local tokens, "
                         f"got {tuple(x.shape)} and {tuple(q_resid.shape)}")
    _pipeline.check_indexer_inputs(x, q_resid, weights, opts)
    return _pipeline.run_indexer(x, q_resid, weights, opts, GatheredKeys(cp))
