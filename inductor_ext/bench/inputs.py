"""Seeded inputs of the benchmarks, the report and the tests: KDA, the KPool indexer, the MoE
activation, whole GLM-5.3 decoder layers, the reduced model and its prompts.

Packed documents are given by their lengths; ``cu_seqlens`` is int64 ``[0, l0, l0 + l1, ...]``.
Values are drawn in FP32 from a seeded ``torch.Generator`` and then cast, so the same seed gives
the same numbers in every dtype. The generator lives on the CPU (the same numbers on every device)
unless ``draw_on_device`` is set (CUDA-sized inputs: drawing on the GPU is fast, the numbers differ
from the CPU draw).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from graphs import DecoderLayer, GLM53Config, GLM53Model
from graphs.modules import cast_model

__all__ = ["KDA_ARGS", "MODEL_PRESETS", "cu_seqlens", "two_documents", "kda_inputs", "kpool_inputs", "kpool_weights",
           "moe_inputs", "decoder_layer", "layer_inputs", "build_model", "make_prompts"]

KDA_ARGS = ("q", "k", "v", "g", "beta")  # kda_chunk's tensor arguments, in order
# build_model's presets: tiny (CPU) and h200_stack (3 KDA + 1 DSA layers at h200 widths, CUDA)
MODEL_PRESETS = {"tiny": GLM53Config.tiny, "h200_stack": GLM53Config.h200_stack}


def cu_seqlens(lengths: Sequence[int], device="cpu") -> torch.Tensor:
    """int64 ``[0, cumsum(lengths)...]`` on ``device``."""
    return torch.tensor([0, *torch.tensor(list(lengths)).cumsum(0).tolist()], dtype=torch.int64, device=device)


def two_documents(tokens: int) -> tuple[int, int]:
    """The lengths of the two packed documents of ``tokens`` tokens (5/8 and 3/8 of them)."""
    return tokens * 5 // 8, tokens - tokens * 5 // 8


def _generator(device, seed: int, draw_on_device: bool) -> torch.Generator:
    return torch.Generator(device=device if draw_on_device else "cpu").manual_seed(seed)


def _randn(gen: torch.Generator, *shape) -> torch.Tensor:
    return torch.randn(*shape, generator=gen, device=gen.device)


def kda_inputs(lengths: Sequence[int], heads: int, k_dim: int, v_dim: int | None = None, *,
               dtype: torch.dtype = torch.bfloat16, device="cpu", seed: int = 0, draw_on_device: bool = False,
               requires_grad: bool = False) -> tuple[dict[str, torch.Tensor], torch.Tensor | None]:
    """``({q, k, v, g, beta}, cu_seqlens)`` for ``kda_chunk`` (B = 1, T = sum of ``lengths``):
    q, k ``[1, T, H, K]``, v ``[1, T, H, V]`` and beta ``[1, T, H]`` (a sigmoid) in ``dtype``; the
    log-decay gate g ``[1, T, H, K]`` FP32, ``-5·sigmoid(randn - 3)`` (in [-5, 0]); cu_seqlens
    None for one document. ``requires_grad``: every tensor a leaf that requires grad."""
    gen = _generator(device, seed, draw_on_device)
    T, H, K, V = sum(lengths), heads, k_dim, k_dim if v_dim is None else v_dim
    x = {"q": _randn(gen, 1, T, H, K).to(dtype), "k": _randn(gen, 1, T, H, K).to(dtype),
         "v": _randn(gen, 1, T, H, V).to(dtype), "g": -5.0 * torch.sigmoid(_randn(gen, 1, T, H, K) - 3.0),
         "beta": torch.sigmoid(_randn(gen, 1, T, H)).to(dtype)}
    x = {n: t.to(device).requires_grad_(requires_grad) for n, t in x.items()}
    return x, cu_seqlens(lengths, device) if len(lengths) > 1 else None


def kpool_inputs(lengths: Sequence[int], hidden: int, q_rank: int, *, device="cpu", seed: int = 0,
                 generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(x [T, hidden], q_resid [T, q_rank], cu_seqlens)`` of the KPool indexer, BF16 standard
    normal; drawn from ``generator`` when given (it keeps its state for what is drawn next), else
    from a CPU generator seeded with ``seed``."""
    gen = _generator(device, seed, False) if generator is None else generator
    T = sum(lengths)
    x = _randn(gen, T, hidden).bfloat16().to(device)
    q_resid = _randn(gen, T, q_rank).bfloat16().to(device)
    return x, q_resid, cu_seqlens(lengths, device)


