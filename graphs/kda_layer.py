"""KDA (Kimi delta attention) token mixer of GLM-5.3's linear-attention layers.

q/k/v projections → depthwise causal conv (kernel 4, FP32, restarted at every document) + SiLU →
``glm53::kda_chunk`` (precision ``PrecisionConfig.kda``) with the forget gate
``lower_bound·σ(exp(A_log)·(f_b(f_a x) + dt_bias))`` and β = σ(b_proj x) → gated RMSNorm (sigmoid
gate from g_b(g_a x)) → o_proj. Parameter names follow transformers ``Glm5NextTextLinearAttention``.

Context parallel (``cp=`` a :class:`~inductor_ext.parallel.CPContext`, ``docs/DESIGN.md`` §8): x
holds this rank's tokens; the short conv reads a 3-token halo of the previous global shard
(:func:`~inductor_ext.parallel.halo_exchange`, one all-gather; bitwise the single-rank conv) and
the KDA core is :func:`~inductor_ext.parallel.kda_chunk_cp` (one all-gather of FP32 end states and
transitions, a fold, the local correction). Every other step is per token.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from graphs.config import GLM53Config
from graphs.kda_replay import replay_prefill, replay_step
from graphs.modules import linear
from inductor_ext import PrecisionConfig, ops
from inductor_ext.ops.kda_reference import kda_chunk_path
from inductor_ext.ops.packing import document_positions
from inductor_ext.parallel.context import CPContext
from inductor_ext.parallel.halo import halo_exchange, with_halo
from inductor_ext.parallel.kda import kda_chunk_cp

__all__ = ["ForgetGate", "GatedRMSNorm", "LinearAttention"]


class ForgetGate(nn.Module):
    """Per-channel log-decay g ``[T, H, K]`` FP32 (≤ 0)."""

    def __init__(self, config: GLM53Config):
        super().__init__()
        H, K = config.linear_num_heads, config.linear_head_dim
        self.f_a_proj = nn.Linear(config.hidden_size, K, bias=False)
        self.f_b_proj = nn.Linear(K, H * K, bias=False)
        self.dt_bias = nn.Parameter(torch.zeros(H * K, dtype=torch.float32))
        self.A_log = nn.Parameter(torch.zeros(H, dtype=torch.float32))
        self.lower_bound, self.head_dim = config.linear_lower_bound, K

    def forward(self, x: torch.Tensor, prec: PrecisionConfig) -> torch.Tensor:
        g = linear(self.f_b_proj, linear(self.f_a_proj, x, prec), prec).float() + self.dt_bias.float()
        g = g.view(x.shape[0], -1, self.head_dim)
        rate = self.A_log.float().exp()[:, None]
        if self.lower_bound is not None:
            return self.lower_bound * torch.sigmoid(rate * g)
        return -rate * torch.where(g > 20.0, g, torch.log1p(torch.exp(g)))


class GatedRMSNorm(nn.Module):
    """``weight · rmsnorm(x) · σ(gate)`` in FP32, rounded once to x's dtype; with
    ``prec.batch_invariant`` the mean square is ``ops.bi_row_sum`` / D (a fixed-order sum)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.variance_epsilon = eps

    def forward(self, x: torch.Tensor, gate: torch.Tensor, prec: PrecisionConfig) -> torch.Tensor:
        xf = x.float()
        if prec.batch_invariant:
            mean_square = ops.bi_row_sum(xf.square()).unsqueeze(-1) / xf.shape[-1]
        else:
            mean_square = xf.square().mean(-1, keepdim=True)
        xf = xf * torch.rsqrt(mean_square + self.variance_epsilon)
        return (self.weight.float() * xf * torch.sigmoid(gate.float())).to(x.dtype)


