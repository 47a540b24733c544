"""The GLM-5.3 decoder layer and the reduced causal LM, written to compile into one graph.

Decoder layer (``[T, N, D]`` mHC streams of packed tokens)::

    mHC-pre(attn) → RMSNorm → {KDA | MLA + KPool indexer + sparse attention} → mHC-post
    mHC-pre(ffn)  → RMSNorm → {SwiGLU MLP | MoE}                            → mHC-post

Model: embedding → N copies of the stream → layers → mean over the streams → RMSNorm → lm_head.
The precision is the :class:`~inductor_ext.PrecisionConfig` the model holds (``precision=``), else
the active one (``inductor_ext.precision(cfg)``); it is read while Dynamo traces and reaches the ops
as string literals, so a config change recompiles once and the same config never does.

Context parallel (``cp=`` a :class:`~inductor_ext.parallel.CPContext`, ``docs/DESIGN.md`` §8): the
model runs this rank's tokens of one packed batch; every per-token step (embedding, mHC, norms,
MLP/MoE, lm_head) is unchanged, KDA layers exchange a conv halo and fold their states across
ranks, and DSA layers gather the indexer keys and the MLA latent (``graphs/dsa_layer.py``).
"""

from __future__ import annotations

import torch
from torch import nn

from graphs.config import GLM53Config
from graphs.dsa_layer import IndexedAttention
from graphs.kda_layer import LinearAttention
from graphs.modules import MLP, HyperConnection, MoE, RMSNorm, cast_model, linear, resolve_precision, stream_mean
from graphs.transformers_call import causal_lm_call, check_input_ids, resolve_documents
from inductor_ext import PrecisionConfig, ops
from inductor_ext.parallel.context import CPContext

__all__ = ["DecoderLayer", "GLM53Model", "check_tokens", "check_cp"]


def check_tokens(num_tokens: int, cu_seqlens: torch.Tensor | None, device) -> None:
    """Static checks of packed-document metadata; raise ``ValueError`` naming the constraint."""
    if num_tokens < 1:
        raise ValueError("GLM53: need at least one token")
    if cu_seqlens is None:
        return
    if not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.dtype != torch.int64 or cu_seqlens.dim() != 1 \
            or cu_seqlens.shape[0] < 2:
        raise ValueError("GLM53: cu_seqlens must be a 1-D int64 tensor of N+1 >= 2 document offsets")
    if cu_seqlens.device != device:
        raise ValueError(f"GLM53: cu_seqlens must be on {device}, got {cu_seqlens.device}")


def check_cp(num_tokens: int, cu_seqlens: torch.Tensor | None, cp: CPContext | None) -> None:
    """Static checks of a context-parallel call: ``cp`` a :class:`CPContext`, no ``cu_seqlens``
    (the context holds the global offsets), the local token count ``cp.local_tokens``."""
    if cp is None:
        return
    if not isinstance(cp, CPContext):
        raise ValueError(f"GLM53: cp must be a CPContext (inductor_ext.parallel.cp_context), got {type(cp).__name__}")
    if cu_seqlens is not None:
        raise ValueError("GLM53: with cp, pass cu_seqlens to cp_context (global offsets), not to the model")
    if num_tokens != cp.local_tokens:
        raise ValueError(f"GLM53: with cp the input holds this rank's {cp.local_tokens} tokens (cp.shard of the "
                         f"global batch), got {num_tokens}")


