"""Compile cases shared by ``tests/graphs/test_compile.py`` and ``tests/graphs/test_signatures.py``.

A case = (preset, kind, config name): the decoder layer of that kind (or the whole tiny model)
compiled with ``fullgraph=True`` through :func:`graphs.signature.recording_backend` (aot_eager),
run forward + backward, then twice more under ``fail_on_recompile``. Results are cached per
process so the signature tests reuse the compile tests' graphs. A toggle whose Dynamo graph is
identical (same code, same literals) to the reference graph's is run without re-tracing
AOTAutograd: its forward/backward graphs are the reference's by construction (saves ~40 % of the
matrix time on a 2-core CPU). The h200 preset runs on fake
tensors (its weights would not fit a CI machine); the tiny preset on real BF16 tensors.
"""

from __future__ import annotations

import contextlib
import functools

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from graphs import DecoderLayer, GLM53Config, GLM53Model
from graphs.modules import cast_model
from graphs.signature import glm53_calls, recording_backend, signature
from inductor_ext import PrecisionConfig

REFERENCE = PrecisionConfig.reference()
CONFIGS = {"reference": REFERENCE, **REFERENCE.toggles()}
PRESETS = {"tiny": GLM53Config.tiny, "h200": GLM53Config.h200}
TOKENS = {"tiny": 64, "h200": 256}


def layer_index(cfg: GLM53Config, kind: str) -> int:
    """First layer of that attention kind (DSA: with its own indexer)."""
    return cfg.first_layer(kind)


def _build(preset: str, kind: str, prec: PrecisionConfig):
    cfg = PRESETS[preset]()
    T = TOKENS[preset]
    cu = torch.tensor([0, T * 5 // 8, T], dtype=torch.int64)  # two packed documents
    if kind == "model":
        module = GLM53Model(cfg, prec).to_dtype(torch.bfloat16)
        x = torch.randint(0, cfg.vocab_size, (T,), generator=torch.Generator().manual_seed(0))

        def step(x, cu):
            return module(x, cu).float().square().mean()
    else:
        module = cast_model(DecoderLayer(cfg, layer_index(cfg, kind), prec), torch.bfloat16)
        x = torch.randn(T, cfg.hc_mult, cfg.hidden_size, dtype=torch.bfloat16, requires_grad=True)

        def step(x, cu):
            return module(x, cu)[0].float().square().mean()
    return module, step, x, cu


@functools.cache
def compile_case(preset: str, kind: str, config_name: str) -> dict:
    """Compile and run one case; returns frames, recompile-free repeat result, graph signatures."""
    torch._dynamo.reset()
    prec = CONFIGS[config_name]
    fake = FakeTensorMode() if preset == "h200" else None
    ctx = fake if fake is not None else contextlib.nullcontext()
    with ctx:
        torch.manual_seed(0)
        module, step, x, cu = _build(preset, kind, prec)
    store: dict = {}
    reference_code = None if config_name == "reference" else compile_case(preset, kind, "reference")["dynamo_code"]
    torch._dynamo.reset()
    recording = recording_backend(store)

    def backend(gm, example_inputs):
        store["dynamo_code"] = gm.code
        if gm.code == reference_code:
            store["frames"] = store.get("frames", 0) + 1
            return gm.forward
        return recording(gm, example_inputs)

    compiled = torch.compile(step, backend=backend, fullgraph=True)
    params = [p for p in module.parameters() if p.requires_grad]
    with ctx:
        compiled(x, cu).backward()
        grads = sum(p.grad is not None for p in params)
        with torch.compiler.set_stance("fail_on_recompile"):
            for _ in range(2):
                compiled(x, cu).backward()
    torch._dynamo.reset()
    if "forward" not in store:  # same Dynamo graph as the reference: same AOT graphs
        ref = compile_case(preset, kind, "reference")
        return {**ref, "frames": store["frames"], "params_with_grad": grads}
    return {
        "dynamo_code": store["dynamo_code"],
        "frames": store["frames"],
        "params_with_grad": grads,
        "params": len(params),
        "calls": glm53_calls(store["forward"]),
        "signature": "# forward\n" + signature(store["forward"]) + "# backward\n" + signature(store["backward"]),
    }