class LinearAttention(nn.Module):
    """KDA token mixer: ``[T, hidden]`` → ``[T, hidden]`` for packed documents (``cu_seqlens``)."""

    def __init__(self, config: GLM53Config):
        super().__init__()
        D, H, K = config.hidden_size, config.linear_num_heads, config.linear_head_dim
        self.num_heads, self.head_dim, self.kernel = H, K, config.linear_conv_kernel_dim
        self.q_proj = nn.Linear(D, H * K, bias=False)
        self.k_proj = nn.Linear(D, H * K, bias=False)
        self.v_proj = nn.Linear(D, H * K, bias=False)
        self.conv1d = nn.Conv1d(3 * H * K, 3 * H * K, self.kernel, groups=3 * H * K, bias=False,
                                padding=self.kernel - 1, dtype=torch.float32)
        self.forget_gate = ForgetGate(config)
        self.b_proj = nn.Linear(D, H, bias=False)
        self.g_a_proj = nn.Linear(D, K, bias=False)
        self.g_b_proj = nn.Linear(K, H * K, bias=False)
        self.o_norm = GatedRMSNorm(K, config.rms_norm_eps)
        self.o_proj = nn.Linear(H * K, D, bias=False)

    def short_conv(self, x: torch.Tensor, pos: torch.Tensor, halo: torch.Tensor | None = None) -> torch.Tensor:
        """Depthwise causal conv + SiLU in FP32 that never reads across a document start:
        ``out[t] = silu(Σ_s w[K-1-s] · x[t-s] · [pos_t ≥ s])``, rounded to x's dtype.

        ``halo`` (context parallel): ``[n, K-1, C]``, the rows before each of the n equal shards
        of x (:func:`~inductor_ext.parallel.halo_exchange`); each shard is convolved with its halo
        in front, so its first rows read the previous global shard's last rows."""
        if halo is not None:
            n, W = halo.shape[:2]
            L = x.shape[0] // n
            pos_ext = torch.cat([pos.new_zeros(n, W), pos.view(n, L)], 1).reshape(-1)
            out = self.short_conv(with_halo(x, halo), pos_ext)
            return out.view(n, W + L, -1)[:, W:].reshape(n * L, -1)
        xf, w = x.float(), self.conv1d.weight.float()[:, 0, :]  # [T, C], [C, K]
        out = xf * w[:, self.kernel - 1]
        for s in range(1, self.kernel):
            shifted = F.pad(xf, (0, 0, s, 0))[: xf.shape[0]]  # x[t - s], zeros before row 0; any T, no branch
            out = out + torch.where((pos >= s)[:, None], shifted, 0.0) * w[:, self.kernel - 1 - s]
        return F.silu(out).to(x.dtype)

    def forward(self, x: torch.Tensor, cu_seqlens: torch.Tensor | None, prec: PrecisionConfig,
                serving: bool = False, cp: CPContext | None = None) -> torch.Tensor:
        """``serving``: the KDA core is ``kda_recurrent`` (FP32 state, forward only) instead of
        ``kda_chunk`` at ``prec.kda`` (with ``prec.batch_invariant`` serving keeps ``kda_chunk``:
        the serving decoder replays the chunk arithmetic); every other step is the same. ``cp``: x is this rank's
        ``[T_local, hidden]`` of a context-parallel batch (``cu_seqlens`` must be None: the
        context holds the global offsets); training path only (``serving`` raises
        NotImplementedError)."""
        if cp is None:
            pos = document_positions(cu_seqlens, x.shape[0], x.device)
            return self.mix(x, self.short_conv(self.qkv_proj(x, prec), pos), cu_seqlens, prec, serving)[0]
        if serving:
            raise NotImplementedError("LinearAttention: serving=True (kda_recurrent) has no context-parallel path")
        if cu_seqlens is not None:
            raise ValueError("LinearAttention: with cp, pass cu_seqlens to cp_context, not to the layer")
        raw = self.qkv_proj(x, prec)
        qkv = self.short_conv(raw, cp.doc_positions, halo_exchange(raw, cp, self.kernel - 1))
        return self.mix(x, qkv, None, prec, serving, cp=cp)[0]

    def prefill(self, x: torch.Tensor, num_seqs: int, prev_ids, prec: PrecisionConfig):
        """The serving forward of ``num_seqs`` packed prompts of equal length ``x [n·t, hidden]`` →
        (``[n·t, hidden]``, None (no token ids; ``prev_ids`` unused: the DSA layer's interface), the
        layer's decode cache ``{"length", "window", "state", ...}``): the
        short-conv window (the last ``kernel - 1`` pre-conv rows, zeros before a short prompt), then
        the FP32 recurrent state, or under ``prec.batch_invariant`` the chunk-replay cache
        (:mod:`graphs.kda_replay`)."""
        n, W = num_seqs, self.kernel - 1
        t = x.shape[0] // n
        cu = torch.arange(n + 1, dtype=torch.int64, device=x.device) * t
        raw = self.qkv_proj(x, prec)
        qkv = self.short_conv(raw, document_positions(cu, x.shape[0], x.device))
        window = raw.view(n, t, -1)[:, max(t - W, 0):]
        window = torch.cat([window.new_zeros(n, W - window.shape[1], window.shape[2]), window], 1)
        if prec.batch_invariant:
            out, cache = replay_prefill(self, x, qkv, n, t, prec)
        else:
            out, state = self.mix(x, qkv, cu, prec, serving=True)
            cache = {"state": state}
        cache.update(length=t, window=window)
        return out, None, cache

    def step(self, x: torch.Tensor, prev_ids, cache: dict, prec: PrecisionConfig):
        """One new token per sequence ``x [n, hidden]`` → (``[n, hidden]``, None), ``cache`` updated in place:
        the conv over each window + the new row (document position ``length``), then one recurrence
        step from the cached state, or the chunk replay of the open chunk."""
        n, W = x.shape[0], self.kernel - 1
        t = cache["length"] + 1
        span = torch.cat([cache["window"], self.qkv_proj(x, prec)[:, None]], dim=1)  # [n, W + 1, C]
        pos = torch.arange(t - 1 - W, t, device=x.device).repeat(n)
        qkv = self.short_conv(span.reshape(n * (W + 1), -1), pos)[W::W + 1]
        cache.update(length=t, window=span[:, 1:])
        if prec.batch_invariant:
            return replay_step(self, x, qkv, t, cache, prec)[0], None
        one_token_docs = torch.arange(n + 1, dtype=torch.int64, device=x.device)
        out, cache["state"] = self.mix(x, qkv, one_token_docs, prec, serving=True, initial_state=cache["state"])
        return out, None

    def qkv_proj(self, x: torch.Tensor, prec: PrecisionConfig) -> torch.Tensor:
        """The q, k, v projections side by side, ``[T, 3·H·K]`` in x's dtype (the short conv's input)."""
        return torch.cat([linear(proj, x, prec) for proj in (self.q_proj, self.k_proj, self.v_proj)], dim=-1)

    def mix(self, x: torch.Tensor, qkv: torch.Tensor, cu_seqlens: torch.Tensor | None, prec: PrecisionConfig,
            serving: bool, initial_state: torch.Tensor | None = None,
            cp: CPContext | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Everything after the short conv: KDA of ``qkv`` (conv output ``[T, 3·H·K]``) with the gates
        of ``x [T, hidden]``, gated RMSNorm, o_proj → (``[T, hidden]``, FP32 final state
        ``[N, H, K, K]``); ``initial_state`` continues documents (the incremental decode's state).
        ``cp``: local tokens of a context-parallel batch, KDA through
        :func:`~inductor_ext.parallel.kda_chunk_cp` (the state is then per local segment
        ``[M, H, K, K]``; :func:`~inductor_ext.parallel.collect_document_states` orders them by
        document). The three stages are :meth:`gates`, :meth:`core` and :meth:`output`."""
        g, beta = self.gates(x, prec)
        o, state = self.core(qkv, g, beta, cu_seqlens, prec, serving, initial_state=initial_state, cp=cp)
        return self.output(x, o, prec), state

    def gates(self, x: torch.Tensor, prec: PrecisionConfig) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-token decay ``g [T, H, K]`` FP32 and write strength ``beta [T, H]`` of ``x``."""
        return self.forget_gate(x, prec), torch.sigmoid(linear(self.b_proj, x, prec))

    def core(self, qkv: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, cu_seqlens: torch.Tensor | None,
             prec: PrecisionConfig, serving: bool, initial_state: torch.Tensor | None = None,
             cp: CPContext | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """KDA of the conv output with the gates (see :meth:`mix`) → (``o [T, H, K]``, final state)."""
        T = qkv.shape[0]
        q, k, v = (t.reshape(1, T, self.num_heads, self.head_dim) for t in qkv.chunk(3, dim=-1))
        g, beta = g.unsqueeze(0), beta.unsqueeze(0)
        if cp is not None:
            if serving or initial_state is not None:
                raise NotImplementedError("LinearAttention.mix: cp supports the training path from zero states only")
            o, state = kda_chunk_cp(q, k, v, g, beta, cp, precision=prec.kda)
        elif serving and not prec.batch_invariant:
            o, state = ops.kda_recurrent(q, k, v, g, beta, initial_state=initial_state, cu_seqlens=cu_seqlens)
        else:
            o, state = ops.kda_chunk(q, k, v, g, beta, initial_state=initial_state, cu_seqlens=cu_seqlens,
                                     precision=kda_chunk_path(prec))
        return o[0], state

    def output(self, x: torch.Tensor, o: torch.Tensor, prec: PrecisionConfig) -> torch.Tensor:
        """The output gate of ``x``, gated RMSNorm of the KDA output ``o [T, H, K]``, o_proj → ``[T, hidden]``."""
        T = x.shape[0]
        gate = linear(self.g_b_proj, linear(self.g_a_proj, x, prec), prec).view(T, self.num_heads, self.head_dim)
        return linear(self.o_proj, self.o_norm(o, gate, prec).reshape(T, -1), prec)
