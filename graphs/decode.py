"""Incremental serving decode: one token per sequence per step, with per-layer caches.

:class:`ServingDecoder` runs the layers of a :class:`~graphs.serving.ServingForward` (same modules,
same weights, same precision choices, no copy) on ``n`` sequences of equal length:
``prefill(prompts [n, L])`` runs the packed prompts once and builds the caches, ``step(tokens [n])``
appends one token per sequence and returns its next-token logits. The logits equal the
last-position logits of ``ServingForward`` on the packed prefixes (``tests/graphs/test_decode.py``).

Caches (:class:`DecodeCache`, updated in place; buffers grow by doubling):

- KDA layer: the short-conv window, the last ``kernel - 1`` *pre-conv* q/k/v projection rows
  ``[n, kernel-1, 3HK]`` in the model dtype; the conv of a step's new row reads the window with the
  document-position mask of :meth:`LinearAttention.short_conv` (same FP32 sum order). Then, by
  ``PrecisionConfig.batch_invariant``:
  ``False`` (serving core ``ops.kda_recurrent``): the FP32 recurrent state ``[n, H, K, V]``; a step
  runs the layer on ``n`` one-token documents from the cached state (``initial_state``), which the
  reference recurrence carries token by token exactly as in the full run.
  ``True`` (chunk replay, :mod:`graphs.kda_replay`, ``docs/DESIGN.md`` §9): the FP32 state at the last
  64-token chunk boundary of each sequence (chunks start at the document start) and the open
  chunk's ``mix`` inputs (layer input and post-conv q/k/v rows, ``[n, 64, ·]`` model dtype); a step
  runs ``mix`` with ``ops.kda_chunk`` at ``prec.kda`` on the open chunk from the boundary state and
  keeps the last row, bitwise the chunk forward's row of that token; the step that completes a
  chunk advances the boundary state. O(chunk) per step instead of O(1).
- DSA layer (MLA in the absorbed form, what serving caches): the latent
  ``kv_a_layernorm(kv_a_proj_with_mqa(x))`` ``[n, t, kv_lora_rank]``, and for a layer with its own
  indexer the KPool indexer's per-token key and compression gate (``kpool_project``, model dtype)
  plus the compressed pools ``[n, t // P, 128]`` with their FP32 scales (``kpool_compress``; one new
  pool per sequence whenever a step completes one). The new query is scored against the cached
  pools of all sequences laid out as the packed forward lays them out (slot ``i·(t//P) + p``), and
  ``kpool_select`` picks with the same causal metadata (``q_lo``, ``q_n``, ``tail_start``,
  ``tail_len``) the packed forward gives that position, so the token ids are the packed forward's
  (global ids ``i·t + j``, which index the cached latent flattened to ``[n·t, R]``); a ``"shared"``
  layer reuses them. Attention is ``ops.sparse_mla`` over the gathered latent rows (O(topk) per
  query), the same op and per-row arithmetic as the packed forward.
- mHC, RMSNorms, MLP / MoE, embedding, final norm and lm_head are per token: no cache.

Per step the cost is one token per sequence through every per-token module, O(1) for KDA, and
O(t) for a DSA layer (pool scoring over the prefix's t/P pools) and O(topk) for its attention.
Forward only, eager; call under ``torch.no_grad()``.
"""

from __future__ import annotations

import dataclasses

import torch

from graphs.kda_layer import LinearAttention, document_positions
from graphs.kda_replay import replay_prefill, replay_step
from graphs.modules import linear, stream_mean
from graphs.serving import ServingForward
from inductor_ext.ops.kpool import INDEXER_EPS, INDEXER_SCALE_FMT, kpool_layout
from inductor_ext.ops.kpool_pipeline import (
    indexer_keys,
    indexer_pools,
    indexer_query,
    indexer_score_select,
    indexer_scorer_query,
)

__all__ = ["ServingDecoder", "DecodeCache"]


# MKL's FP32 sgemm (torch 2.13 CPU, AVX512) rounds a row's last FP32 bit differently for small
# row counts: measured for F.linear(z[:M], fn) ([M, 512] x [24, 512], mhc_pre's projection) against
# the same rows inside M = 4096, every row differs for M in {1, 2, 3, 5, 6, 7, 9, 10, 11} and none
# for M = 4, 8 and every M >= 12. mhc_pre's FP32 projection, the MoE router and the FP32 indexer head
# projection are such linears, and a packed forward of many tokens runs them with M >= 12, so a step
# of fewer than 12 sequences runs on copies of the last sequence up to 12 rows (dropped from the
# outputs) to stay bitwise equal to the full re-forward. (Only matching a reference that itself
# depends on its batch size; GPU GEMMs have their own heuristics.) Under batch_invariant every such
# linear is a batch-invariant op, so no row is padded.
_MIN_ROWS = 12


