"""``graphs.patch_transformers`` on a tiny random transformers ``glm5_next`` model (CPU, BF16).

- The patch is in place: the same model object, every parameter and buffer the same object, the
  ``state_dict`` keys unchanged; the transformers classes stay (``isinstance``, class names).
- Logits bitwise ``GLM53Model.from_hf``'s and transformers' own eager forward (precision
  ``reference()`` with ``kda="fp32"``: the arithmetic of transformers' CPU path, ``test_parity``).
- The model and text-model classes, another architecture refused, the indexer without gradient
  and ``freeze_indexer``.
- Compiled per layer in torchtitan's order (``checkpoint_wrapper``, ``torch.compile(fullgraph=True)``
  with ``backend="aot_eager"``: Dynamo, AOTAutograd and activation checkpointing, no Inductor
  codegen) and whole: logits, loss and every gradient bitwise the eager patched model's.
- FSDP2 ``fully_shard`` over the compiled, checkpointed layers on one gloo rank (CPU, in this
  process): FP32 with dense MLPs, because FSDP2 wants one parameter dtype per group (transformers
  keeps the router, conv, gates and mHC ``base``/``scale`` FP32 in a BF16 model) and
  ``torch._grouped_mm`` compiles in BF16 only. Bitwise too.
- The README's trainer snippet runs as written.
"""

import copy
import re

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.models.glm5_next import modeling_glm5_next as hf_mod

from graphs import DecoderLayer, GLM53Config, GLM53Model, patch_transformers
from graphs.transformers_patch import is_patched
from inductor_ext import PrecisionConfig
from tests.support.hf import tiny_hf_model
from tests.support.parallel import one_rank_group
from tests.support.project import ROOT

PREC = PrecisionConfig.reference().replace(kda="fp32")
T = 64
LENGTHS = (37, 27)
GEN = torch.Generator().manual_seed(1)
TOKENS = torch.randint(0, GLM53Config.tiny().vocab_size, (1, T), generator=GEN)
POS = torch.cat([torch.arange(n) for n in LENGTHS])[None]
LABELS = TOKENS.clone()
LABELS[0, LENGTHS[0]] = -100  # the first token of the second document is not predicted from the first


def _snapshot(model):
    return ({n: id(p) for n, p in model.named_parameters(remove_duplicate=False)},
            {n: id(b) for n, b in model.named_buffers()}, list(model.state_dict()))


@pytest.fixture(scope="module")
def patched():
    """(patched model, its parameter ids, buffer ids and state-dict keys before the patch)."""
    model = tiny_hf_model()
    before = _snapshot(model)
    assert patch_transformers(model, precision=PREC) is model
    return model, before


def _unwrapped(name: str) -> str:
    return name.replace("_orig_mod.", "").replace("_checkpoint_wrapped_module.", "")


def _train_step(model):
    """Logits, loss and the gradient of every parameter (by its unwrapped name) of one packed batch."""
    out = model(input_ids=TOKENS, position_ids=POS, labels=LABELS)
    out.loss.backward()
    grads = {}
    for name, p in model.named_parameters():
        if p.grad is not None:
            grads[_unwrapped(name)] = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad.clone()
    model.zero_grad(set_to_none=True)
    return out.logits.detach(), out.loss.detach(), grads


def _assert_same_step(got, want):
    torch.testing.assert_close(got[0], want[0], rtol=0, atol=0, msg=lambda m: f"logits: {m}")
    torch.testing.assert_close(got[1], want[1], rtol=0, atol=0, msg=lambda m: f"loss: {m}")
    assert set(got[2]) == set(want[2]), set(got[2]) ^ set(want[2])
    for name in want[2]:
        torch.testing.assert_close(got[2][name], want[2][name], rtol=0, atol=0, msg=lambda m: f"grad {name}: {m}")


def test_parameters_buffers_and_state_dict_keys_unchanged(patched):
    model, before = patched
    assert _snapshot(model) == before
    layer = model.model.language_model.layers[0]
    assert isinstance(layer, hf_mod.Glm5NextTextDecoderLayer) and isinstance(layer, DecoderLayer)
    assert type(layer).__name__ == "Glm5NextTextDecoderLayer" and is_patched(model) and is_patched(layer)
    assert isinstance(model.model.language_model.norm, hf_mod.Glm5NextTextRMSNorm)
    again = patch_transformers(model, precision=PREC)  # idempotent: no new class, no new parameter
    assert again is model and type(layer) is type(model.model.language_model.layers[0]) and _snapshot(model) == before


def test_logits_bitwise_from_hf_and_transformers(patched):
    model, _ = patched
    with torch.no_grad():
        logits = model(input_ids=TOKENS).logits
        ours = GLM53Model.from_hf(model, precision=PREC)(TOKENS)
        theirs = tiny_hf_model()(input_ids=TOKENS).logits  # the same seed: the same weights, unpatched
    torch.testing.assert_close(logits, ours, rtol=0, atol=0)
    torch.testing.assert_close(logits, theirs, rtol=0, atol=0)


def test_model_and_text_model_classes(patched):
    model, _ = patched
    with torch.no_grad():
        logits = model(input_ids=TOKENS, position_ids=POS).logits
        hidden = model.model(input_ids=TOKENS, position_ids=POS).last_hidden_state
        torch.testing.assert_close(model.lm_head(hidden), logits, rtol=0, atol=0)
        text = patch_transformers(tiny_hf_model().model.language_model, precision=PREC)
        assert isinstance(text, hf_mod.Glm5NextTextModel)
        out = text(input_ids=TOKENS, position_ids=POS)
        torch.testing.assert_close(out.last_hidden_state, hidden, rtol=0, atol=0)
    with pytest.raises(ValueError, match="text only"):
        model(input_ids=TOKENS, pixel_values=torch.zeros(4, 8))


