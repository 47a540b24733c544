"""Serving-numerics forward and the fixed-token mismatch-KL ablation (``python -m inductor_ext mismatch``)."""

import json
import math

import pytest
import torch

from graphs.serving import SERVING_PRECISION, ServingForward
from inductor_ext import PrecisionConfig, ops
from inductor_ext.__main__ import main
from inductor_ext.report.mismatch import (
    MismatchSettings,
    build_model,
    default_arms,
    path_fields,
    run_mismatch,
    stack_config,
)

# small enough for a 2-core CPU: 4 sequences x (16 prompt + 16 sampled) tokens. The all-arms run
# teacher-forces eagerly (compiling nine configs costs ~1 min on 2 cores); the compiled training model
# (aot_eager, fullgraph) is checked on the reference and serving-aligned arms.
SMALL = dict(num_seqs=4, prompt_len=16, new_tokens=16, compile="none")
METRICS = ("k3", "mean_abs_logratio", "max_token_kl")


def test_arms_are_reference_single_paths_and_serving_aligned():
    arms = default_arms()
    ref, srv = PrecisionConfig.reference(), PrecisionConfig.serving_aligned()
    assert path_fields() == ("kda", "kpool", "kpool_pooling", "head_proj", "mhc_post", "swiglu", "moe_act", "mla")
    assert list(arms) == ["reference", *path_fields(), "serving_aligned"]
    assert arms["reference"] == ref and arms["serving_aligned"] == srv
    for name in path_fields():
        assert arms[name] == ref.replace(**{name: getattr(srv, name)})


def test_serving_forward_takes_serving_paths(monkeypatch):
    """Recurrent KDA (never kda_chunk), FP8 indexer, FP32 mHC post, serving SwiGLU, FP8 ue8m0 MoE."""
    model = build_model(seed=0)
    seen = {"recurrent": 0, "indexer": set(), "mhc_post": set(), "swiglu": set(), "fp8": set()}

    def no_chunk(*a, **k):
        raise AssertionError("serving forward must not call kda_chunk")

    def spy(name, fn, key=None):
        def wrapped(*a, **k):
            if key is None:
                seen[name] += 1
            else:
                seen[name].add(key(k))
            return fn(*a, **k)
        monkeypatch.setattr(ops, fn.__name__, wrapped)

    monkeypatch.setattr(ops, "kda_chunk", no_chunk)
    spy("recurrent", ops.kda_recurrent)
    spy("indexer", ops.kpool_indexer, lambda k: (k["kpool"], k["kpool_pooling"], k["head_proj"]))
    spy("mhc_post", ops.mhc_post, lambda k: k["precision"])
    spy("swiglu", ops.swiglu, lambda k: k["mode"])
    spy("fp8", ops.fp8_qdq, lambda k: k["scale_fmt"])
    ids = torch.randint(0, model.config.vocab_size, (24,))
    with torch.no_grad():
        logits = ServingForward(model)(ids)
    assert logits.shape == (24, model.config.vocab_size) and logits.dtype == torch.bfloat16
    assert seen == {"recurrent": 1, "indexer": {("fp8", "fp32", "fp32")}, "mhc_post": {"fp32"},
                    "swiglu": {"serving"}, "fp8": {"ue8m0"}}
    # weights are shared, not copied
    assert ServingForward(model).model.lm_head.weight is model.lm_head.weight


@pytest.fixture(scope="module")
def cli_result(tmp_path_factory):
    out = tmp_path_factory.mktemp("mismatch")
    argv = ["mismatch", "--out", str(out), "--seqs", str(SMALL["num_seqs"]), "--prompt-len",
            str(SMALL["prompt_len"]), "--new-tokens", str(SMALL["new_tokens"]), "--compile", "none"]
    assert main(argv) == 0
    return json.loads((out / "mismatch.json").read_text())