def _pad_rows(t: torch.Tensor, batch_invariant: bool) -> torch.Tensor:
    if batch_invariant or t.shape[0] >= _MIN_ROWS:
        return t
    return torch.cat([t, t[-1:].expand(_MIN_ROWS - t.shape[0], *t.shape[1:])], dim=0)


class _Buffer:
    """``[n, length, *rest]`` tensor appended along dim 1, capacity doubling (amortized O(1) per row)."""

    def __init__(self, data: torch.Tensor):
        self.length = data.shape[1]
        cap = max(8, 2 * self.length)
        self.data = data.new_zeros(data.shape[0], cap, *data.shape[2:])
        self.data[:, : self.length] = data

    def append(self, rows: torch.Tensor) -> None:
        """rows ``[n, *rest]``."""
        if self.length == self.data.shape[1]:
            grown = self.data.new_zeros(self.data.shape[0], 2 * self.data.shape[1], *self.data.shape[2:])
            grown[:, : self.length] = self.data
            self.data = grown
        self.data[:, self.length] = rows
        self.length += 1

    def view(self) -> torch.Tensor:
        return self.data[:, : self.length]


@dataclasses.dataclass
class DecodeCache:
    """Per-layer caches of ``num_seqs`` sequences of ``length`` tokens each (see the module doc;
    fewer than 12 sequences are cached with padding copies of the last one, see ``_MIN_ROWS``, except
    under ``batch_invariant``).
    ``layers[i]`` is a dict: KDA ``{"state", "window"}``; DSA ``{"latent"}`` (+ ``{"ik", "igate",
    "pool", "pool_scale"}`` with an own indexer)."""

    num_seqs: int
    length: int
    layers: list


