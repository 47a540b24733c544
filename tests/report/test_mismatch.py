"""Serving-numerics forward and the fixed-token mismatch-KL ablation (``python -m inductor_ext mismatch``)."""

import dataclasses
import json
import math

import pytest
import torch

from graphs import GLM53Config, dsa_layer
from graphs.serving import SERVING_PRECISION, ServingForward
from inductor_ext import PrecisionConfig, ops
from inductor_ext.__main__ import main
from inductor_ext.bench.inputs import build_model
from inductor_ext.report.mismatch import (
    LN2,
    MismatchSettings,
    batch_invariant_config,
    default_arms,
    logratio_metrics,
    path_fields,
    run_mismatch,
)

# small enough for a 2-core CPU: 4 sequences x (16 prompt + 16 sampled) tokens. The all-arms run
# teacher-forces eagerly (compiling nine configs costs ~1 min on 2 cores); the compiled training model
# (aot_eager, fullgraph) is checked on the reference and serving-aligned arms.
SMALL = dict(num_seqs=4, prompt_len=16, new_tokens=16, compile="none")
METRICS = ("k3", "mean_abs_logratio", "max_token_kl")
# every key logratio_metrics returns (the module docstring documents them)
ALL_METRICS = ("k3", "mean_abs_logratio", "median_abs_logratio", "p99_abs_logratio", "max_abs_logratio",
               "frac_abs_logratio_gt_ln2", "num_nonzero_logratio", "max_token_kl", "mean_token_kl")
BI_SMALL = ["--seqs", "2", "--prompt-len", "16", "--new-tokens", "8"]


def test_logratio_metrics_on_hand_made_values():
    """Linear-interpolation percentiles (position q·(n−1)), strict |r| > ln 2, r != 0 exactly."""
    vals = [0.0, -5e-324, 0.5, LN2, -1.0, 2.0, -3.0, 4.0]  # |r| ascending as listed; one exact 0, one subnormal
    r = torch.tensor(vals, dtype=torch.float64)
    kl = torch.tensor([0.0, 0.25, 0.5, 0.125, 0.0, 1.0, 0.75, 0.375], dtype=torch.float32)
    m = logratio_metrics(r.flip(0), kl)  # order does not matter
    assert set(m) == set(ALL_METRICS)
    assert m["median_abs_logratio"] == pytest.approx((LN2 + 1.0) / 2, rel=1e-15)  # between ranks 3 and 4 (of 0..7)
    assert m["p99_abs_logratio"] == pytest.approx(3.93, rel=1e-14)  # 3 + 0.93 · (4 − 3); nearest rank would be 4
    assert m["p99_abs_logratio"] == pytest.approx(torch.quantile(r.abs(), 0.99).item(), rel=1e-14)
    assert m["max_abs_logratio"] == 4.0
    assert m["frac_abs_logratio_gt_ln2"] == 0.5  # 1, 2, 3, 4; ln 2 itself is not above ln 2
    assert m["num_nonzero_logratio"] == 7 and isinstance(m["num_nonzero_logratio"], int)
    assert m["mean_abs_logratio"] == pytest.approx(sum(abs(v) for v in vals) / 8, rel=1e-15)
    assert m["k3"] == pytest.approx(sum(math.expm1(v) - v for v in vals) / 8, rel=1e-14)
    assert m["max_token_kl"] == 1.0 and m["mean_token_kl"] == pytest.approx(3.0 / 8, rel=1e-15)
    one = logratio_metrics(torch.tensor([-0.25]), torch.tensor([0.5]))
    assert one["median_abs_logratio"] == one["p99_abs_logratio"] == one["max_abs_logratio"] == 0.25
    zero = logratio_metrics(torch.zeros(5, dtype=torch.float64), torch.zeros(5))
    assert all(zero[k] == 0 for k in ALL_METRICS)
    with pytest.raises(ValueError, match="same number"):
        logratio_metrics(torch.zeros(0), torch.zeros(0))
    with pytest.raises(ValueError, match="batch_invariant must be a bool"):
        MismatchSettings(batch_invariant=1)


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
    run_indexer = dsa_layer.run_indexer

    def indexer(x, q_resid, weights, opts, keys):
        seen["indexer"].add((opts.kpool, opts.kpool_pooling, opts.head_proj))
        return run_indexer(x, q_resid, weights, opts, keys)

    monkeypatch.setattr(dsa_layer, "run_indexer", indexer)
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
def cli_out(tmp_path_factory):
    out = tmp_path_factory.mktemp("mismatch")
    argv = ["mismatch", "--out", str(out), "--seqs", str(SMALL["num_seqs"]), "--prompt-len",
            str(SMALL["prompt_len"]), "--new-tokens", str(SMALL["new_tokens"]), "--compile", "none"]
    assert main(argv) == 0
    return out