class DecoderLayer(nn.Module):
    """One GLM-5.3 layer; attention kind from ``config.layer_types[layer_idx]``, FFN kind from
    ``config.mlp_layer_types[layer_idx]``. Names follow transformers ``Glm5NextTextDecoderLayer``."""

    def __init__(self, config: GLM53Config, layer_idx: int, precision: PrecisionConfig | None = None):
        super().__init__()
        self.kind = config.layer_types[layer_idx]
        self.self_attn = (LinearAttention(config) if self.kind == "linear_attention"
                          else IndexedAttention(config, layer_idx))
        self.mlp = MoE(config) if config.mlp_layer_types[layer_idx] == "sparse" else MLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.attn_hc = HyperConnection(config)
        self.ffn_hc = HyperConnection(config)
        self.precision = precision
        self.hc_mult, self.hidden = config.hc_mult, config.hidden_size

    def forward(self, streams, cu_seqlens=None, prev_ids=None, precision: PrecisionConfig | None = None,
                serving: bool = False, cp: CPContext | None = None):
        """streams ``[T, N, D]`` → (streams ``[T, N, D]``, token ids ``[T, W]`` int32 of a DSA layer
        or None). ``precision``: argument, else the layer's, else the active config. ``serving``:
        KDA through the FP32 recurrence (the serving engine's kernel), forward only. ``cp``: the
        streams are this rank's ``T_local`` tokens of a context-parallel batch (``cu_seqlens``
        None)."""
        prec = resolve_precision(precision if precision is not None else self.precision)
        if streams.dim() != 3 or tuple(streams.shape[1:]) != (self.hc_mult, self.hidden):
            raise ValueError(f"DecoderLayer: streams must be [T, {self.hc_mult}, {self.hidden}], "
                             f"got {tuple(streams.shape)}")
        check_tokens(streams.shape[0], cu_seqlens, streams.device)
        check_cp(streams.shape[0], cu_seqlens, cp)
        if self.kind == "linear_attention":
            return self.around(streams, prec, lambda x: (self.self_attn(x, cu_seqlens, prec, serving, cp=cp), None))
        return self.around(streams, prec, lambda x: self.self_attn(x, cu_seqlens, prev_ids, prec, cp=cp))

    def prefill(self, streams, num_seqs: int, prev_ids, prec: PrecisionConfig):
        """The serving forward of ``num_seqs`` packed prompts of equal length → (streams, token ids,
        the attention's decode cache): the layer around its attention's ``prefill``."""
        return self.around(streams, prec, lambda x: self.self_attn.prefill(x, num_seqs, prev_ids, prec))

    def step(self, streams, prev_ids, cache, prec: PrecisionConfig):
        """One new token per sequence, ``streams [n, N, D]`` → (streams, token ids): the layer around
        its attention's ``step`` on ``cache`` (updated in place)."""
        return self.around(streams, prec, lambda x: self.self_attn.step(x, prev_ids, cache, prec))

    def around(self, streams, prec: PrecisionConfig, attend):
        """The layer around its token mixer: mHC-pre → RMSNorm → ``attend(x) -> (out, ids, *rest)`` →
        mHC-post → the FFN half; → (streams, ids, *rest). One body for forward, prefill and step."""
        x, post, comb = self.attn_input(streams, prec)
        out, *rest = attend(x)
        return (self.ffn(self.mhc_post(out, streams, post, comb, prec), prec), *rest)

    def attn_input(self, streams, prec: PrecisionConfig):
        """mHC-pre + RMSNorm of the attention half: (sublayer input ``[T, D]``, post, comb)."""
        x, post, comb = self.attn_hc(streams, prec)
        return self.input_layernorm(x, prec), post, comb

    def ffn(self, streams, prec: PrecisionConfig):
        """The FFN half: mHC-pre → RMSNorm → MLP / MoE → mHC-post, ``[T, N, D]`` → ``[T, N, D]``."""
        x, post, comb = self.ffn_hc(streams, prec)
        x = self.mlp(self.post_attention_layernorm(x, prec), prec)
        return self.mhc_post(x, streams, post, comb, prec)

    @staticmethod
    def mhc_post(x, streams, post, comb, prec: PrecisionConfig):
        """mHC-post of a sublayer output ``x`` (its batch-invariant form with ``prec.batch_invariant``)."""
        post_op = ops.mhc_post_batch_invariant if prec.batch_invariant else ops.mhc_post
        return post_op(x, streams, post, comb, precision=prec.mhc_post)