def test_other_architectures_refused():
    llama = LlamaForCausalLM(LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=2))
    with pytest.raises(ValueError, match=r"LlamaForCausalLM \(model_type 'llama'\) is not supported"):
        patch_transformers(llama)
    with pytest.raises(ValueError, match="expected a transformers glm5_next model"):
        patch_transformers(object())


def test_indexer_gets_no_gradient_and_freeze_indexer(patched):
    model, before = patched
    _, _, grads = _train_step(model)
    indexer = {n for n, _ in model.named_parameters() if ".indexer." in n}
    assert indexer and not indexer & set(grads), "the indexer's parameters must get no gradient"
    text = {n for n, _ in model.named_parameters() if ".visual." not in n}  # the vision tower is not run
    assert set(grads) == text - indexer, "every other parameter of the text model gets one"
    try:
        patch_transformers(model, precision=PREC, freeze_indexer=True)
        assert all(p.requires_grad == (".indexer." not in n) for n, p in model.named_parameters())
        assert _snapshot(model) == before
    finally:
        model.requires_grad_(True)


def test_compiled_per_layer_with_checkpointing_matches_eager(patched):
    """torchtitan's order: checkpoint_wrapper, then torch.compile(fullgraph=True) of each layer
    (aot_eager), registered in place of the layer; one frame per layer, no recompile."""
    model, _ = patched
    want = _train_step(model.train())
    compiled = copy.deepcopy(model)
    counter = CompileCounterWithBackend("aot_eager")
    layers = compiled.model.language_model.layers
    for i, layer in enumerate(layers):
        layers.register_module(str(i), torch.compile(checkpoint_wrapper(layer), backend=counter, fullgraph=True))
    try:
        _assert_same_step(_train_step(compiled), want)
        assert counter.frame_count == len(layers), counter.frame_count  # three kinds of layer in tiny
        with torch.compiler.set_stance("fail_on_recompile"):
            _assert_same_step(_train_step(compiled), want)
    finally:
        model.eval()
        torch._dynamo.reset()


def test_compiled_whole_model(patched):
    """Whole-model compile: fullgraph=True with cu_seqlens (int32 as flash-attn); with position_ids
    the host conversion breaks the graph once (and fullgraph=True refuses it, naming the fix)."""
    model, _ = patched
    cu = torch.tensor([0, LENGTHS[0], T], dtype=torch.int32)
    with torch.no_grad():
        want = model(input_ids=TOKENS, position_ids=POS, labels=LABELS)
        full = torch.compile(model, backend="aot_eager", fullgraph=True)
        got = full(input_ids=TOKENS, cu_seqlens=cu, labels=LABELS)
        torch.testing.assert_close(got.logits, want.logits, rtol=0, atol=0)
        torch.testing.assert_close(got.loss, want.loss, rtol=0, atol=0)
        with pytest.raises(torch._dynamo.exc.Unsupported, match="pass cu_seqlens instead"):
            full(input_ids=TOKENS, position_ids=POS)
        got = torch.compile(model, backend="aot_eager")(input_ids=TOKENS, position_ids=POS, labels=LABELS)
        torch.testing.assert_close(got.logits, want.logits, rtol=0, atol=0)
    torch._dynamo.reset()


@pytest.mark.slow
def test_fsdp2_over_compiled_checkpointed_layers_one_gloo_rank():
    """FSDP2 after checkpointing and compiling each layer (torchtitan's order), one rank, FP32."""
    model = patch_transformers(tiny_hf_model(GLM53Config.tiny(mlp_layer_types=("dense",) * 3), dtype=torch.float32),
                               precision=PrecisionConfig.reference()).train()
    want = _train_step(model)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    with one_rank_group():
        try:
            mesh = init_device_mesh("cpu", (1,))
            layers = model.model.language_model.layers
            for i, layer in enumerate(layers):
                layers.register_module(str(i), torch.compile(checkpoint_wrapper(layer), backend="aot_eager",
                                                             fullgraph=True))
            for layer in layers:
                fully_shard(layer, mesh=mesh)
            fully_shard(model, mesh=mesh)
            for _ in range(2):
                _assert_same_step(_train_step(model), want)
        finally:
            torch._dynamo.reset()


def test_readme_trainer_snippet_runs():
    text = (ROOT / "README.md").read_text()
    snippet = re.search(r"### A transformers model in a trainer\n.*?```python\n(.*?)```", text, re.S).group(1)
    scope = {"hf_model": tiny_hf_model(), "input_ids": TOKENS, "position_ids": POS, "labels": LABELS}
    exec(compile(snippet, "README.md", "exec"), scope)  # noqa: S102  (the documented surface, as written)
    out, logprobs, targets = scope["out"], scope["logprobs"], scope["targets"]
    assert out.loss.dtype == torch.float32 and logprobs.shape == TOKENS.shape
    # the loss's pairs scored by token_logprobs: their mean is the loss (FP32 rounding apart)
    torch.testing.assert_close(-logprobs[targets != -100].mean(), out.loss.detach(), rtol=1e-5, atol=0)
