"""The KPool indexer as one pipeline: :class:`IndexerWeights` (the seven parameters),
:class:`IndexerOptions` (geometry and precision, built in one place: :meth:`IndexerOptions.resolve`)
and a key source (:class:`PackedKeys` here; the context-parallel gather in
:mod:`inductor_ext.parallel.indexer`; the decode cache in :mod:`graphs.cache`) run by
:func:`run_indexer`::

    k, gate, w, q = project(x, q_resid)              # per token
    pool, scale, rows = keys.pools(k, gate, ...)       # the seam: where keys and pools come from
    q, w = scorer_query(q, w)                          # fp8 quantization of the query
    ids = score_select(q, w, pool, scale, *rows)       # glm53::kpool_score_select

:func:`kpool_indexer` is the op-level entry (flat arguments, one packed batch). The ops it composes,
their contracts and input checks: :mod:`inductor_ext.ops.kpool`.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from inductor_ext import workspace
from inductor_ext.config import KPOOL_POOLINGS as POOLINGS
from inductor_ext.config import PrecisionConfig, active_config
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

__all__ = ["IndexerWeights", "IndexerOptions", "PackedKeys", "run_indexer", "check_indexer_inputs", "kpool_indexer",
           "indexer_pools", "indexer_score_select"]


class IndexerWeights(NamedTuple):
    """The indexer's parameters (names of transformers ``Glm5NextTextIndexer``): wq_b ``[H·128, Qr]``,
    wk ``[128, hidden]``, k_norm_weight / k_norm_bias ``[128]``, weights_proj ``[H, hidden]``,
    compress_gate ``[128, hidden]``, compress_ape ``[P, 128]``."""

    wq_b: torch.Tensor
    wk: torch.Tensor
    k_norm_weight: torch.Tensor
    k_norm_bias: torch.Tensor
    weights_proj: torch.Tensor
    compress_gate: torch.Tensor
    compress_ape: torch.Tensor


class IndexerOptions(NamedTuple):
    """Everything but tensors that decides the indexer's ids: geometry (``topk``, ``pool_size``,
    ``tail``), precision (the :class:`~inductor_ext.PrecisionConfig` fields ``kpool``,
    ``kpool_pooling``, ``head_proj``, ``mqa_layout``, ``logits_budget_mb``, ``batch_invariant``) and
    the serving constants ``scale_fmt``, ``eps``. Build it with :meth:`resolve`."""

    topk: int
    pool_size: int
    tail: str
    kpool: str
    kpool_pooling: str
    head_proj: str
    mqa_layout: str
    logits_budget_mb: int
    batch_invariant: bool
    scale_fmt: str = INDEXER_SCALE_FMT
    eps: float = INDEXER_EPS

    @classmethod
    def resolve(cls, *, topk: int, pool_size: int = 4, tail: str = "compact", precision: PrecisionConfig | None = None,
                kpool=None, kpool_pooling=None, head_proj=None, mqa_layout=None, logits_budget_mb=None,
                batch_invariant=None, scale_fmt: str = INDEXER_SCALE_FMT, eps: float = INDEXER_EPS) -> IndexerOptions:
        """The options, each precision field ``None`` taken from ``precision`` (else the active config,
        read while tracing, so each is a constant of the graph); checked (``ValueError`` naming the field)."""
        cfg = active_config() if precision is None else precision
        given = dict(kpool=kpool, kpool_pooling=kpool_pooling, head_proj=head_proj, mqa_layout=mqa_layout,
                     logits_budget_mb=logits_budget_mb, batch_invariant=batch_invariant)
        fields = {name: getattr(cfg, name) if value is None else value for name, value in given.items()}
        opts = cls(topk=topk, pool_size=pool_size, tail=tail, scale_fmt=scale_fmt, eps=eps, **fields)
        check_choice("kpool", opts.kpool, PRECISIONS)
        check_choice("kpool_pooling", opts.kpool_pooling, POOLINGS)
        check_choice("mqa_layout", opts.mqa_layout, workspace.LAYOUTS)
        check_choice("scale_fmt", opts.scale_fmt, ref.SCALE_FMTS)
        check_choice("tail", opts.tail, TAILS)
        check_pool_geometry(opts.topk, opts.pool_size)
        check_positive_int("logits_budget_mb", opts.logits_budget_mb)
        return opts


class PackedKeys:
    """The key source of one packed batch: every query's keys are the batch's own, pooled per
    document (``cu_seqlens [N+1]`` over ``num_tokens`` tokens)."""

    def __init__(self, cu_seqlens: torch.Tensor, num_tokens: int):
        self.cu_seqlens, self.num_tokens = cu_seqlens, num_tokens

    def pools(self, k, gate, ape, opts: IndexerOptions):
        """``(pool [S, 128], scale [S], (q_lo, q_n, tail_start, tail_len))`` of the batch's keys."""
        pool_token, *rows = kpool_layout(self.cu_seqlens, self.num_tokens, opts.pool_size)
        return (*indexer_pools(k, gate, ape, pool_token, opts), rows)


