"""GLM-5.3 layers and the tiny model under torch.compile: for every preset and every single-field
toggle of ``PrecisionConfig.reference()``, forward + backward compile into one graph
(``fullgraph=True``, one frame), never recompile on repeated calls with the same shapes, and the
toggle changes the graph exactly where the config says (aot_eager; inductor: test_graphs_cache)."""

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend

import inductor_ext
from graphs import DecoderLayer, GLM53Config, GLM53Model
from graphs.modules import MoE, cast_model
from graphs.sparse_attention import sparse_attention
from inductor_ext import PrecisionConfig
from tests.support.compile_cases import CONFIGS, PRESETS, compile_case, layer_index

# field=value → (glm53 op, literal that must appear among its arguments)
EXPECT = {
    "kda=fp32": ("glm53.kda_chunk.default", "fp32"),
    "kpool=fp8": ("glm53.kpool_quant_query.default", "ue8m0"),
    "kpool_pooling=fp32": ("glm53.kpool_compress.default", "bf16_fp32"),
    "head_proj=fp32": ("glm53.kpool_project.default", "fp32"),
    "mhc_post=fp32": ("glm53.mhc_post.default", "fp32"),
    "swiglu=serving": ("glm53.swiglu.default", "serving"),
    "moe_act=fp8_ue8m0": ("glm53.fp8_qdq.default", "ue8m0"),
    "moe_act=fp8_fp32scale": ("glm53.fp8_qdq.default", "fp32"),
    "mqa_layout=legacy": ("glm53.kpool_score_select.default", "legacy"),
    "mla=absorbed": ("glm53.sparse_mla.default", True),  # (scale, d_v, deterministic=True)
}
assert set(EXPECT) == set(CONFIGS) - {"reference"}, "every toggle has an expected graph change"


def _fields_used(preset: str, kind: str) -> set[str]:
    """PrecisionConfig fields the module's graph depends on."""
    cfg = PRESETS[preset]()
    idx = range(cfg.num_hidden_layers) if kind == "model" else [layer_index(cfg, kind)]
    used = {"mhc_post", "swiglu"}
    for i in idx:
        if cfg.layer_types[i] == "linear_attention":
            used.add("kda")
        else:
            used.add("mla")
            if cfg.indexer_types[i] == "full":
                used |= {"kpool", "kpool_pooling", "head_proj", "mqa_layout"}
        if cfg.mlp_layer_types[i] == "sparse":
            used.add("moe_act")
    return used


CASES = [(p, k, c) for p in PRESETS for k in ("kda", "dsa") for c in CONFIGS]
CASES += [("tiny", "model", c) for c in CONFIGS]


@pytest.mark.parametrize("preset,kind,config", CASES, ids=["-".join(c) for c in CASES])
def test_one_graph_forward_backward_and_config_in_graph(preset, kind, config):
    res = compile_case(preset, kind, config)
    assert res["frames"] == 1, f"{preset}/{kind}/{config}: {res['frames']} compiled frames (graph break?)"
    assert res["params_with_grad"] >= res["params"] - 16, "gradients reach the parameters"
    if config == "reference":
        return
    ref = compile_case(preset, kind, "reference")
    field = config.split("=")[0]
    if field not in _fields_used(preset, kind):
        assert res["dynamo_code"] == ref["dynamo_code"], f"{config} must not change a {kind} graph"
        return
    op, literal = EXPECT[config]
    assert res["calls"] != ref["calls"], f"{config} must change the glm53 calls"
    assert any(name == op and literal in args for name, args in res["calls"]), \
        f"{config}: expected {op} with {literal!r} in {res['calls']}"
    assert not any(name == op and literal in args for name, args in ref["calls"]), f"{config}: not in reference"


def test_active_config_recompiles_once_per_config_and_never_again():
    torch._dynamo.reset()
    cfg = GLM53Config.tiny()
    layer = cast_model(DecoderLayer(cfg, layer_index(cfg, "dsa")), torch.bfloat16)  # no held precision
    counter = CompileCounterWithBackend("aot_eager")
    step = torch.compile(lambda x: layer(x)[0].float().sum(), backend=counter, fullgraph=True)
    x = torch.randn(32, cfg.hc_mult, cfg.hidden_size, dtype=torch.bfloat16, requires_grad=True)
    configs = [PrecisionConfig.reference(), PrecisionConfig.reference().replace(kpool="fp8")]
    for prec in configs:
        with inductor_ext.precision(prec):
            step(x).backward()
    assert counter.frame_count == 2, "exactly one compile per config"
    for prec in configs:
        with inductor_ext.precision(prec), torch.compiler.set_stance("fail_on_recompile"):
            step(x).backward()
    torch._dynamo.reset()


def test_compiled_model_matches_eager():
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = GLM53Model(GLM53Config.tiny(), PrecisionConfig.serving_aligned()).to_dtype(torch.bfloat16)
    tokens = torch.randint(0, 256, (48,))
    cu = torch.tensor([0, 20, 48])
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    torch.testing.assert_close(compiled(tokens, cu), model(tokens, cu), rtol=0, atol=0)
    torch._dynamo.reset()


def test_bad_inputs_raise_value_error():
    cfg = GLM53Config.tiny()
    model = GLM53Model(cfg)
    with pytest.raises(ValueError, match="input_ids"):
        model(torch.zeros(2, 4, dtype=torch.int64))
    with pytest.raises(ValueError, match="cu_seqlens"):
        model(torch.zeros(8, dtype=torch.int64), torch.tensor([0, 8], dtype=torch.int32))
    with pytest.raises(ValueError, match="streams"):
        model.layers[0](torch.zeros(8, 3, cfg.hidden_size))
    with pytest.raises(ValueError, match="index_n_heads"):
        GLM53Config.tiny(index_n_heads=16)
    with pytest.raises(ValueError, match="shared-indexer"):
        GLM53Config.tiny(indexer_types=("full", "shared", "shared"))
    with pytest.raises(ValueError, match="precision"):
        GLM53Model(cfg, precision="fp32")
    with pytest.raises(ValueError, match="impl"):
        sparse_attention(*[torch.zeros(4, 1, 8)] * 3, torch.zeros(4, 2, dtype=torch.int32), scale=1.0, impl="x")
    assert isinstance(model.layers[0].mlp, MoE)


def test_flex_sparse_attention_matches_eager_forward():
    T, H, D = 32, 2, 16
    q, k, v = (torch.randn(T, H, D) for _ in range(3))
    ids = torch.stack([torch.randperm(T)[:8] for _ in range(T)]).int()
    ids = torch.where(ids <= torch.arange(T)[:, None], ids, -1)
    ids[:, 0] = torch.arange(T)
    eager = sparse_attention(q, k, v, ids, scale=D**-0.5, impl="eager")
    flex = sparse_attention(q, k, v, ids, scale=D**-0.5, impl="flex")
    torch.testing.assert_close(flex, eager, rtol=1e-5, atol=1e-5)
