"""DSA token mixer of GLM-5.3's indexed-attention layers: MLA without RoPE + the KPool indexer +
sparse attention over the selected token ids.

q_a → RMSNorm → q_b (q_nope); kv_a → RMSNorm (the latent); the indexer (``ops.kpool_indexer``,
precision from ``PrecisionConfig.kpool*`` / ``head_proj`` / ``mqa_layout`` / ``logits_budget_mb``)
picks ``index_topk`` tokens per query in pools of ``index_kpool`` plus the visible tail, and the
attention reads only those. ``PrecisionConfig.mla`` picks the form:

- ``"decompressed"`` (transformers): kv_b maps the latent to per-head keys and values and
  :func:`graphs.sparse_attention.sparse_attention` attends over them (a ``[T, T]`` selection mask:
  up to :data:`graphs.sparse_attention.MAX_MASK_TOKENS` tokens);
- ``"absorbed"`` (serving): q_nope goes through the key half of kv_b into the latent space (one BF16
  rounding), ``ops.sparse_mla`` attends with the latent as key and value for all heads (O(T·topk)),
  and the latent output goes through the value half of kv_b. The scale stays ``qk_nope_head_dim^-½``.

A ``"shared"`` layer has no indexer and reuses the previous layer's ids. Parameter names follow
transformers ``Glm5NextTextAttention`` / ``Glm5NextTextIndexer``.
"""

from __future__ import annotations

import torch
from torch import nn

from graphs.cache import Buffer, CachedKeys
from graphs.config import GLM53Config
from graphs.modules import RMSNorm, linear
from graphs.sparse_attention import sparse_attention
from inductor_ext import PrecisionConfig, ops
from inductor_ext.ops.kpool_pipeline import (
    IndexerOptions,
    IndexerWeights,
    PackedKeys,
    check_indexer_inputs,
    run_indexer,
)
from inductor_ext.parallel import CPContext, GatheredKeys

__all__ = ["Indexer", "IndexedAttention", "DSACache"]


class Indexer(nn.Module):
    """The KPool indexer: its parameters and options, one pipeline
    (:func:`~inductor_ext.ops.kpool_pipeline.run_indexer`) whatever the key source. Frozen: it
    returns integer ids, so its parameters never receive gradients (``docs/DESIGN.md`` §7.1)."""

    def __init__(self, config: GLM53Config):
        super().__init__()
        D, Hd, H = config.hidden_size, config.index_head_dim, config.index_n_heads
        self.wq_b = nn.Linear(config.q_lora_rank, H * Hd, bias=False)
        self.wk = nn.Linear(D, Hd, bias=False)
        self.k_norm = nn.LayerNorm(Hd, eps=1e-6)
        self.weights_proj = nn.Linear(D, H, bias=False)
        self.index_kpool_compress_ape = nn.Parameter(torch.randn(config.index_kpool, Hd))
        self.index_kpool_compress_gate = nn.Parameter(torch.randn(Hd, D) * 0.05)
        self.topk, self.pool = config.index_topk, config.index_kpool
        self.select_tail = config.index_kpool_always_select_tail

    def weights(self) -> IndexerWeights:
        return IndexerWeights(self.wq_b.weight, self.wk.weight, self.k_norm.weight, self.k_norm.bias,
                              self.weights_proj.weight, self.index_kpool_compress_gate, self.index_kpool_compress_ape)

    def options(self, prec: PrecisionConfig) -> IndexerOptions:
        """The indexer's options under ``prec`` (the one place they are built)."""
        return IndexerOptions.resolve(topk=self.topk, pool_size=self.pool, precision=prec,
                                      tail="compact" if self.select_tail else "fixed")

    def forward(self, x, q_resid, keys, prec: PrecisionConfig) -> torch.Tensor:
        """x ``[M, D]``, q_resid ``[M, q_lora_rank]`` → int32 ``[M, topk (+ pool-1 with the tail)]``
        global token ids, against the pools of the key source ``keys``: the packed batch
        (:class:`~inductor_ext.ops.kpool_pipeline.PackedKeys`), the context-parallel gather
        (:class:`~inductor_ext.parallel.GatheredKeys`) or the decode cache
        (:class:`~graphs.cache.CachedKeys`)."""
        weights, opts = self.weights(), self.options(prec)
        check_indexer_inputs(x, q_resid, weights, opts)
        ids = run_indexer(x, q_resid, weights, opts, keys)
        return ids if self.select_tail else ids[:, : self.topk]