def check_indexer_inputs(x, q_resid, weights: IndexerWeights, opts: IndexerOptions) -> None:
    """Static checks of the indexer's inputs (``ValueError`` naming the rule)."""
    tensors("kpool", x=x, q_resid=q_resid, **dict(zip(IndexerWeights._fields, weights)))
    check_tensor("x", x, dims=2, dtypes=FLOAT_DTYPES)
    T = x.shape[0]
    if T < 1:
        raise input_error("kpool: the indexer needs at least one token (T >= 1)")
    if opts.kpool == "fp8" and x.dtype != torch.bfloat16:
        raise input_error(f"kpool: the fp8 indexer takes bf16 hidden states, got {x.dtype}")
    H = weights.weights_proj.shape[0]
    check_heads(H, "weights_proj.shape[0]")
    check_tensor("q_resid", q_resid, dims=2, dtypes=(x.dtype,))
    if q_resid.shape[0] != T:
        raise input_error(f"kpool: q_resid must have T={T} rows, got {tuple(q_resid.shape)}")
    check_tensor("wq_b", weights.wq_b, dtypes=(x.dtype,), shape=(H * ref.HEAD_DIM, q_resid.shape[1]))
    check_tensor("compress_ape", weights.compress_ape, dtypes=FLOAT_DTYPES, shape=(opts.pool_size, ref.HEAD_DIM))
    check_same_device(x=x, q_resid=q_resid, wq_b=weights.wq_b, compress_ape=weights.compress_ape)


def run_indexer(x, q_resid, weights: IndexerWeights, opts: IndexerOptions, keys) -> torch.Tensor:
    """Selected token ids int32 ``[M, topk + P - 1]`` of the query rows ``x [M, hidden]``,
    ``q_resid [M, Qr]`` against the pools ``keys`` builds (a key source: ``keys.pools(k, gate, ape,
    opts)`` → ``(pool, scale, (q_lo, q_n, tail_start, tail_len))``, ``keys.num_tokens`` the id bound
    or None). Inputs checked by :func:`check_indexer_inputs`; runs under no_grad (frozen indexer)."""
    with torch.no_grad():
        project = kpool_project_batch_invariant if opts.batch_invariant else kpool_project
        k, gate, w = project(x, weights.wk, weights.k_norm_weight, weights.k_norm_bias, weights.weights_proj,
                             weights.compress_gate, eps=opts.eps, head_proj=opts.head_proj)
        with torch.autocast(device_type=q_resid.device.type, enabled=False):
            q = (bi_linear if opts.batch_invariant else torch.nn.functional.linear)(q_resid, weights.wq_b)
        q = q.view(q_resid.shape[0], -1, ref.HEAD_DIM)
        pool, pool_scale, rows = keys.pools(k, gate, weights.compress_ape, opts)
        if opts.kpool == "bf16":
            q = q.to(torch.bfloat16)
        else:
            q, w = kpool_quant_query(q, w, scale_fmt=opts.scale_fmt)
        return indexer_score_select(q, w, pool, pool_scale, *rows, opts, num_tokens=keys.num_tokens)


