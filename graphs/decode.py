"""Incremental serving decode: one token per sequence per step, with per-layer caches.

:class:`ServingDecoder` runs the layers of a :class:`~graphs.serving.ServingForward` (same modules,
same weights, same precision choices, no copy) on ``n`` sequences of equal length:
``prefill(prompts [n, L])`` runs the packed prompts once and builds the caches, ``step(tokens [n])``
appends one token per sequence and returns its next-token logits. The decoder is a loop over the
layers' own ``prefill`` / ``step`` (:meth:`~graphs.model.DecoderLayer.prefill`), which run the
layer's forward body around the attention's own decode methods, so the logits equal the
last-position logits of ``ServingForward`` on the packed prefixes by construction
(``tests/graphs/test_decode.py`` holds it bitwise).

The attention modules own their decode state (``docs/DESIGN.md`` §5):

- KDA (:meth:`~graphs.kda_layer.LinearAttention.prefill` / ``step``): the short-conv window (the
  last ``kernel - 1`` pre-conv rows, convolved with a step's new row under the document-position
  mask of the full run) and, by ``PrecisionConfig.batch_invariant``, the FP32 recurrent state
  (``ops.kda_recurrent``; a step is ``n`` one-token documents continuing it) or the chunk-replay
  cache (:mod:`graphs.kda_replay`: the state at the last 64-token boundary and the open chunk's
  inputs; a step reruns ``ops.kda_chunk`` on the open chunk, O(chunk) per step).
- DSA (:meth:`~graphs.dsa_layer.IndexedAttention.prefill` / ``step``, :class:`~graphs.dsa_layer.DSACache`):
  the MLA latent (what serving caches) and the indexer's key source
  :class:`~graphs.cache.CachedKeys` (per-token keys and gates, the compressed pools), laid out as
  the packed forward lays them out, so a step's ids are the packed forward's.
- mHC, RMSNorms, MLP / MoE, embedding, final norm and lm_head are per token: no cache.

Per step the cost is one token per sequence through every per-token module, O(1) (recurrence) or
O(chunk) (replay) for KDA, O(t) for a DSA layer's pool scoring and O(topk) for its attention.
Forward only, eager; call under ``torch.no_grad()``.
"""

from __future__ import annotations

import dataclasses

import torch

from graphs.modules import linear
from graphs.serving import ServingForward

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


@dataclasses.dataclass
class DecodeCache:
    """Per-layer caches of ``num_seqs`` sequences of ``length`` tokens each (see the module doc;
    fewer than 12 sequences are cached with padding copies of the last one, see ``_MIN_ROWS``, except
    under ``batch_invariant``).
    ``layers[i]`` is the cache layer ``i``'s attention keeps (a dict for KDA, a
    :class:`~graphs.dsa_layer.DSACache` for DSA)."""

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
        streams = self.model.embed(prompts.reshape(-1))
        caches, ids = [], None
        for layer in self.model.layers:
            streams, ids, cache = layer.prefill(streams, n, ids, self.precision)
            caches.append(cache)
        hidden = self.model.final_norm(streams.view(n, L, *streams.shape[1:])[:, -1], self.precision)
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
        streams = self.model.embed(_pad_rows(tokens, self.precision.batch_invariant))
        ids = None
        for layer, layer_cache in zip(self.model.layers, cache.layers):
            streams, ids = layer.step(streams, ids, layer_cache, self.precision)
        cache.length += 1
        return self._out(self.model.final_norm(streams, self.precision), cache, with_hidden)

    # ------------------------------------------------------------------ model pieces

    def _out(self, hidden, cache, with_hidden: bool):
        """The lm_head over every row (padding rows included: the GEMM's shape is the step's), then
        the sequences' rows."""
        logits = linear(self.model.lm_head, hidden, self.precision)[: cache.num_seqs]
        return (logits, hidden[: cache.num_seqs], cache) if with_hidden else (logits, cache)