def test_cli_writes_every_arm_and_serving_aligned_beats_reference(cli_result, capsys):
    arms = cli_result["arms"]
    assert list(arms) == list(default_arms())
    for name, entry in arms.items():
        for key in METRICS:
            assert math.isfinite(entry[key]) and entry[key] >= 0.0, (name, key, entry[key])
    # calibrated: peaked like a trained model
    assert 1.0 <= cli_result["entropy"]["prompt_mean_nats"] <= 3.0
    assert cli_result["settings"]["compile"] == "none"
    ref, srv = arms["reference"], arms["serving_aligned"]
    assert ref["k3"] > 0.0
    for key in METRICS:
        assert srv[key] < ref[key], key
    assert srv["k3"] < 0.1 * ref["k3"]
    # on the CPU the decode is bitwise a full re-forward: the serving engine's own floor is zero
    assert cli_result["serving_reforward"] == {key: 0.0 for key in (*METRICS, "mean_token_kl")}


def test_same_seed_is_bitwise_deterministic(cli_result):
    names = ("reference", "serving_aligned")
    again = run_mismatch(MismatchSettings(**SMALL), arms={n: default_arms()[n] for n in names})
    assert again["lm_head_scale"] == cli_result["lm_head_scale"]
    assert again["entropy"] == cli_result["entropy"]
    for n in names:
        for key in (*METRICS, "mean_token_kl"):
            assert again["arms"][n][key] == cli_result["arms"][n][key], (n, key)


def test_compiled_training_model_aot_eager(cli_result):
    """Teacher-forcing through torch.compile(backend="aot_eager", fullgraph=True): same picture."""
    names = ("reference", "serving_aligned")
    comp = run_mismatch(MismatchSettings(**{**SMALL, "compile": "aot_eager"}),
                        arms={n: default_arms()[n] for n in names})
    assert comp["lm_head_scale"] == cli_result["lm_head_scale"]  # same model, prompts and rollout
    ref, srv = comp["arms"]["reference"], comp["arms"]["serving_aligned"]
    for key in METRICS:
        assert srv[key] < ref[key], key
    eager_ref = cli_result["arms"]["reference"]
    assert abs(ref["mean_token_kl"] - eager_ref["mean_token_kl"]) < 0.2 * eager_ref["mean_token_kl"]


def test_misaligned_serving_mhc_post_raises_kl(cli_result):
    """BF16 rounding injected into the serving forward's mHC post: the serving-aligned training arm
    no longer matches, and the metric says so."""
    bad = run_mismatch(MismatchSettings(**SMALL), arms={"serving_aligned": PrecisionConfig.serving_aligned()},
                       serving_precision=SERVING_PRECISION.replace(mhc_post="bf16"))
    good = cli_result["arms"]["serving_aligned"]
    worse = bad["arms"]["serving_aligned"]
    assert worse["k3"] > 10 * good["k3"] and worse["k3"] > 1e-5
    assert worse["mean_token_kl"] > 10 * good["mean_token_kl"]
    assert worse["mean_abs_logratio"] > good["mean_abs_logratio"]


def test_bad_arm_name_exits_2(tmp_path, capsys):
    assert main(["mismatch", "--out", str(tmp_path), "--arms", "nope"]) == 2
    assert "unknown arm" in capsys.readouterr().err


def test_h200_stack_preset_is_3_kda_1_dsa_layers_and_needs_cuda(tmp_path, capsys):
    """3 KDA + 1 DSA layers at h200 widths with 32 routed experts; on the CPU it is refused with a
    one-line error (exit 2), not silently swapped for tiny."""
    cfg = stack_config()
    assert cfg.layer_types == ("linear_attention",) * 3 + ("indexed_attention",)
    assert (cfg.n_routed_experts, cfg.num_experts_per_tok, cfg.hidden_size) == (32, 8, 4096)
    with pytest.raises(ValueError, match="needs --device cuda"):
        MismatchSettings(preset="h200_stack")
    with pytest.raises(ValueError, match="preset must be one of"):
        MismatchSettings(preset="huge")
    assert main(["mismatch", "--out", str(tmp_path), "--preset", "h200_stack"]) == 2
    assert "needs --device cuda" in capsys.readouterr().err