class ServingDecoder:
    """Incremental decode over ``serve``'s model, weights and precision (see the module doc).
    Serving caches the MLA latent, so ``serve.precision.mla`` must be ``"absorbed"``."""

    def __init__(self, serve: ServingForward):
        if not isinstance(serve, ServingForward):
            raise ValueError(f"ServingDecoder: serve must be a ServingForward, got {type(serve).__name__}")
        if serve.precision.mla != "absorbed":
            raise ValueError(f"ServingDecoder: the decoder caches the MLA latent and needs "
                             f"PrecisionConfig.mla='absorbed', got {serve.precision.mla!r}")
        self.serve = serve
        self.model = serve.model
        self.config = serve.model.config

    @property
    def precision(self):
        return self.serve.precision

    # ------------------------------------------------------------------ public API

    @torch.no_grad()
    def prefill(self, prompts: torch.Tensor, *, with_hidden: bool = False):
        """prompts int64 ``[n, L]`` → (next-token logits ``[n, V]`` (model dtype), cache); with
        ``with_hidden`` (logits, the final hidden states ``[n, D]`` (the lm_head input), cache)."""
        if prompts.dtype != torch.int64 or prompts.dim() != 2 or prompts.shape[1] < 1 or prompts.shape[0] < 1:
            raise ValueError(f"ServingDecoder.prefill: prompts must be int64 [n, L>=1], got "
                             f"{prompts.dtype} {tuple(prompts.shape)}")
        num_seqs = prompts.shape[0]
        prompts = _pad_rows(prompts, self.precision.batch_invariant)
        n, L = prompts.shape
        cu = torch.arange(n + 1, dtype=torch.int64, device=prompts.device) * L
        streams = self._embed(prompts.reshape(-1))
        caches, ids = [], None
        for layer in self.model.layers:
            streams, ids, cache = self._layer(layer, streams, ids, n, L, cu=cu)
            caches.append(cache)
        hidden = self._final(streams.view(n, L, *streams.shape[1:])[:, -1])
        return self._out(hidden, DecodeCache(num_seqs, L, caches), with_hidden)

    @torch.no_grad()
    def step(self, tokens: torch.Tensor, cache: DecodeCache, *, with_hidden: bool = False):
        """tokens int64 ``[n]`` (one new token per sequence) → (its next-token logits ``[n, V]``,
        cache, updated in place and returned); with ``with_hidden`` (logits, hidden ``[n, D]``, cache)."""
        if not isinstance(cache, DecodeCache):
            raise ValueError(f"ServingDecoder.step: cache must be a DecodeCache, got {type(cache).__name__}")
        if tokens.dtype != torch.int64 or tuple(tokens.shape) != (cache.num_seqs,):
            raise ValueError(f"ServingDecoder.step: tokens must be int64 [{cache.num_seqs}], got "
                             f"{tokens.dtype} {tuple(tokens.shape)}")
        tokens = _pad_rows(tokens, self.precision.batch_invariant)
        n, t = tokens.shape[0], cache.length + 1  # n: rows incl. padding; t: length after appending
        streams = self._embed(tokens)
        ids = None
        for i, layer in enumerate(self.model.layers):
            streams, ids, cache.layers[i] = self._layer(layer, streams, ids, n, t, cache=cache.layers[i])
        cache.length = t
        return self._out(self._final(streams), cache, with_hidden)

    # ------------------------------------------------------------------ model pieces

    def _embed(self, tokens):
        x = self.model.embed_tokens(tokens)
        return x.unsqueeze(1).expand(-1, self.config.hc_mult, -1).contiguous()

    def _final(self, streams):
        """The final hidden states (stream mean, final norm): the lm_head input."""
        return self.model.norm(stream_mean(streams, self.precision), self.precision)

    def _out(self, hidden, cache, with_hidden: bool):
        """The lm_head over every row (padding rows included: the GEMM's shape is the step's), then
        the sequences' rows."""
        logits = linear(self.model.lm_head, hidden, self.precision)[: cache.num_seqs]
        return (logits, hidden[: cache.num_seqs], cache) if with_hidden else (logits, cache)

    def _layer(self, layer, streams, prev_ids, n, t, cu=None, cache=None):
        """DecoderLayer.forward (serving) on ``streams`` ``[rows, N, D]``: the packed prompts
        (``cu`` given, builds the cache) or one new token per sequence (``cache`` given)."""
        prec = self.precision
        x, post, comb = layer.attn_input(streams, prec)
        ids = None
        if layer.kind == "linear_attention":
            x, cache = self._kda(layer.self_attn, x, n, t, cu, cache)
        else:
            x, ids, cache = self._dsa(layer.self_attn, x, prev_ids, n, t, cu, cache)
        return layer.ffn(layer.mhc_post(x, streams, post, comb, prec), prec), ids, cache

    # ------------------------------------------------------------------ KDA

    def _kda(self, attn: LinearAttention, x, n, t, cu, cache):
        """LinearAttention.forward(serving=True); prefill (``cu``) or one step (``cache``)."""
        W = attn.kernel - 1
        rows = x.shape[0]
        raw = attn.qkv_proj(x, self.precision)  # [rows, C]; batch-invariant linears under batch_invariant
        if cu is not None:
            qkv = attn.short_conv(raw, document_positions(cu, rows, x.device))
            window = raw.view(n, t, -1)[:, max(t - W, 0):]
            if window.shape[1] < W:  # short prompt: rows before the document start are masked anyway
                window = torch.cat([window.new_zeros(n, W - window.shape[1], window.shape[2]), window], 1)
            state0, kda_cu = None, cu
        else:
            # the conv over each sequence's window + new row; only the new row's output (document
            # position t - 1, so the zero rows before a short prompt's start stay masked) is kept
            span = torch.cat([cache["window"], raw[:, None]], dim=1)  # [n, W + 1, C]
            pos = torch.arange(t - 1 - W, t, device=x.device).repeat(n)
            qkv = attn.short_conv(span.reshape(n * (W + 1), -1), pos)[W::W + 1]
            window = span[:, 1:]
            state0 = cache["state"]
            kda_cu = torch.arange(n + 1, dtype=torch.int64, device=x.device)  # n one-token documents
        if self.precision.batch_invariant:
            return self._kda_replay(attn, x, qkv, window, n, t, cu, cache)
        out, state = attn.mix(x, qkv, kda_cu, self.precision, serving=True, initial_state=state0)
        return out, {"state": state, "window": window}

    def _kda_replay(self, attn, x, qkv, window, n, t, cu, cache):
        """batch_invariant: the chunk form replayed (graphs.kda_replay); cache ``{"window", "state"
        (FP32, at the last chunk boundary), "open_qkv", "open_g", "open_beta"}``."""
        if cu is not None:
            out, cache = replay_prefill(attn, x, qkv, n, t, self.precision)
        else:
            out, cache = replay_step(attn, x, qkv, t, cache, self.precision)
        cache["window"] = window
        return out, cache

    # ------------------------------------------------------------------ DSA

    def _dsa(self, attn, x, prev_ids, n, t, cu, cache):
        """IndexedAttention.forward; prefill (``cu``: the layer's own forward + cache) or one step."""
        prec = self.precision
        if cu is not None:
            out, ids = attn(x, cu, prev_ids, prec)
            latent = attn.latent(x, prec)
            cache = {"latent": _Buffer(latent.view(n, t, -1))}
            if attn.indexer is not None:
                ik, igate, _ = self._project(attn.indexer, x)
                P = attn.indexer.pool
                pool_token = kpool_layout(cu, n * t, P)[0]
                pool, scale = self._compress(ik, igate, attn.indexer, pool_token)
                S = t // P  # complete pools per sequence: the first n·S slots, in sequence order
                cache.update(ik=_Buffer(ik.view(n, t, -1)), igate=_Buffer(igate.view(n, t, -1)),
                             pool=_Buffer(pool[: n * S].view(n, S, pool.shape[-1])),
                             pool_scale=_Buffer(scale[: n * S].view(n, S)))
            return out, ids, cache

        T = x.shape[0]  # = n
        q_resid, q = attn.query(x, prec)
        cache["latent"].append(attn.latent(x, prec))
        if attn.indexer is not None:
            ids = self._index_step(attn.indexer, x, q_resid, n, t, cache)
        elif prev_ids is None:
            raise ValueError("ServingDecoder: a shared-indexer layer needs the previous DSA layer's token ids")
        else:
            ids = prev_ids
        latent = cache["latent"].view()
        out = attn.absorbed_attention(q, latent.reshape(n * t, latent.shape[-1]), ids, prec)
        return linear(attn.o_proj, out.reshape(T, -1), prec), ids, cache

    def _project(self, idx, x):
        """ops.kpool_indexer's key projections ``(k, gate, w)`` (batch-invariant under batch_invariant)."""
        return indexer_keys(x, idx.wk.weight, idx.k_norm.weight, idx.k_norm.bias, idx.weights_proj.weight,
                            idx.index_kpool_compress_gate, eps=INDEXER_EPS, head_proj=self.precision.head_proj,
                            batch_invariant=self.precision.batch_invariant)

    def _compress(self, k, gate, idx, pool_token):
        """The pools as ops.kpool_indexer builds them under the serving precision."""
        prec = self.precision
        return indexer_pools(k, gate, idx.index_kpool_compress_ape, pool_token, kpool=prec.kpool,
                             kpool_pooling=prec.kpool_pooling, scale_fmt=INDEXER_SCALE_FMT)

    def _index_step(self, idx, x, q_resid, n, t, cache):
        """ops.kpool_indexer's row of the new token of each sequence (packed-prefix coordinates)."""
        prec = self.precision
        P, dev = idx.pool, x.device
        ik, igate, w = self._project(idx, x)
        q = indexer_query(q_resid, idx.wq_b.weight, batch_invariant=prec.batch_invariant)
        cache["ik"].append(ik)
        cache["igate"].append(igate)
        if t % P == 0:  # the new token completes pool t/P - 1 of every sequence
            last_k = cache["ik"].view()[:, t - P:].reshape(n * P, -1)
            last_g = cache["igate"].view()[:, t - P:].reshape(n * P, -1)
            token0 = torch.arange(n, dtype=torch.int64, device=dev) * P
            pool, scale = self._compress(last_k, last_g, idx, token0)
            cache["pool"].append(pool)
            cache["pool_scale"].append(scale)
        q, w = indexer_scorer_query(q, w, kpool=prec.kpool, scale_fmt=INDEXER_SCALE_FMT)
        S = t // P
        pools, scales = cache["pool"].view(), cache["pool_scale"].view()
        if S == 0:  # no complete pool yet: one unused slot (score 0, never visible)
            pools, scales = pools.new_zeros(1, pools.shape[-1]), scales.new_zeros(1)
        else:
            pools, scales = pools.reshape(n * S, pools.shape[-1]), scales.reshape(n * S)
        seq = torch.arange(n, dtype=torch.int64, device=dev)
        q_n = torch.full((n,), S, dtype=torch.int64, device=dev)
        tail_start = seq * t + P * q_n
        ids = indexer_score_select(q, w, pools, scales, seq * S, q_n, tail_start, t - P * q_n, kpool=prec.kpool,
                                   layout=prec.mqa_layout, budget_mb=prec.logits_budget_mb, topk=idx.topk,
                                   pool_size=P, tail="compact" if idx.select_tail else "fixed",
                                   batch_invariant=prec.batch_invariant)
        return ids if idx.select_tail else ids[:, : idx.topk]