def kpool_weights(heads: int, hidden: int, q_rank: int, dim: int, pool: int, generator: torch.Generator,
                  std: float = 0.02) -> dict[str, torch.Tensor]:
    """The indexer's weights, in ``kpool_indexer``'s argument order, on ``generator``'s device:
    BF16 projections (normal, ``std``), an identity LayerNorm (FP32), the pool's FP32 positional
    embedding (standard normal)."""
    dev = generator.device
    rnd = lambda *s: (_randn(generator, *s) * std).bfloat16()  # noqa: E731
    return {
        "wq_b": rnd(heads * dim, q_rank), "wk": rnd(dim, hidden), "k_norm_weight": torch.ones(dim, device=dev),
        "k_norm_bias": torch.zeros(dim, device=dev), "weights_proj": rnd(heads, hidden),
        "compress_gate": rnd(dim, hidden), "compress_ape": _randn(generator, pool, dim),
    }


def moe_inputs(tokens: int, hidden: int, inter: int, *, device="cpu", seed: int = 0,
               draw_on_device: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """``(gate_up [tokens, 2·inter], x [tokens, hidden])`` BF16 of an expert: its gate/up
    projection output (normal, std 6: SwiGLU's clamp at limit 10 is reached) and its input
    (standard normal)."""
    gen = _generator(device, seed, draw_on_device)
    gate_up = (_randn(gen, tokens, 2 * inter) * 6).bfloat16().to(device)
    return gate_up, _randn(gen, tokens, hidden).bfloat16().to(device)


def decoder_layer(cfg: GLM53Config, kind: str, device="cpu", seed: int = 0) -> DecoderLayer:
    """The first decoder layer of ``kind`` (``"kda"`` or ``"dsa"``) of ``cfg``, initialised on
    ``device`` after ``torch.manual_seed(seed)``, cast to BF16 (router, conv, gates and mHC
    parameters FP32, as transformers loads them)."""
    torch.manual_seed(seed)
    with torch.device(device):  # initialise on the device: the h200 DSA layer has 7.3 B parameters
        layer = DecoderLayer(cfg, cfg.first_layer(kind))
    cast_model(layer, torch.bfloat16)
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()  # the FP32 initial values (~29 GB for the h200 DSA layer) are gone
    return layer


def layer_inputs(cfg: GLM53Config, tokens: int, device="cpu", *, count: int = 1,
                 seed: int = 1) -> tuple[list[torch.Tensor], torch.Tensor]:
    """``([x, ...], cu_seqlens)``: ``count`` BF16 layer inputs ``[tokens, hc_mult, hidden]``
    (standard normal, one generator on ``device`` seeded with ``seed``) and the two packed
    documents of :func:`two_documents`."""
    gen = torch.Generator(device=device).manual_seed(seed)
    xs = [_randn(gen, tokens, cfg.hc_mult, cfg.hidden_size).to(torch.bfloat16) for _ in range(count)]
    return xs, cu_seqlens(two_documents(tokens), device)


def build_model(seed: int = 0, preset: str = "tiny", device: str = "cpu") -> GLM53Model:
    """The reduced GLM-5.3 model (a :data:`MODEL_PRESETS` name) with seeded random weights (drawn on
    the CPU, so every device gets the same ones), BF16 (the training dtype), eval mode, on ``device``,
    ``precision=None`` (callers select a config with :func:`inductor_ext.precision`)."""
    if preset not in MODEL_PRESETS:
        raise ValueError(f"build_model: preset must be one of {tuple(MODEL_PRESETS)}, got {preset!r}")
    cfg = MODEL_PRESETS[preset]()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = GLM53Model(cfg)
    return model.to_dtype(torch.bfloat16).to(device).eval().requires_grad_(False)


def make_prompts(vocab_size: int, num_seqs: int, prompt_len: int, seed: int, device: str = "cpu") -> torch.Tensor:
    """Seeded uniform random prompts (drawn on the CPU), int64 ``[num_seqs, prompt_len]`` on ``device``."""
    gen = torch.Generator().manual_seed(seed + 1)
    return torch.randint(0, vocab_size, (num_seqs, prompt_len), generator=gen, dtype=torch.int64).to(device)
