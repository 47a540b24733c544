"""Rollouts for reinforcement learning: sampled responses and their log-probabilities from the
serving decoder, computed the way the trainer computes them.

Each sampled token's log-probability is :func:`inductor_ext.ops.token_logprobs` of the decode
step's final hidden state (the lm_head input) with the lm_head weight: the same arithmetic the
training side runs (``GLM53Model.token_logprobs``, the patched transformers model's), so under
``PrecisionConfig.batch_invariant`` (decode rows bitwise the training forward's rows, every
row of ``token_logprobs`` independent of the others) train and rollout log-probabilities agree bit
for bit.
"""

from __future__ import annotations

import torch

from graphs.decode import ServingDecoder
from graphs.model import GLM53Model
from graphs.serving import ServingForward
from inductor_ext import PrecisionConfig, ops

__all__ = ["sample"]


@torch.no_grad()
def sample(model: GLM53Model, prompts: torch.Tensor, new_tokens: int, *, generator: torch.Generator,
           precision: PrecisionConfig | None = None, temperature: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """``(sequences int64 [n, L + new_tokens], log-probs FP32 [n, new_tokens])``.

    Args:
        model: the serving weights (a :class:`GLM53Model`; decoded through :class:`ServingDecoder`).
        prompts: int64 ``[n, L]``, one prompt per row (equal lengths).
        new_tokens: response tokens per prompt (>= 1).
        generator: the sampling generator (on the prompts' device).
        precision: the serving precision (default: :class:`ServingForward`'s); its ``mla`` must be
            ``"absorbed"`` (the decoder caches the latent).
        temperature: tokens are drawn from ``softmax(logits.float() / temperature)``; the log-probs
            are :func:`~inductor_ext.ops.token_logprobs` at the same temperature.
    """
    if isinstance(new_tokens, bool) or not isinstance(new_tokens, int) or new_tokens < 1:
        raise ValueError(f"sample: new_tokens must be an int >= 1, got {new_tokens!r}")
    serve = ServingForward(model, precision)
    decoder, weight = ServingDecoder(serve), model.lm_head.weight
    invariant = serve.precision.batch_invariant
    logits, hidden, cache = decoder.prefill(prompts, with_hidden=True)
    tokens, logprobs = [], []
    for i in range(new_tokens):
        probs = torch.softmax(logits.float() / temperature, dim=-1)
        tok = torch.multinomial(probs, 1, generator=generator)[:, 0]
        logprobs.append(ops.token_logprobs(hidden, weight, tok, temperature=temperature, batch_invariant=invariant))
        tokens.append(tok)
        if i + 1 < new_tokens:
            logits, hidden, cache = decoder.step(tok, cache, with_hidden=True)
    return torch.cat([prompts, torch.stack(tokens, 1)], 1), torch.stack(logprobs, 1)