def kpool_indexer(
    x, q_resid, wq_b, wk, k_norm_weight, k_norm_bias, weights_proj, compress_gate, compress_ape,
    cu_seqlens=None, *, topk, pool_size=4, kpool=None, kpool_pooling=None, head_proj=None,
    mqa_layout=None, logits_budget_mb=None, scale_fmt=INDEXER_SCALE_FMT, tail="compact", eps=INDEXER_EPS,
    batch_invariant=False,
):
    """The GLM-5.3 KPool indexer on one packed batch, flat arguments: :func:`run_indexer` with
    :class:`PackedKeys`.

    Args:
        x: hidden states ``[T, hidden]`` (model dtype, bf16 for the FP8 path); q_resid ``[T, Qr]``.
        wq_b, wk, k_norm_weight, k_norm_bias, weights_proj, compress_gate, compress_ape: the
            :class:`IndexerWeights`. H in 32, 64, 128.
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
    weights = IndexerWeights(wq_b, wk, k_norm_weight, k_norm_bias, weights_proj, compress_gate, compress_ape)
    opts = IndexerOptions.resolve(topk=topk, pool_size=pool_size, tail=tail, kpool=kpool, kpool_pooling=kpool_pooling,
                                  head_proj=head_proj, mqa_layout=mqa_layout, logits_budget_mb=logits_budget_mb,
                                  batch_invariant=batch_invariant, scale_fmt=scale_fmt, eps=eps)
    check_indexer_inputs(x, q_resid, weights, opts)
    tensors("kpool", optional=("cu_seqlens",), cu_seqlens=cu_seqlens)
    if cu_seqlens is None:
        # built on the device (no host-to-device copy, so it is safe inside CUDA-graph capture)
        cu_seqlens = torch.arange(2, dtype=torch.int64, device=x.device) * x.shape[0]
    check_same_device(x=x, cu_seqlens=cu_seqlens)
    return run_indexer(x, q_resid, weights, opts, PackedKeys(cu_seqlens, x.shape[0]))


def indexer_pools(k, gate, ape, pool_token, opts: IndexerOptions):
    """``(pool [S, 128], scale [S] fp32)``: :func:`kpool_compress` in the indexer's mode for
    ``opts.kpool``: ``"bf16"`` rounds k and gate to BF16 and pools as ``opts.kpool_pooling`` says
    (``"reference"``: transformers' BF16 pooling, else FP32 pooling); ``"fp8"`` runs the serving
    quantizer with ``opts.scale_fmt`` scales (k and gate must already be BF16)."""
    if opts.kpool == "bf16":
        mode = "bf16_reference" if opts.kpool_pooling == "reference" else "bf16_fp32"
        return kpool_compress(k.to(torch.bfloat16), gate.to(torch.bfloat16), ape, pool_token, mode=mode)
    return kpool_compress(k, gate, ape, pool_token, mode=f"fp8_{opts.scale_fmt}")


def indexer_score_select(q, w, pool, pool_scale, q_lo, q_n, tail_start, tail_len, opts: IndexerOptions, *,
                         num_tokens=None):
    """Scores (:func:`kpool_logits`, or :func:`kpool_logits_batch_invariant`) and selection
    (:func:`kpool_select`) of the query rows ``q [M, H, 128]`` against ``pool [S, 128]``, in row
    chunks whose scoring memory fits ``opts.logits_budget_mb`` MiB (the logits workspace; ``[rows, H, S]`` FP32
    products when ``batch_invariant``); ``num_tokens``: T, for :func:`kpool_select`'s eager id bound.
    Returns int32 ``[M, topk + P - 1]``.

    One op, ``glm53::kpool_score_select``: the chunk count depends on M and S, so the loop runs
    inside the op's kernel on concrete sizes, and a compiled graph holds one call whatever the token
    count (M and S stay symbolic; no Python arithmetic on them while tracing)."""
    return torch.ops.glm53.kpool_score_select(q, w, pool, pool_scale, q_lo, q_n, tail_start, tail_len, opts.kpool,
                                              opts.mqa_layout, opts.logits_budget_mb, opts.topk, opts.pool_size,
                                              opts.tail, opts.batch_invariant, num_tokens)


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
