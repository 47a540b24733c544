"""Serving-numerics forward of the reduced GLM-5.3 model, sharing the training model's weights.

:class:`ServingForward` runs the layers of a :class:`~graphs.model.GLM53Model` (same parameters,
no copy) with ``serving=True`` (KDA through the recurrence) and runs every precision path with
the serving engine's semantics (``docs/DESIGN.md`` §4), not the training path's:

- KDA through ``glm53::kda_recurrent`` (the token recurrence with FP32 state and FP32 math),
  never ``kda_chunk`` — except with ``batch_invariant``, where serving runs the chunk arithmetic
  (``kda_chunk`` at ``precision.kda``; the decoder replays it from chunk-boundary states);
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

from graphs.model import GLM53Model
from graphs.modules import linear
from inductor_ext import PrecisionConfig

__all__ = ["ServingForward", "SERVING_PRECISION"]

# the serving engine's choice on every precision path (kda is always the recurrent kernel here)
SERVING_PRECISION = PrecisionConfig.serving_aligned()


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

    def hidden(self, input_ids: torch.Tensor, cu_seqlens: torch.Tensor | None = None) -> torch.Tensor:
        """The final-norm hidden states ``[T, D]`` (the lm_head input) of packed ``input_ids [T]``."""
        return self.model.final_hidden(input_ids, cu_seqlens, self.precision, serving=True)[0]

    def forward(self, input_ids: torch.Tensor, cu_seqlens: torch.Tensor | None = None) -> torch.Tensor:
        """Logits ``[..., T, vocab]`` in the model dtype, like :meth:`GLM53Model.forward`."""
        if input_ids.dtype != torch.int64 or input_ids.dim() not in (1, 2) or \
                (input_ids.dim() == 2 and input_ids.shape[0] != 1):
            raise ValueError(f"ServingForward: input_ids must be int64 [T] or [1, T] (packed), got "
                             f"{input_ids.dtype} {tuple(input_ids.shape)}")
        logits = linear(self.model.lm_head, self.hidden(input_ids, cu_seqlens), self.precision)
        return logits.view(*input_ids.shape, -1)
