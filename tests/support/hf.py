"""Shared helpers of the ``test_graphs_*`` tests: a tiny random transformers ``glm5_next`` model
(weights randomized so no score ties: transformers initialises the indexer gate to ones) and
hooks that record per-layer hidden states and indexer ids."""

from __future__ import annotations

import torch
from transformers.models.glm5_next.configuration_glm5_next import Glm5NextConfig
from transformers.models.glm5_next.modeling_glm5_next import Glm5NextForConditionalGeneration

from graphs import GLM53Config
from graphs.modules import cast_model

_VISION = dict(depth=1, hidden_size=32, num_heads=2, intermediate_size=32, projection_intermediate_size=32)


def _std(name: str, p: torch.Tensor) -> tuple[float, float]:
    """(mean, std) of a randomized parameter."""
    if name.endswith(("layernorm.weight", "norm.weight", "k_norm.weight")) or name.endswith("hc.scale"):
        return 1.0, 0.1
    if name.endswith(("A_log", "dt_bias", "hc.base", "k_norm.bias", "e_score_correction_bias")):
        return 0.0, 0.3
    if "compress_ape" in name:
        return 0.0, 1.0
    if name.endswith("hc.fn"):
        return 0.0, 0.05
    if name.endswith("conv1d.weight"):
        return 0.0, 0.5
    return 0.0, p.shape[-1] ** -0.5  # linears and experts: unit-variance outputs


def tiny_hf_model(cfg: GLM53Config | None = None, dtype=torch.bfloat16, seed: int = 0):
    """A transformers ``Glm5NextForConditionalGeneration`` of ``cfg`` (tiny by default) with random
    weights, eager attention, cast like transformers loads it (FP32 modules kept FP32)."""
    cfg = GLM53Config.tiny() if cfg is None else cfg
    hc = Glm5NextConfig(text_config=cfg.to_hf_dict(), vision_config=dict(_VISION, out_hidden_size=cfg.hidden_size))
    hc._attn_implementation = "eager"
    hc.text_config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = Glm5NextForConditionalGeneration(hc).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in list(model.named_parameters()) + list(model.named_buffers()):
            if p.is_floating_point():
                mean, std = _std(name, p)
                p.copy_(mean + std * torch.randn(p.shape, generator=g))
    return cast_model(model, dtype)


def record_outputs(layers, indexers):
    """Forward hooks: returns (hidden list, ids list, remove()) filled on the next forward."""
    hidden, ids, handles = [], [], []
    for layer in layers:
        handles.append(layer.register_forward_hook(lambda m, a, out: hidden.append(out[0].detach())))
    for idx in indexers:
        handles.append(idx.register_forward_hook(lambda m, a, out: ids.append(out.detach())))
    return hidden, ids, lambda: [h.remove() for h in handles]


def id_sets(ids: torch.Tensor) -> list[frozenset]:
    """Per query row, the set of selected token ids (order and -1 padding ignored)."""
    rows = ids.reshape(-1, ids.shape[-1]).tolist()
    return [frozenset(i for i in row if i >= 0) for row in rows]
