"""Context parallelism: one packed batch sharded over the ranks of a process group
(``docs/DESIGN.md`` §8).

Public surface::

    from inductor_ext.parallel import cp_context
    ctx = cp_context(cu_seqlens, group=None, layout="contiguous")  # host side, a collective
    local_ids = ctx.shard(input_ids)                                # this rank's tokens
    logits_local = model(local_ids, cp=ctx)                         # graphs.GLM53Model
    logits = ctx.unshard(logits_local)                              # all-gather, differentiable

Pieces: :mod:`~inductor_ext.parallel.context` (the metadata), :mod:`~inductor_ext.parallel.collectives`
(differentiable, traceable all-gathers), :mod:`~inductor_ext.parallel.kda` (KDA: local pass,
FP32 transitions, one all-gather, fold, correction), :mod:`~inductor_ext.parallel.halo` (the
short convolution's 3-token halo) and :mod:`~inductor_ext.parallel.indexer` (KPool indexer: global
keys, local queries, global ids). The ``cp-check`` command (CP against one rank on spawned
processes) is :mod:`inductor_ext.report.cp_check`.
"""

from __future__ import annotations

from inductor_ext.parallel.collectives import all_gather, all_gather_tokens, gather_shards
from inductor_ext.parallel.context import LAYOUTS, CPContext, cp_context
from inductor_ext.parallel.halo import halo_exchange, with_halo
from inductor_ext.parallel.indexer import GatheredKeys, gather_indexer_keys, kpool_indexer_cp, local_query_layout
from inductor_ext.parallel.kda import collect_document_states, fold_states, kda_chunk_cp

__all__ = [
    "LAYOUTS",
    "CPContext",
    "cp_context",
    "all_gather",
    "all_gather_tokens",
    "gather_shards",
    "halo_exchange",
    "with_halo",
    "kda_chunk_cp",
    "fold_states",
    "collect_document_states",
    "GatheredKeys",
    "gather_indexer_keys",
    "local_query_layout",
    "kpool_indexer_cp",
]
