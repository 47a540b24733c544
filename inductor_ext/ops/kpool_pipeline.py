"""The composite KPool indexer the DSA layer calls, :func:`kpool_indexer`, and its stages shared
with the context-parallel form (:mod:`inductor_ext.parallel.indexer`) and the serving decoder
(:mod:`graphs.decode`): :func:`indexer_project` (:func:`indexer_keys`, :func:`indexer_query`),
:func:`indexer_pools`, :func:`indexer_scorer_query`, :func:`indexer_score_select`.
The ops it composes, their contracts and input checks: :mod:`inductor_ext.ops.kpool`.
"""

from __future__ import annotations

import torch

from inductor_ext import workspace
from inductor_ext.config import KPOOL_POOLINGS as POOLINGS
from inductor_ext.config import active_config
from inductor_ext.ops import kpool_reference as ref
from inductor_ext.ops._checks import input_error, tensors
from inductor_ext.ops.batch_invariant import bi_linear
from inductor_ext.ops.kpool import (
    FLOAT_DTYPES,
    INDEXER_EPS,
    INDEXER_SCALE_FMT,
    PRECISIONS,
    TAILS,
    check_choice,
    check_heads,
    check_pool_geometry,
    check_positive_int,
    check_same_device,
    check_tensor,
    kpool_compress,
    kpool_layout,
    kpool_logits,
    kpool_logits_batch_invariant,
    kpool_project,
    kpool_project_batch_invariant,
    kpool_quant_query,
    kpool_select,
)

__all__ = ["kpool_indexer", "indexer_precision", "indexer_project", "indexer_keys", "indexer_query", "indexer_pools",
           "indexer_scorer_query", "indexer_score_select"]


def indexer_precision(kpool, kpool_pooling, head_proj, mqa_layout, logits_budget_mb) -> tuple:
    """The indexer's precision arguments with each ``None`` taken from the active config (read while
    tracing, so each is a constant of the graph), in the order given."""
    cfg = active_config()
    given = (kpool, kpool_pooling, head_proj, mqa_layout, logits_budget_mb)
    fields = (cfg.kpool, cfg.kpool_pooling, cfg.head_proj, cfg.mqa_layout, cfg.logits_budget_mb)
    return tuple(f if g is None else g for g, f in zip(given, fields))


