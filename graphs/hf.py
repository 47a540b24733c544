"""Weight loading from transformers ``glm5_next`` without renaming by hand.

Our parameter names are transformers' names below the text model (``layers.3.self_attn.indexer.wk
.weight``, ``layers.1.mlp.experts.gate_up_proj``, …) plus ``lm_head.weight``; loading only strips
the wrapper prefixes of the transformers classes and drops what the reduced model does not hold
(vision tower, MTP layers).
"""

from __future__ import annotations

import re
from collections.abc import Mapping

import torch

from graphs.config import GLM53Config

__all__ = ["hf_text_state_dict", "load_hf"]

# text-model prefix of each transformers class: ForConditionalGeneration, Glm5NextModel, Glm5NextTextModel
_PREFIXES = ("model.language_model.", "language_model.", "model.")
_DROP = re.compile(r"^(model\.)?visual\.|\.shared_head\.")


def hf_text_state_dict(state_dict: Mapping[str, torch.Tensor], num_layers: int) -> dict[str, torch.Tensor]:
    """Keys of a transformers ``glm5_next`` state dict renamed to :class:`GLM53Model`'s: wrapper
    prefixes stripped, vision and MTP (``layers.{n >= num_layers}``) entries dropped, tensors
    cloned (no storage shared with the source model)."""
    out = {}
    for key, value in state_dict.items():
        if _DROP.search(key):
            continue
        name = key
        if name != "lm_head.weight":
            for prefix in _PREFIXES:
                if name.startswith(prefix):
                    name = name[len(prefix):]
                    break
        layer = re.match(r"layers\.(\d+)\.", name)
        if layer and int(layer.group(1)) >= num_layers:
            continue
        out[name] = value.detach().clone()
    return out


def load_hf(cls, hf_model_or_state_dict, config=None, precision=None):
    """``cls(config, precision)`` with the weights (and their dtypes) of a transformers model or
    state dict.

    Args:
        hf_model_or_state_dict: a transformers ``glm5_next`` module, or a state dict of one.
        config: a :class:`GLM53Config`, or a transformers config; ``None`` takes the module's
            ``config`` (required for a bare state dict).
        precision: the :class:`~inductor_ext.PrecisionConfig` the model holds (None = active).

    Raises:
        ValueError: no config for a state dict, a config of another model type than glm5_next
        (named), or keys that do not match (missing/unexpected names are listed).
    """
    if isinstance(hf_model_or_state_dict, torch.nn.Module):
        state = hf_model_or_state_dict.state_dict()
        config = hf_model_or_state_dict.config if config is None else config
    elif isinstance(hf_model_or_state_dict, Mapping):
        state = hf_model_or_state_dict
    else:
        raise ValueError(f"from_hf takes a transformers module or a state dict, got "
                         f"{type(hf_model_or_state_dict).__name__}")
    if config is None:
        raise ValueError("from_hf: a state dict needs config= (a GLM53Config or a transformers Glm5NextTextConfig)")
    if not isinstance(config, GLM53Config):
        config = GLM53Config.from_hf(config)
    state = hf_text_state_dict(state, config.num_hidden_layers)
    if "lm_head.weight" not in state and config.tie_word_embeddings and "embed_tokens.weight" in state:
        state["lm_head.weight"] = state["embed_tokens.weight"]
    with torch.device("meta"):
        model = cls(config, precision=precision)
    expected = set(model.state_dict())
    missing, unexpected = sorted(expected - set(state)), sorted(set(state) - expected)
    if missing or unexpected:
        raise ValueError(f"from_hf: state dict does not match GLM53Model (missing {missing[:8]}"
                         f"{'…' if len(missing) > 8 else ''}, unexpected {unexpected[:8]}"
                         f"{'…' if len(unexpected) > 8 else ''}); a text-only Glm5NextTextModel has no "
                         f"lm_head unless tie_word_embeddings")
    model.load_state_dict(state, strict=True, assign=True)
    if config.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    return model
