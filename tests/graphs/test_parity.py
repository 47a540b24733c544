"""Parity of graphs.GLM53Model (loaded through from_hf) with transformers 5.x ``glm5_next`` eager on
a tiny random config, CPU, BF16 model.

Which transformers numerics each precision reproduces:

- transformers' CPU eager KDA is its torch fallback, FP32 throughout = ``kda="fp32"``. With
  ``reference().replace(kda="fp32")`` every op runs the same arithmetic in the same dtype and
  order, so the tolerance is 0 (bitwise): hidden streams after every layer, logits, indexer ids.
- ``reference()`` keeps KDA's BF16 intermediates where flash-linear-attention's ``chunk_kda``
  rounds them (what transformers runs when ``fla`` is installed, on GPU). We emulate that
  transformers configuration by routing its ``chunk_kimi_delta_attention`` to the BF16 chunk
  reference (itself checked against FP64 in ``test_kda.py``); everything else in the transformers
  forward is its own code. Tolerance again 0.
- ``reference()`` against stock CPU transformers differs only inside the KDA core: measured on the
  KDA token-mixer output with identical inputs (relative L2 0.47 % measured, bound 2 %: ~8 sequential
  BF16 roundings of unit 2⁻⁹ = 0.2 %).
"""

import pytest
import torch
from transformers.models.glm5_next import modeling_glm5_next as hf_mod

from graphs import GLM53Config, GLM53Model
from inductor_ext import PrecisionConfig, ops
from tests.support.hf import id_sets, record_outputs, tiny_hf_model

T = 64  # 16 pools of 4, topk 16 = 4 pools: the indexer really selects


def _rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def _indexers(layers, attr="indexer"):
    return [getattr(l.self_attn, attr) for l in layers if getattr(l.self_attn, attr, None) is not None]


@pytest.fixture(scope="module")
def hf():
    return tiny_hf_model()


@pytest.fixture(scope="module")
def tokens():
    return torch.randint(0, GLM53Config.tiny().vocab_size, (1, T), generator=torch.Generator().manual_seed(1))


def _fla_semantics_kda(query, key, value, g, beta, initial_state=None, output_final_state=False, **kwargs):
    """transformers' chunk KDA hook with flash-linear-attention's BF16 intermediates."""
    return ops.kda_chunk(query, key, value, g, beta, initial_state=initial_state, precision="bf16")


def _compare(hf, tokens, prec, monkeypatch=None):
    tl = hf.model.language_model
    h_ref, ids_ref, remove = record_outputs(tl.layers, _indexers(tl.layers))
    with torch.no_grad():
        logits_ref = hf(input_ids=tokens).logits
    remove()
    model = GLM53Model.from_hf(hf, precision=prec)
    h, ids, remove = record_outputs(model.layers, _indexers(model.layers))
    with torch.no_grad():
        logits = model(tokens)
    remove()
    assert len(h) == len(h_ref) == GLM53Config.tiny().num_hidden_layers
    for i, (a, b) in enumerate(zip(h, h_ref)):
        assert a.dtype == torch.bfloat16
        torch.testing.assert_close(a, b[0], rtol=0, atol=0, msg=lambda m, i=i: f"streams after layer {i}: {m}")
    torch.testing.assert_close(logits, logits_ref, rtol=0, atol=0, msg=lambda m: f"logits: {m}")
    assert len(ids) == len(ids_ref) == 1
    assert id_sets(ids[0]) == id_sets(ids_ref[0]), "indexer token sets"
    # the selection is not trivial: some query selects fewer tokens than it can see
    assert any(len(s) < t + 1 for t, s in enumerate(id_sets(ids[0])))


def test_fp32_kda_matches_transformers_cpu_eager_bitwise(hf, tokens):
    _compare(hf, tokens, PrecisionConfig.reference().replace(kda="fp32"))


def test_reference_matches_transformers_with_fla_semantics_bitwise(hf, tokens, monkeypatch):
    monkeypatch.setattr(hf_mod, "chunk_kimi_delta_attention", _fla_semantics_kda)
    _compare(hf, tokens, PrecisionConfig.reference())


def test_reference_kda_core_vs_transformers_cpu_fp32(hf, tokens):
    """Same inputs into each KDA token mixer: the only difference is the BF16 chunk intermediates."""
    tl = hf.model.language_model
    inputs = []
    hooks = [l.self_attn.register_forward_hook(lambda m, a, k, out: inputs.append((k["hidden_states"], out)),
                                               with_kwargs=True)
             for l in tl.layers if l.block_type == "linear_attention"]
    with torch.no_grad():
        hf(input_ids=tokens)
    [h.remove() for h in hooks]
    model = GLM53Model.from_hf(hf, precision=PrecisionConfig.reference())
    mixers = [l.self_attn for l in model.layers if l.kind == "linear_attention"]
    errors = []
    with torch.no_grad():
        for mixer, (x, ref) in zip(mixers, inputs):
            errors.append(_rel(mixer(x[0], None, PrecisionConfig.reference()), ref[0]))
            assert errors[-1] < 0.02, f"KDA mixer rel L2 {errors[-1]:.4f} (bound 0.02)"
    print("KDA mixer rel L2", errors)
    assert len(errors) == 1 and max(errors) > 0, "bf16 intermediates must differ from FP32"


def test_packed_documents_match_transformers_per_document(hf, tokens):
    """Two documents packed with cu_seqlens = two separate transformers forwards (bitwise, kda fp32)."""
    model = GLM53Model.from_hf(hf, precision=PrecisionConfig.reference().replace(kda="fp32"))
    cu = torch.tensor([0, 37, T])
    with torch.no_grad():
        logits = model(tokens[0], cu)
        for s, e in zip(cu[:-1].tolist(), cu[1:].tolist()):
            ref = hf(input_ids=tokens[:, s:e]).logits[0]
            torch.testing.assert_close(logits[s:e], ref, rtol=0, atol=0, msg=lambda m: f"document {s}:{e}: {m}")


def test_from_hf_state_dict_and_config_roundtrip(hf, tokens):
    cfg = GLM53Config.from_hf(hf.config)
    assert cfg == GLM53Config.tiny()
    a = GLM53Model.from_hf(hf.state_dict(), config=hf.config.text_config)
    b = GLM53Model.from_hf(hf.model.language_model.state_dict() | {"lm_head.weight": hf.lm_head.weight},
                           config=cfg)
    assert a.layers[0].mlp.gate.weight.dtype == torch.float32  # kept FP32 like transformers
    with torch.no_grad():
        torch.testing.assert_close(a(tokens), b(tokens), rtol=0, atol=0)
    with pytest.raises(ValueError, match="config="):
        GLM53Model.from_hf(hf.state_dict())
    with pytest.raises(ValueError, match="missing"):
        GLM53Model.from_hf(hf.model.language_model.state_dict(), config=cfg)  # no lm_head, not tied