def kpool_indexer(
    x, q_resid, wq_b, wk, k_norm_weight, k_norm_bias, weights_proj, compress_gate, compress_ape,
    cu_seqlens=None, *, topk, pool_size=4, kpool=None, kpool_pooling=None, head_proj=None,
    mqa_layout=None, logits_budget_mb=None, scale_fmt=INDEXER_SCALE_FMT, tail="compact", eps=INDEXER_EPS,
    batch_invariant=False,
):
    """The GLM-5.3 KPool indexer: selected token ids per query, one call for the DSA layer.

    Args:
        x: hidden states ``[T, hidden]`` (model dtype, bf16 for the FP8 path); q_resid ``[T, Qr]``.
        wq_b: ``[H·128, Qr]``; wk ``[128, hidden]``; k_norm_weight/bias ``[128]``;
            weights_proj ``[H, hidden]``; compress_gate ``[128, hidden]``; compress_ape ``[P, 128]``
            (parameter names of transformers ``Glm5NextTextIndexer``). H in 32, 64, 128.
        cu_seqlens: int64 ``[N+1]`` packed document offsets (``None``: one document of T tokens).
        topk: selected tokens per query (GLM-5.3: 2048), a multiple of P.
        pool_size: tokens per pool P (model geometry, GLM-5.3: 4).
        kpool, kpool_pooling, head_proj, mqa_layout, logits_budget_mb: the
            :class:`~inductor_ext.PrecisionConfig` fields as literals; ``None`` takes the active
            config's value (read while tracing, so it is a constant of the graph).
        scale_fmt: FP8 scales, ``"ue8m0"`` (powers of two) or ``"fp32"``.
        tail: ``"compact"`` | ``"fixed"`` (see :func:`kpool_select`).
        batch_invariant: projections by :func:`kpool_project_batch_invariant` and ``bi_linear``,
            scores by :func:`kpool_logits_batch_invariant` (in row chunks whose ``[rows, H, S]``
            FP32 products fit the budget), so a query's ids are bitwise the same whatever the
            other documents of the pack (``PrecisionConfig.batch_invariant``).

    Returns:
        int32 ``[T, topk + P - 1]`` global token ids (see :func:`kpool_select`). Query rows are
        scored in chunks of ``workspace.score_chunk_rows(T, T//P, H, mqa_layout, budget)`` rows so
        one chunk's logits workspace fits ``logits_budget_mb`` MiB. No host synchronisation while
        traced or captured (eager mode checks ``cu_seqlens`` values once). Runs under no_grad.
        Pools are stored in BF16 (or FP8) whatever the model dtype: an FP32 model's k, gate and q
        are rounded to BF16 before pooling and scoring.
    """
    P = pool_size
    kpool, kpool_pooling, head_proj, layout, budget_mb = indexer_precision(
        kpool, kpool_pooling, head_proj, mqa_layout, logits_budget_mb)
    tensors("kpool", optional=("cu_seqlens",), x=x, q_resid=q_resid, wq_b=wq_b, wk=wk, k_norm_weight=k_norm_weight,
            k_norm_bias=k_norm_bias, weights_proj=weights_proj, compress_gate=compress_gate,
            compress_ape=compress_ape, cu_seqlens=cu_seqlens)
    check_choice("kpool", kpool, PRECISIONS)
    check_choice("kpool_pooling", kpool_pooling, POOLINGS)
    check_choice("mqa_layout", layout, workspace.LAYOUTS)
    check_choice("scale_fmt", scale_fmt, ref.SCALE_FMTS)
    check_choice("tail", tail, TAILS)
    check_pool_geometry(topk, P)
    check_positive_int("logits_budget_mb", budget_mb)
    check_tensor("x", x, dims=2, dtypes=FLOAT_DTYPES)
    T = x.shape[0]
    if T < 1:
        raise input_error("kpool: the indexer needs at least one token (T >= 1)")
    if kpool == "fp8" and x.dtype != torch.bfloat16:
        raise input_error(f"kpool: the fp8 indexer takes bf16 hidden states, got {x.dtype}")
    H = weights_proj.shape[0]
    check_heads(H, "weights_proj.shape[0]")
    check_tensor("q_resid", q_resid, dims=2, dtypes=(x.dtype,))
    if q_resid.shape[0] != T:
        raise input_error(f"kpool: q_resid must have T={T} rows, got {tuple(q_resid.shape)}")
    check_tensor("wq_b", wq_b, dtypes=(x.dtype,), shape=(H * ref.HEAD_DIM, q_resid.shape[1]))
    check_tensor("compress_ape", compress_ape, dtypes=FLOAT_DTYPES, shape=(P, ref.HEAD_DIM))
    if cu_seqlens is None:
        # built on the device (no host-to-device copy, so it is safe inside CUDA-graph capture)
        cu_seqlens = torch.arange(2, dtype=torch.int64, device=x.device) * T
    check_same_device(x=x, q_resid=q_resid, wq_b=wq_b, compress_ape=compress_ape, cu_seqlens=cu_seqlens)

    with torch.no_grad():  # frozen indexer: integer outputs, no autograd graph
        k, gate, w, q = indexer_project(x, q_resid, wq_b, wk, k_norm_weight, k_norm_bias, weights_proj,
                                        compress_gate, eps=eps, head_proj=head_proj, batch_invariant=batch_invariant)
        pool_token, q_lo, q_n, tail_start, tail_len = kpool_layout(cu_seqlens, T, P)
        pool, pool_scale = indexer_pools(k, gate, compress_ape, pool_token, kpool=kpool, kpool_pooling=kpool_pooling,
                                         scale_fmt=scale_fmt)
        q, w = indexer_scorer_query(q, w, kpool=kpool, scale_fmt=scale_fmt)
        return indexer_score_select(q, w, pool, pool_scale, q_lo, q_n, tail_start, tail_len, kpool=kpool,
                                    layout=layout, budget_mb=budget_mb, topk=topk, pool_size=P, tail=tail,
                                    batch_invariant=batch_invariant, num_tokens=T)


def indexer_project(x, q_resid, wq_b, wk, k_norm_weight, k_norm_bias, weights_proj, compress_gate, *, eps,
                    head_proj, batch_invariant):
    """The indexer's projections, ``(k, gate, w, q [T, H, 128])``: :func:`indexer_keys` and
    :func:`indexer_query`. Shared by :func:`kpool_indexer` and its context-parallel form."""
    k, gate, w = indexer_keys(x, wk, k_norm_weight, k_norm_bias, weights_proj, compress_gate, eps=eps,
                              head_proj=head_proj, batch_invariant=batch_invariant)
    return k, gate, w, indexer_query(q_resid, wq_b, batch_invariant=batch_invariant)


def indexer_keys(x, wk, k_norm_weight, k_norm_bias, weights_proj, compress_gate, *, eps, head_proj,
                 batch_invariant):
    """``(k [T, 128], gate [T, 128], w [T, H])``: :func:`kpool_project`, or
    :func:`kpool_project_batch_invariant` when ``batch_invariant`` (same arguments and dtypes)."""
    project = kpool_project_batch_invariant if batch_invariant else kpool_project
    return project(x, wk, k_norm_weight, k_norm_bias, weights_proj, compress_gate, eps=eps, head_proj=head_proj)


def indexer_query(q_resid, wq_b, *, batch_invariant):
    """The indexer's query ``q_resid · wq_bᵀ`` as ``[T, H, 128]`` in q_resid's dtype, autocast off
    (``bi_linear`` when ``batch_invariant``)."""
    with torch.autocast(device_type=q_resid.device.type, enabled=False):
        q = (bi_linear if batch_invariant else torch.nn.functional.linear)(q_resid, wq_b)
    return q.view(q_resid.shape[0], -1, ref.HEAD_DIM)


