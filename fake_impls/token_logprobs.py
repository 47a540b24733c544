"""Fakes of ``glm53::token_logprobs`` (FP32 ``[T]`` log-probs, entropy ``[T]`` or ``[0]``, lse ``[T]``)
and ``glm53::token_logprobs_bwd`` (gradients shaped and typed like hidden and weight)."""

from __future__ import annotations

import torch

__all__ = ["FAKES", "token_logprobs_fake", "token_logprobs_bwd_fake"]


def token_logprobs_fake(hidden, weight, targets, temperature, batch_invariant, return_entropy):
    """Outputs of ``glm53::token_logprobs`` as empty tensors: shapes, dtypes, strides, no data."""
    T = hidden.shape[0]
    f32 = torch.float32
    entropy = hidden.new_empty((T,) if return_entropy else (0,), dtype=f32)
    return hidden.new_empty((T,), dtype=f32), entropy, hidden.new_empty((T,), dtype=f32)


def token_logprobs_bwd_fake(hidden, weight, targets, lse, entropy, grad_logprobs, grad_entropy, grad_lse,
                            temperature, batch_invariant, return_entropy):
    """Outputs of ``glm53::token_logprobs_bwd``: contiguous ``grad_hidden`` and ``grad_weight``."""
    return hidden.new_empty(hidden.shape), weight.new_empty(weight.shape)


FAKES = {
    "glm53::token_logprobs": token_logprobs_fake,
    "glm53::token_logprobs_bwd": token_logprobs_bwd_fake,
}