class DSACache:
    """A DSA layer's decode state: the MLA latent of every token so far (:class:`~graphs.cache.Buffer`
    ``[n, t, kv_lora_rank]``, what serving caches) and, for a layer with its own indexer, its
    :class:`~graphs.cache.CachedKeys`."""

    def __init__(self, latent: torch.Tensor, keys: CachedKeys | None):
        self.latent, self.keys = Buffer(latent), keys


class IndexedAttention(nn.Module):
    """MLA (NoPE) with DSA sparse attention: ``[T, hidden]`` → (``[T, hidden]``, token ids)."""

    def __init__(self, config: GLM53Config, layer_idx: int):
        super().__init__()
        D, H = config.hidden_size, config.num_attention_heads
        self.num_heads, self.nope, self.v_dim = H, config.qk_nope_head_dim, config.v_head_dim
        bias = config.attention_bias
        self.q_a_proj = nn.Linear(D, config.q_lora_rank, bias=bias)
        self.q_a_layernorm = RMSNorm(config.q_lora_rank, config.rms_norm_eps)
        self.q_b_proj = nn.Linear(config.q_lora_rank, H * self.nope, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(D, config.kv_lora_rank, bias=bias)
        self.kv_a_layernorm = RMSNorm(config.kv_lora_rank, config.rms_norm_eps)
        self.kv_b_proj = nn.Linear(config.kv_lora_rank, H * (self.nope + self.v_dim), bias=False)
        self.o_proj = nn.Linear(H * self.v_dim, D, bias=bias)
        self.shared = config.indexer_types[layer_idx] == "shared"
        self.indexer = None if self.shared else Indexer(config)
        self.scale, self.impl = self.nope**-0.5, config.attn_impl

    def forward(self, x, cu_seqlens, prev_ids, prec: PrecisionConfig, cp: CPContext | None = None):
        """x ``[T, hidden]`` → (``[T, hidden]``, token ids). With ``cp`` (context parallel) x holds this
        rank's local tokens, the ids are global, and the attention reads the latent of every rank,
        all-gathered into global order (its gradient returns by reduce-scatter); the decompressed
        form then maps the whole gathered latent through kv_b on every rank."""
        latent = self.latent(x, prec)
        if cp is not None:
            return self.attend(x, cp.unshard(latent), GatheredKeys(cp), prev_ids, prec)
        if cu_seqlens is None:  # one document, built on the device (safe inside CUDA-graph capture)
            cu_seqlens = torch.arange(2, dtype=torch.int64, device=x.device) * x.shape[0]
        return self.attend(x, latent, PackedKeys(cu_seqlens, x.shape[0]), prev_ids, prec)

    def prefill(self, x, num_seqs: int, prev_ids, prec: PrecisionConfig):
        """:meth:`attend` on ``num_seqs`` packed prompts of equal length (absorbed form) →
        (``[T, hidden]``, token ids, the layer's :class:`DSACache`)."""
        latent = self.latent(x, prec)
        cache = DSACache(latent.view(num_seqs, -1, latent.shape[-1]), None if self.shared else CachedKeys(num_seqs))
        return (*self.attend(x, latent, cache.keys, prev_ids, prec), cache)

    def step(self, x, prev_ids, cache: DSACache, prec: PrecisionConfig):
        """:meth:`attend` on one new token per sequence ``x [n, hidden]`` against ``cache`` (appended
        in place) → (``[n, hidden]``, token ids)."""
        cache.latent.append(self.latent(x, prec))
        latent = cache.latent.view()
        return self.attend(x, latent.reshape(-1, latent.shape[-1]), cache.keys, prev_ids, prec)

    def attend(self, x, latent, keys, prev_ids, prec: PrecisionConfig):
        """The attention of the query rows ``x [M, hidden]`` over ``latent [S, R]`` (every key token),
        the indexer scoring against ``keys`` (a shared layer: ``prev_ids``) → (``[M, hidden]``, ids)."""
        M = x.shape[0]
        q_resid, q = self.query(x, prec)
        if self.indexer is not None:
            ids = self.indexer(x, q_resid, keys, prec)
        elif prev_ids is None:
            raise ValueError("IndexedAttention: a shared-indexer layer needs the previous DSA layer's token ids")
        else:
            ids = prev_ids
        if prec.mla == "absorbed":
            out = self.absorbed_attention(q, latent, ids, prec)
        else:
            kv = self.kv_b_proj(latent).view(latent.shape[0], self.num_heads, -1)
            k, v = kv.split([self.nope, self.v_dim], dim=-1)
            out = sparse_attention(q, k, v, ids, scale=self.scale, impl=self.impl)
        return linear(self.o_proj, out.reshape(M, -1), prec), ids

    def query(self, x: torch.Tensor, prec: PrecisionConfig) -> tuple[torch.Tensor, torch.Tensor]:
        """(q_resid ``[T, q_lora_rank]`` (the indexer's query input), q_nope ``[T, H, nope]``)."""
        q_resid = self.q_a_layernorm(linear(self.q_a_proj, x, prec), prec)
        return q_resid, linear(self.q_b_proj, q_resid, prec).view(x.shape[0], self.num_heads, self.nope)

    def latent(self, x: torch.Tensor, prec: PrecisionConfig) -> torch.Tensor:
        """The MLA latent ``kv_a_layernorm(kv_a_proj_with_mqa(x))`` ``[T, kv_lora_rank]``: what serving caches."""
        return self.kv_a_layernorm(linear(self.kv_a_proj_with_mqa, x, prec), prec)

    def kv_b_halves(self) -> tuple[torch.Tensor, torch.Tensor]:
        """kv_b_proj's weight as its key half ``[H, nope, R]`` and value half ``[H, v_dim, R]``."""
        w = self.kv_b_proj.weight.view(self.num_heads, self.nope + self.v_dim, -1)
        return w[:, : self.nope], w[:, self.nope:]

    def absorbed_attention(self, q: torch.Tensor, latent: torch.Tensor, ids: torch.Tensor,
                           prec: PrecisionConfig) -> torch.Tensor:
        """Absorbed MLA over the selected ids: q ``[T, H, nope]``, latent ``[S, R]`` (S keys; the
        ids index it) → ``[T, H, v_dim]``. The absorbed query and the latent output are rounded to
        the model dtype (the serving engine's BF16 GEMM outputs); with ``prec.batch_invariant`` both
        per-head products run as ``ops.bi_grouped_linear`` with one group per head."""
        w_k, w_v = self.kv_b_halves()
        if prec.batch_invariant:
            q_abs = _per_head_linear(q, w_k.transpose(1, 2))
            return _per_head_linear(ops.sparse_mla(q_abs, latent, ids, scale=self.scale), w_v)
        q_abs = torch.einsum("thn,hnr->thr", q, w_k)
        out = ops.sparse_mla(q_abs, latent, ids, scale=self.scale)
        return torch.einsum("thr,hvr->thv", out, w_v)


def _per_head_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``out[t, h] = x[t, h] · weight[h]ᵀ``: x ``[T, H, K]``, weight ``[H, N, K]`` → ``[T, H, N]``
    through the batch-invariant grouped GEMM (the rows of head h form group h)."""
    T, H, K = x.shape
    offs = torch.arange(1, H + 1, device=x.device, dtype=torch.int32) * T
    rows = x.transpose(0, 1).reshape(H * T, K)
    return ops.bi_grouped_linear(rows, weight.contiguous(), offs).view(H, T, -1).transpose(0, 1)