def indexer_pools(k, gate, ape, pool_token, *, kpool, kpool_pooling, scale_fmt):
    """``(pool [S, 128], scale [S] fp32)``: :func:`kpool_compress` in the indexer's mode for
    ``kpool``: ``"bf16"`` rounds k and gate to BF16 and pools as ``kpool_pooling`` says
    (``"reference"``: transformers' BF16 pooling, else FP32 pooling); ``"fp8"`` runs the serving
    quantizer with ``scale_fmt`` scales (k and gate must already be BF16)."""
    if kpool == "bf16":
        mode = "bf16_reference" if kpool_pooling == "reference" else "bf16_fp32"
        return kpool_compress(k.to(torch.bfloat16), gate.to(torch.bfloat16), ape, pool_token, mode=mode)
    return kpool_compress(k, gate, ape, pool_token, mode=f"fp8_{scale_fmt}")


def indexer_scorer_query(q, w, *, kpool, scale_fmt):
    """``(q, w)`` as the scorer takes them for ``kpool``: ``"bf16"`` q ``[M, H, 128]`` rounded to
    BF16 with w as is; ``"fp8"`` :func:`kpool_quant_query`'s e4m3 q and folded FP32 w."""
    if kpool == "bf16":
        return q.to(torch.bfloat16), w
    return kpool_quant_query(q, w, scale_fmt=scale_fmt)


def indexer_score_select(q, w, pool, pool_scale, q_lo, q_n, tail_start, tail_len, *, kpool, layout, budget_mb,
                         topk, pool_size, tail, batch_invariant, num_tokens=None):
    """Scores (:func:`kpool_logits`, or :func:`kpool_logits_batch_invariant`) and selection
    (:func:`kpool_select`) of the query rows ``q [M, H, 128]`` against ``pool [S, 128]``, in row
    chunks whose scoring memory fits ``budget_mb`` MiB (the logits workspace; ``[rows, H, S]`` FP32
    products when ``batch_invariant``); ``num_tokens``: T, for :func:`kpool_select`'s eager id bound.
    Returns int32 ``[M, topk + P - 1]``.

    One op, ``glm53::kpool_score_select``: the chunk count depends on M and S, so the loop runs
    inside the op's kernel on concrete sizes, and a compiled graph holds one call whatever the token
    count (M and S stay symbolic; no Python arithmetic on them while tracing)."""
    return torch.ops.glm53.kpool_score_select(q, w, pool, pool_scale, q_lo, q_n, tail_start, tail_len, kpool,
                                              layout, budget_mb, topk, pool_size, tail, batch_invariant, num_tokens)


def score_chunks(M: int, S: int, H: int, *, layout: str, budget_mb: int, batch_invariant: bool):
    """``(start, stop)`` query-row ranges whose scoring memory fits ``budget_mb`` MiB, from concrete
    sizes: the MQA logits workspace plan, or ``[rows, H, S]`` FP32 products when ``batch_invariant``."""
    if batch_invariant:
        rows = max(1, budget_mb * 2**20 // (4 * H * max(1, S)))
        return [(s, min(M, s + rows)) for s in range(0, M, rows)]
    return workspace.LogitsPlan(M, S, H, layout, budget_mb * 2**20).chunks


@torch.library.custom_op("glm53::kpool_score_select", mutates_args=())
def _kpool_score_select_op(
    q: torch.Tensor, w: torch.Tensor, pool: torch.Tensor, pool_scale: torch.Tensor, q_lo: torch.Tensor,
    q_n: torch.Tensor, tail_start: torch.Tensor, tail_len: torch.Tensor, kpool: str, layout: str, budget_mb: int,
    topk: int, pool_size: int, tail: str, batch_invariant: bool, num_tokens: int | None,
) -> torch.Tensor:
    """Selected token ids int32 ``[M, topk + P - 1]``; see :func:`indexer_score_select`. Every device:
    the scorer and selector ops it calls dispatch to their own device kernels."""
    M, H, S = q.shape[0], q.shape[1], pool.shape[0]
    parts = []
    with torch.no_grad():
        for s, e in score_chunks(M, S, H, layout=layout, budget_mb=budget_mb, batch_invariant=batch_invariant):
            if batch_invariant:
                logits = kpool_logits_batch_invariant(q[s:e], w[s:e], pool, pool_scale, precision=kpool)
            else:
                logits = kpool_logits(q[s:e], w[s:e], pool, pool_scale, precision=kpool, layout=layout)
            parts.append(kpool_select(logits, q_lo[s:e], q_n[s:e], tail_start[s:e], tail_len[s:e],
                                      topk=topk, pool_size=pool_size, tail=tail, num_tokens=num_tokens))
    if not parts:
        return torch.empty(0, topk + pool_size - 1, dtype=torch.int32, device=q.device)
    return parts[0].contiguous() if len(parts) == 1 else torch.cat(parts, 0)