class GLM53Model(nn.Module):
    """Reduced GLM-5.3 causal LM (text only, no cache): ``input_ids`` → logits.

    Parameter names are transformers ``Glm5NextTextModel``'s plus ``lm_head`` (see
    :meth:`from_hf`). ``precision``: the :class:`~inductor_ext.PrecisionConfig` used for every
    layer; ``None`` reads the active config while tracing.
    """

    def __init__(self, config: GLM53Config, precision: PrecisionConfig | None = None):
        super().__init__()
        if not isinstance(config, GLM53Config):
            raise ValueError(f"GLM53Model: config must be a GLM53Config, got {type(config).__name__}")
        self.config = config
        self.precision = None if precision is None else resolve_precision(precision)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def to_dtype(self, dtype: torch.dtype) -> GLM53Model:
        """Cast to ``dtype`` keeping transformers' FP32 parameters (router, conv, gates, mHC) FP32."""
        return cast_model(self, dtype)

    def forward(self, input_ids: torch.Tensor | None = None, /, cu_seqlens: torch.Tensor | None = None,
                output_hidden_states: bool = False, cp: CPContext | None = None, **hf_kwargs):
        """Logits of packed documents (``model(ids, cu_seqlens)``); the transformers call when
        ``input_ids`` is passed by name or with any transformers keyword (``model(input_ids=ids, ...)``).

        Args:
            input_ids: int64 ``[T]`` or ``[1, T]`` (batch 1: documents are packed), each in
                ``[0, vocab_size)`` (``ValueError`` in eager mode; not read when compiled); with ``cp``
                this rank's ``T_local`` tokens (``cp.shard(global_ids)``).
            cu_seqlens: optional int64 ``[N+1]`` document offsets (0 … T); None = one document.
                Must be None with ``cp`` (the context holds the global offsets).
            output_hidden_states: also return the mHC streams ``[T, N, D]`` after every layer.
            cp: a :class:`~inductor_ext.parallel.CPContext` (context parallel): the logits and
                streams are the local tokens' (``cp.unshard`` gathers them in global order).
            hf_kwargs: ``input_ids=`` by name or any other keyword (``position_ids``,
                ``attention_mask``, ``labels``, ``use_cache``, ``return_dict``, ...) makes this the
                transformers call (:func:`graphs.transformers_call.causal_lm_call`; ``docs/DESIGN.md``
                §7.1): it returns a transformers ``CausalLMOutputWithPast`` (``.logits``, ``.loss``),
                or its tuple with ``return_dict=False``, and takes int32 ``cu_seqlens`` too.

        Returns:
            logits ``[..., T, vocab]`` in the model dtype (leading dims of ``input_ids``), or
            ``(logits, tuple_of_streams)``; the transformers output with ``hf_kwargs``.
        """
        prec = resolve_precision(self.precision)
        if hf_kwargs:
            if "input_ids" in hf_kwargs:
                if input_ids is not None:
                    raise ValueError("GLM53Model: input_ids given twice (by position and by name)")
                input_ids = hf_kwargs.pop("input_ids")
            return causal_lm_call(self.final_hidden, self.lm_head, prec, input_ids, cu_seqlens=cu_seqlens,
                                  output_hidden_states=output_hidden_states, cp=cp, **hf_kwargs)
        check_input_ids(input_ids, self.lm_head.weight.shape[0])
        final, hidden = self.final_hidden(input_ids, cu_seqlens, prec, cp=cp)
        logits = linear(self.lm_head, final, prec).view(*input_ids.shape, -1)
        return (logits, hidden) if output_hidden_states else logits

    def token_logprobs(self, input_ids: torch.Tensor, targets: torch.Tensor, cu_seqlens: torch.Tensor | None = None,
                       *, temperature: float = 1.0, return_entropy: bool = False,
                       position_ids: torch.Tensor | None = None):
        """Log-probabilities of ``targets`` under the model, without the ``[T, vocab]`` logits:
        the final hidden state through :func:`inductor_ext.ops.token_logprobs` with the lm_head
        weight (vocabulary chunks, online log-sum-exp; ``batch_invariant`` from the precision).

        Args:
            input_ids: int64 ``[T]`` or ``[1, T]`` (packed documents, as :meth:`forward`).
            targets: int64 of ``input_ids``' shape: the token scored at each position (usually the
                next input id), ``-100`` to ignore a position (logprob 0, entropy 0, no gradient).
            cu_seqlens: optional int64 (or int32) ``[N+1]`` document offsets, as :meth:`forward`.
            temperature: a python float > 0; the logits (the lm_head output in the model dtype,
                cast to FP32) are divided by it before the log-softmax.
            return_entropy: also return each position's entropy.
            position_ids: documents packed by positions instead of ``cu_seqlens`` (a document
                starts where they are 0), converted on the host as in the transformers call.

        Returns:
            FP32 log-probs of ``input_ids``' shape, or ``(logprobs, entropy)``; differentiable.
            Equal, up to FP32 rounding, to ``log_softmax(model(input_ids).float() / temperature)``
            gathered at ``targets``.
        """
        check_input_ids(input_ids, self.lm_head.weight.shape[0])
        if not isinstance(targets, torch.Tensor) or targets.shape != input_ids.shape:
            raise ValueError(f"GLM53Model.token_logprobs: targets must have input_ids' shape "
                             f"{tuple(input_ids.shape)}, got {getattr(targets, 'shape', type(targets).__name__)}")
        prec = resolve_precision(self.precision)
        cu_seqlens = resolve_documents(input_ids.numel(), input_ids.device, cu_seqlens, position_ids)
        final, _ = self.final_hidden(input_ids, cu_seqlens, prec)
        out = ops.token_logprobs(final, self.lm_head.weight, targets.reshape(-1), temperature=temperature,
                                 return_entropy=return_entropy, batch_invariant=prec.batch_invariant)
        if return_entropy:
            return out[0].view(input_ids.shape), out[1].view(input_ids.shape)
        return out.view(input_ids.shape)

    def final_hidden(self, input_ids: torch.Tensor, cu_seqlens: torch.Tensor | None, precision: PrecisionConfig,
                     serving: bool = False,
                     cp: CPContext | None = None) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
        """The lm_head input ``[T, D]`` and the mHC streams after every layer, under ``precision``;
        ``serving`` runs KDA through the FP32 recurrence (see :class:`graphs.serving.ServingForward`);
        ``cp``: local tokens of a context-parallel batch (see :meth:`forward`)."""
        tokens = input_ids.reshape(-1)
        check_tokens(tokens.shape[0], cu_seqlens, tokens.device)
        check_cp(tokens.shape[0], cu_seqlens, cp)
        streams, hidden, ids = self.embed(tokens), [], None
        for layer in self.layers:
            streams, ids = layer(streams, cu_seqlens, ids, precision, serving, cp=cp)
            hidden.append(streams)
        return self.final_norm(streams, precision), tuple(hidden)

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """Token ids ``[T]`` → the ``hc_mult`` mHC streams ``[T, N, D]`` (N copies of the embedding)."""
        return self.embed_tokens(tokens).unsqueeze(1).expand(-1, self.config.hc_mult, -1).contiguous()

    def final_norm(self, streams: torch.Tensor, precision: PrecisionConfig) -> torch.Tensor:
        """The lm_head input ``[T, D]`` of the last layer's streams: their mean, the final RMSNorm."""
        return self.norm(stream_mean(streams, precision), precision)

    @classmethod
    def from_hf(cls, hf_model_or_state_dict, config=None, precision: PrecisionConfig | None = None) -> GLM53Model:
        """Build from a transformers ``glm5_next`` model (``Glm5NextForConditionalGeneration``,
        ``Glm5NextModel`` or ``Glm5NextTextModel``) or its state dict; see :func:`graphs.hf.load_hf`."""
        from graphs.hf import load_hf

        return load_hf(cls, hf_model_or_state_dict, config=config, precision=precision)
