"""Decode state the attention modules own: :class:`Buffer` (rows appended per step) and
:class:`CachedKeys`, the KPool indexer's key source while decoding (``docs/DESIGN.md`` §5).

``n`` sequences of equal length ``t`` are laid out as the packed forward lays them out: token ``j``
of sequence ``i`` is global token ``i·t + j``, its pools the slots ``i·(t//P) + p``. A step appends
one token per sequence, so every cached row keeps the coordinates it has in the packed forward of
the prefixes, and the indexer's ids index the cached latent flattened to ``[n·t, R]``.
"""

from __future__ import annotations

import torch

from inductor_ext.ops.kpool import kpool_layout
from inductor_ext.ops.kpool_pipeline import IndexerOptions, indexer_pools

__all__ = ["Buffer", "CachedKeys"]


class Buffer:
    """``[n, length, *rest]`` tensor appended along dim 1, capacity doubling (amortized O(1) per row)."""

    def __init__(self, data: torch.Tensor):
        self.length = data.shape[1]
        self.data = data.new_zeros(data.shape[0], max(8, 2 * self.length), *data.shape[2:])
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


class CachedKeys:
    """The indexer's key source while decoding ``num_seqs`` sequences: the first call (the packed
    prompts, ``num_seqs × t`` rows) pools them as :class:`~inductor_ext.ops.kpool_pipeline.PackedKeys`
    would and keeps the per-token keys and gates (model dtype) and the complete pools; every later
    call (one new token per sequence) appends its key and gate, compresses a new pool per sequence
    when the token completes one, and returns all cached pools with the packed forward's metadata of
    the new tokens' rows. Eager only (the decoder)."""

    num_tokens = None  # the packed forward's id bound, set by the prefill call

    def __init__(self, num_seqs: int):
        self.num_seqs, self.length = num_seqs, 0
        self.k = self.gate = self.pool = self.scale = None

    def pools(self, k, gate, ape, opts: IndexerOptions):
        """``(pool, scale, (q_lo, q_n, tail_start, tail_len))`` for the query rows of this call."""
        return self._prefill(k, gate, ape, opts) if self.k is None else self._step(k, gate, ape, opts)

    def _prefill(self, k, gate, ape, opts: IndexerOptions):
        n, P = self.num_seqs, opts.pool_size
        t = k.shape[0] // n
        cu = torch.arange(n + 1, dtype=torch.int64, device=k.device) * t
        pool_token, *rows = kpool_layout(cu, n * t, P)
        pool, scale = indexer_pools(k, gate, ape, pool_token, opts)
        S = t // P  # complete pools per sequence: the first n·S slots, in sequence order
        self.k, self.gate = Buffer(k.view(n, t, -1)), Buffer(gate.view(n, t, -1))
        self.pool, self.scale = Buffer(pool[: n * S].view(n, S, pool.shape[-1])), Buffer(scale[: n * S].view(n, S))
        self.length, self.num_tokens = t, n * t
        return pool, scale, rows

    def _step(self, k, gate, ape, opts: IndexerOptions):
        n, P, dev = self.num_seqs, opts.pool_size, k.device
        t = self.length + 1
        self.k.append(k)
        self.gate.append(gate)
        if t % P == 0:  # the new token completes pool t/P - 1 of every sequence
            last_k = self.k.view()[:, t - P:].reshape(n * P, -1)
            last_g = self.gate.view()[:, t - P:].reshape(n * P, -1)
            pool, scale = indexer_pools(last_k, last_g, ape, torch.arange(n, dtype=torch.int64, device=dev) * P, opts)
            self.pool.append(pool)
            self.scale.append(scale)
        S = t // P
        pools, scales = self.pool.view(), self.scale.view()
        if S == 0:  # no complete pool yet: one unused slot (score 0, never visible)
            pools, scales = pools.new_zeros(1, pools.shape[-1]), scales.new_zeros(1)
        else:
            pools, scales = pools.reshape(n * S, -1), scales.reshape(n * S)
        seq = torch.arange(n, dtype=torch.int64, device=dev)
        q_n = torch.full((n,), S, dtype=torch.int64, device=dev)
        self.length, self.num_tokens = t, None
        return pools, scales, (seq * S, q_n, seq * t + P * q_n, t - P * q_n)