@pytest.fixture(scope="module")
def cli_result(cli_out):
    return json.loads((cli_out / "mismatch.json").read_text())


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
    assert cli_result["settings"]["batch_invariant"] is False and cli_result["log_softmax"] == "torch.log_softmax"
    assert cli_result["batch_invariant_overrides"] == {} and cli_result["arms_left_out"] == {}
    assert not cli_result["serving_precision"]["batch_invariant"]
    assert not any(entry["precision"]["batch_invariant"] for entry in arms.values())


def test_cpu_floor_is_small(cli_result):
    """Without batch invariance the CPU decode equals a full re-forward only as far as MKL rounds a
    row alike whatever the row count (exactly 0 on AVX-512 machines; 3 of 64 tokens, k3 1.7e-6, on
    an AMX one); ``--batch-invariant`` makes it exactly 0 (test_batch_invariant_floor_and_aligned_zero)."""
    assert cli_result["serving_reforward"]["k3"] <= 1e-4


def test_tail_metrics_are_consistent(cli_result):
    """Every arm and the floor carry the |r| percentiles, the ln 2 tail and the r != 0 count, and
    they agree with each other (median ≤ p99 ≤ max, mean ≤ max, counts within the tokens)."""
    n = cli_result["num_response_tokens"]
    assert n == SMALL["num_seqs"] * SMALL["new_tokens"]
    entries = {**cli_result["arms"], "(floor)": cli_result["serving_reforward"]}
    for name, m in entries.items():
        assert set(ALL_METRICS) <= set(m), name
        assert 0.0 <= m["median_abs_logratio"] <= m["p99_abs_logratio"] <= m["max_abs_logratio"], name
        assert m["mean_abs_logratio"] <= m["max_abs_logratio"] and m["mean_token_kl"] <= m["max_token_kl"], name
        assert 0.0 <= m["frac_abs_logratio_gt_ln2"] <= 1.0, name
        tail = m["frac_abs_logratio_gt_ln2"] * n
        assert abs(tail - round(tail)) < 1e-9, name  # a count of tokens over n
        nz = m["num_nonzero_logratio"]
        assert isinstance(nz, int) and 0 <= nz <= n, name
        assert round(tail) <= nz and (nz == 0) == (m["max_abs_logratio"] == 0.0), name
        assert (m["frac_abs_logratio_gt_ln2"] > 0) == (m["max_abs_logratio"] > LN2), name
    ref, srv = cli_result["arms"]["reference"], cli_result["arms"]["serving_aligned"]
    assert ref["num_nonzero_logratio"] == n  # every reference token differs
    assert srv["p99_abs_logratio"] < ref["p99_abs_logratio"]


