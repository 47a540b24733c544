"""Serving-numerics forward of the reduced GLM-5.3 model, sharing the training model's weights.

:class:`ServingForward` walks the modules of a :class:`~graphs.model.GLM53Model` (same parameters,
no copy) and runs every precision path with the serving engine's semantics (DESIGN §4), not the
training path's:

- KDA through ``glm53::kda_recurrent`` (the token recurrence with FP32 state and FP32 math),
  never ``kda_chunk``;
- the FP8 KPool indexer (``kpool="fp8"``, FP32 pooling, FP32 indexer head projection);
- FP32 mHC post (one rounding), serving SwiGLU (FP32, one rounding), FP8 ue8m0 MoE activations.

Everything else (embedding, RMSNorms, mHC pre, MLA, sparse attention, router, lm_head) is the
model's own code. ``precision=`` overrides the serving choices (default
``PrecisionConfig.serving_aligned()``); it exists so a deliberately mis-aligned "serving" engine can
be built (e.g. ``SERVING.replace(mhc_post="bf16")``) to check that a mismatch metric responds.
Forward only, eager (no autograd needed: call it under ``torch.no_grad()``).
"""

from __future__ import annotations

import torch
from torch import nn

from graphs.kda_layer import LinearAttention, document_positions
from graphs.model import GLM53Model, check_tokens
from inductor_ext import PrecisionConfig, ops

__all__ = ["ServingForward", "SERVING_PRECISION", "serving_kda"]

# the serving engine's choice on every precision path (kda is always the recurrent kernel here)
SERVING_PRECISION = PrecisionConfig.serving_aligned()


def serving_kda(attn: LinearAttention, x: torch.Tensor, cu_seqlens: torch.Tensor | None) -> torch.Tensor:
    """The KDA token mixer of ``attn`` with ``glm53::kda_recurrent`` (FP32 state) in place of
    ``kda_chunk``; every other step is the layer's own (projections, conv, gates, gated norm)."""
    T = x.shape[0]
    pos = document_positions(cu_seqlens, T, x.device)
    qkv = attn.short_conv(torch.cat([attn.q_proj(x), attn.k_proj(x), attn.v_proj(x)], dim=-1), pos)
    q, k, v = (t.reshape(1, T, attn.num_heads, attn.head_dim) for t in qkv.chunk(3, dim=-1))
    g = attn.forget_gate(x).unsqueeze(0)
    beta = torch.sigmoid(attn.b_proj(x)).unsqueeze(0)
    o, _ = ops.kda_recurrent(q, k, v, g, beta, cu_seqlens=cu_seqlens)
    gate = attn.g_b_proj(attn.g_a_proj(x)).view(T, attn.num_heads, attn.head_dim)
    o = attn.o_norm(o[0], gate).reshape(T, -1)
    return attn.o_proj(o)


class ServingForward(nn.Module):
    """Serving-numerics forward over ``model``'s modules and weights: ``input_ids`` → logits.

    Args:
        model: the training :class:`GLM53Model` (held by reference: weight updates are seen).
        precision: serving choices for the indexer / mHC post / SwiGLU / MoE paths (default
            :data:`SERVING_PRECISION`); its ``kda`` field is ignored (KDA is always recurrent FP32).
    """

    def __init__(self, model: GLM53Model, precision: PrecisionConfig | None = None):
        super().__init__()
        if not isinstance(model, GLM53Model):
            raise ValueError(f"ServingForward: model must be a GLM53Model, got {type(model).__name__}")
        precision = SERVING_PRECISION if precision is None else precision
        if not isinstance(precision, PrecisionConfig):
            raise ValueError(f"ServingForward: precision must be a PrecisionConfig, got {type(precision).__name__}")
        self.model = model
        self.precision = precision

    def _layer(self, layer, streams, cu_seqlens, prev_ids):
        prec = self.precision
        x, post, comb = layer.attn_hc(streams)
        x = layer.input_layernorm(x)
        ids = None
        if layer.kind == "linear_attention":
            x = serving_kda(layer.self_attn, x, cu_seqlens)
        else:
            x, ids = layer.self_attn(x, cu_seqlens, prev_ids, prec)
        streams = ops.mhc_post(x, streams, post, comb, precision=prec.mhc_post)
        x, post, comb = layer.ffn_hc(streams)
        x = layer.mlp(layer.post_attention_layernorm(x), prec)
        return ops.mhc_post(x, streams, post, comb, precision=prec.mhc_post), ids

    def hidden(self, input_ids: torch.Tensor, cu_seqlens: torch.Tensor | None = None) -> torch.Tensor:
        """The final-norm hidden states ``[T, D]`` (the lm_head input) of packed ``input_ids [T]``."""
        m = self.model
        tokens = input_ids.reshape(-1)
        check_tokens(tokens.shape[0], cu_seqlens, tokens.device)
        x = m.embed_tokens(tokens)
        streams = x.unsqueeze(1).expand(-1, m.config.hc_mult, -1).contiguous()
        ids = None
        for layer in m.layers:
            streams, ids = self._layer(layer, streams, cu_seqlens, ids)
        return m.norm(streams.mean(dim=1))

    def forward(self, input_ids: torch.Tensor, cu_seqlens: torch.Tensor | None = None) -> torch.Tensor:
        """Logits ``[..., T, vocab]`` in the model dtype, like :meth:`GLM53Model.forward`."""
        if input_ids.dtype != torch.int64 or input_ids.dim() not in (1, 2) or \
                (input_ids.dim() == 2 and input_ids.shape[0] != 1):
            raise ValueError(f"ServingForward: input_ids must be int64 [T] or [1, T] (packed), got "
                             f"{input_ids.dtype} {tuple(input_ids.shape)}")
        logits = self.model.lm_head(self.hidden(input_ids, cu_seqlens))
        return logits.view(*input_ids.shape, -1)
