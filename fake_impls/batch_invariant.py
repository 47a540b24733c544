"""Fakes of the ``batch_invariant`` family (``glm53::bi_*``): contiguous outputs, no data."""

from __future__ import annotations

import torch

__all__ = ["FAKES", "bi_linear_fake", "bi_grouped_linear_fake", "bi_grouped_linear_wgrad_fake", "bi_rms_norm_fake",
           "bi_layer_norm_fake", "bi_log_softmax_fake", "bi_row_sum_fake"]


def bi_linear_fake(x, weight, bias, out_dtype):
    """``[..., N]`` in ``out_dtype``."""
    return x.new_empty((*x.shape[:-1], weight.shape[0]), dtype=out_dtype)


def bi_grouped_linear_fake(x, weight, offs):
    """``[M, N]`` in x's dtype."""
    return x.new_empty((x.shape[0], weight.shape[1]))


def bi_grouped_linear_wgrad_fake(dy, x, offs, out_dtype):
    """``[E, N, K]`` in ``out_dtype`` (E = offs' length)."""
    return x.new_empty((offs.shape[0], dy.shape[1], x.shape[1]), dtype=out_dtype)


def bi_rms_norm_fake(x, weight, eps):
    """``[..., D]`` in ``promote_types(x.dtype, weight.dtype)`` (the model's ``weight * x̂``)."""
    return x.new_empty(x.shape, dtype=torch.promote_types(x.dtype, weight.dtype))


def bi_layer_norm_fake(x, weight, bias, eps):
    """``[..., D]`` in x's dtype."""
    return x.new_empty(x.shape)


def bi_log_softmax_fake(x):
    """FP32 ``[..., V]``."""
    return x.new_empty(x.shape, dtype=torch.float32)


def bi_row_sum_fake(x):
    """FP32 ``[...]`` (the last dim reduced)."""
    return x.new_empty(x.shape[:-1], dtype=torch.float32)


FAKES = {
    "glm53::bi_linear": bi_linear_fake,
    "glm53::bi_grouped_linear": bi_grouped_linear_fake,
    "glm53::bi_grouped_linear_wgrad": bi_grouped_linear_wgrad_fake,
    "glm53::bi_rms_norm": bi_rms_norm_fake,
    "glm53::bi_layer_norm": bi_layer_norm_fake,
    "glm53::bi_log_softmax": bi_log_softmax_fake,
    "glm53::bi_row_sum": bi_row_sum_fake,
}