def test_cli_writes_markdown_and_plot(cli_out, cli_result):
    md = (cli_out / "mismatch.md").read_text()
    assert md.startswith("# Train/serve mismatch KL (tiny, cpu, compile=none)\n")
    assert "batch-invariant" not in md
    assert "| median abs r | p99 abs r | frac abs r > ln 2 | tokens r != 0 |" in md
    rows = [line for line in md.splitlines() if line.startswith("| ")][1:]  # the header row off
    assert [row.split(" | ")[0][2:] for row in rows] == [*default_arms(), "(floor: serving re-forward vs its decode)"]
    assert "![k3 and |r| percentiles per arm](mismatch.png)" in md
    assert (cli_out / "mismatch.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_same_seed_is_bitwise_deterministic(cli_result):
    names = ("reference", "serving_aligned")
    again = run_mismatch(MismatchSettings(**SMALL), arms={n: default_arms()[n] for n in names})
    assert again["lm_head_scale"] == cli_result["lm_head_scale"]
    assert again["entropy"] == cli_result["entropy"]
    for n in names:
        for key in ALL_METRICS:
            assert again["arms"][n][key] == cli_result["arms"][n][key], (n, key)
    assert again["serving_reforward"] == cli_result["serving_reforward"]


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
    cfg = GLM53Config.h200_stack()
    assert cfg.layer_types == ("linear_attention",) * 3 + ("indexed_attention",)
    assert (cfg.n_routed_experts, cfg.num_experts_per_tok, cfg.hidden_size) == (32, 8, 4096)
    with pytest.raises(ValueError, match="needs --device cuda"):
        MismatchSettings(preset="h200_stack")
    with pytest.raises(ValueError, match="preset must be one of"):
        MismatchSettings(preset="huge")
    assert main(["mismatch", "--out", str(tmp_path), "--preset", "h200_stack"]) == 2
    assert "needs --device cuda" in capsys.readouterr().err


def test_cli_batch_invariant_reaches_every_config(tmp_path, monkeypatch, capsys):
    """--batch-invariant: batch_invariant=True (and mla="absorbed", which it needs) in every arm's
    recorded precision and in the serving precision; the mla arm, then the reference config, left
    out; every vocabulary log-softmax (8 sampling steps of [2, V], then 2 sequences of [8, V] for
    the floor and each of the 2 arms) through glm53::bi_log_softmax."""
    calls = []
    bi_log_softmax = ops.bi_log_softmax

    def spy(x):
        calls.append(tuple(x.shape))
        return bi_log_softmax(x)

    monkeypatch.setattr(ops, "bi_log_softmax", spy)
    argv = ["mismatch", "--batch-invariant", "--out", str(tmp_path), *BI_SMALL, "--compile", "none",
            "--arms", "reference", "mla", "serving_aligned"]
    assert main(argv) == 0
    result = json.loads((tmp_path / "mismatch.json").read_text())
    assert result["settings"]["batch_invariant"] is True
    assert result["log_softmax"] == "glm53::bi_log_softmax"
    assert result["batch_invariant_overrides"] == {"mla": "absorbed"}
    assert result["serving_precision"] == dataclasses.asdict(SERVING_PRECISION.replace(batch_invariant=True))
    assert result["arms_left_out"] == {"mla": "reference"}
    assert list(result["arms"]) == ["reference", "serving_aligned"]
    for name, entry in result["arms"].items():
        assert entry["precision"]["batch_invariant"] is True and entry["precision"]["mla"] == "absorbed", name
        assert entry["precision"] == dataclasses.asdict(batch_invariant_config(default_arms()[name])), name
        assert set(ALL_METRICS) <= set(entry)
    V = build_model(seed=0).config.vocab_size
    assert calls == [(2, V)] * 8 + [(8, V)] * 6
    md = (tmp_path / "mismatch.md").read_text()
    assert md.startswith("# Train/serve mismatch KL (tiny, cpu, compile=none, batch-invariant)\n")
    assert "batch-invariant kernels (glm53::bi_log_softmax)" in capsys.readouterr().out


def test_batch_invariant_floor_and_aligned_zero(tmp_path):
    """True on-policy: with batch-invariant kernels the serving re-forward reproduces the decode's
    log-probs and the compiled serving-aligned training model reproduces them too, every token exactly."""
    # 40 + 40 tokens: the decode crosses a KDA chunk boundary (64) and replays partial chunks on both sides
    argv = ["mismatch", "--batch-invariant", "--out", str(tmp_path), "--seqs", "3", "--prompt-len", "40",
            "--new-tokens", "40", "--arms", "serving_aligned"]
    assert main(argv) == 0
    result = json.loads((tmp_path / "mismatch.json").read_text())
    assert result["settings"]["compile"] == "inductor"
    floor, aligned = result["serving_reforward"], result["arms"]["serving_aligned"]
    assert floor["k3"] == 0.0 and floor["num_nonzero_logratio"] == 0
    assert aligned["k3"] == 0.0 and aligned["num_nonzero_logratio"] == 0
