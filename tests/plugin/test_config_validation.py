"""Every configuration dataclass checks every field when built: a matrix of bad values, each a
``ValueError`` whose message names the field (``docs/DESIGN.md`` §6), every field covered; the
presets still build; the KPool indexer's own rule is the config's rule, no stricter."""

import dataclasses
import math

import numpy as np
import pytest

from graphs import GLM53Config
from graphs import config as graph_config
from inductor_ext import PrecisionConfig, validation, workspace
from inductor_ext.bench import BENCHES, Benchmark
from inductor_ext.bench import layer as bench_layer
from inductor_ext.ops import kda_reference, kpool_reference
from inductor_ext.ops.kpool import check_pool_geometry
from inductor_ext.report.mismatch import MismatchSettings

NAN, INF = float("nan"), float("inf")
POS_INT = (0, -1, 2.0, True, "4", None)  # a positive int field: zero, negative, float, bool, str, None
POS_REAL = (0.0, -1.0, NAN, INF, True, "1.0", None)
BOOL = (0, 1, "yes", None)

# (field, bad value, expected text in the message: the field's name unless given)
GLM53_BAD = [
    *[(f, b) for f in ("vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size",
                       "num_attention_heads", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "v_head_dim",
                       "linear_num_heads", "linear_conv_kernel_dim", "hc_mult", "hc_sinkhorn_iters") for b in POS_INT],
    ("vocab_size", 256.0), ("hidden_size", -128), ("hc_mult", 0),  # the known defects: NaN logits, deep torch errors
    *[("num_hidden_layers", b) for b in POS_INT], ("num_hidden_layers", 2),  # 2: the schedules hold 3
    *[("n_routed_experts", b) for b in POS_INT], ("n_routed_experts", 7), ("n_routed_experts", 2),
    *[("n_group", b) for b in POS_INT], ("n_group", 3), ("n_group", 8),  # 8: groups of one expert
    *[("topk_group", b) for b in POS_INT], ("topk_group", 3),
    *[("num_experts_per_tok", b) for b in POS_INT], ("num_experts_per_tok", 5),  # only 4 in topk_group groups
    ("n_shared_experts", -1), ("n_shared_experts", 1.0), ("n_shared_experts", True),
    ("linear_head_dim", 0), ("linear_head_dim", 257), ("linear_head_dim", 32.0), ("linear_head_dim", False),
    *[(f, b) for f in ("routed_scaling_factor", "rms_norm_eps", "swiglu_limit") for b in POS_REAL],
    ("linear_lower_bound", 0.0), ("linear_lower_bound", 1.0), ("linear_lower_bound", NAN),
    ("linear_lower_bound", -INF), ("linear_lower_bound", True), ("linear_lower_bound", "-5"),
    ("hc_eps", -1e-6), ("hc_eps", NAN), ("hc_eps", INF), ("hc_eps", True), ("hc_eps", None),
    *[(f, b) for f in ("attention_bias", "norm_topk_prob", "index_kpool_always_select_tail",
                       "tie_word_embeddings") for b in BOOL],
    ("index_n_heads", 16), ("index_n_heads", 32.0), ("index_n_heads", "32"), ("index_n_heads", 0),
    ("index_head_dim", 64), ("index_head_dim", 128.0), ("index_head_dim", 0),
    *[("index_topk", b) for b in POS_INT], ("index_topk", -4), ("index_topk", 18),
    *[("index_kpool", b) for b in POS_INT], ("index_kpool", 3),
    *[(f, b) for f in ("layer_types", "mlp_layer_types", "indexer_types")
      for b in ("dense", None, (), ("x", "x", "x"), 3)],
    ("layer_types", ("linear_attention",) * 2), ("mlp_layer_types", ("dense",) * 4),
    ("indexer_types", ("full", "shared", "shared"), "shared-indexer"),
    ("attn_impl", "sdpa"), ("attn_impl", None), ("attn_impl", 1),
]
PRECISION_BAD = [
    *[(f, b) for f in ("kda", "kpool", "kpool_pooling", "head_proj", "mhc_post", "swiglu", "moe_act", "mqa_layout",
                       "mla") for b in ("fp16", None, 1)],
    *[("logits_budget_mb", b) for b in (*POS_INT, 1.5, 256.0, False)],
    ("batch_invariant", 1), ("batch_invariant", "True"), ("batch_invariant", None),
    ("batch_invariant", True),  # with the default mla="decompressed": it needs absorbed
]
MISMATCH_BAD = [
    ("preset", "huge"), ("preset", None), ("preset", "h200_stack", "needs --device cuda"),
    ("device", "tpu"), ("device", None),
    ("seed", -1), ("seed", 1.0), ("seed", True), ("seed", 2**64), ("seed", "0"),
    *[(f, b) for f in ("num_seqs", "prompt_len", "new_tokens") for b in POS_INT],
    *[("target_entropy", b) for b in POS_REAL], ("target_entropy", 6.0), ("target_entropy", math.log(256)),
    ("compile", "jit"), ("compile", None), ("batch_invariant", 1), ("batch_invariant", "no"),
]
BENCHMARK_BAD = [("title", ""), ("title", 3), ("run", None), ("run", "kda"), ("format", 1),
                 ("token_list", 1), ("token_list", None), *[("samples", b) for b in POS_INT]]
SETUP_BAD = [("device", "tpu"), ("preset", "huge"), ("backend", ""), ("backend", None), ("mode", 3),
             ("mode", ""), ("attn_impl", "sdpa"), ("eager_attn", "x"), ("warmup", -1), ("warmup", 1.0),
             ("warmup", True), ("captures", ()), ("captures", ("fast",)), ("captures", "manual"), ("catch", 1),
             ("timing_only", "no")]


def _build_setup(**kw):
    return bench_layer._Setup(**kw)


def _build_benchmark(**kw):
    return Benchmark(**{"title": "x", "run": lambda **_: {}, **kw})


CLASSES = {  # name -> (builder taking one field change, the dataclass, its bad cases)
    "GLM53Config": (GLM53Config.tiny, GLM53Config, GLM53_BAD),
    "PrecisionConfig": (PrecisionConfig, PrecisionConfig, PRECISION_BAD),
    "MismatchSettings": (MismatchSettings, MismatchSettings, MISMATCH_BAD),
    "Benchmark": (_build_benchmark, Benchmark, BENCHMARK_BAD),
    "bench layer _Setup": (_build_setup, bench_layer._Setup, SETUP_BAD),
}
CASES = [pytest.param(name, case[0], case[1], case[2] if len(case) > 2 else case[0],
                      id=f"{name}-{case[0]}={case[1]!r}")
         for name, (_, _, bad) in CLASSES.items() for case in bad]


@pytest.mark.parametrize("cls_name,field,value,expected", CASES)
def test_bad_field_value_raises_naming_the_field(cls_name, field, value, expected):
    build = CLASSES[cls_name][0]
    with pytest.raises(ValueError) as err:
        build(**{field: value})
    assert expected in str(err.value), str(err.value)


@pytest.mark.parametrize("cls_name", list(CLASSES))
def test_every_field_has_a_bad_case(cls_name):
    _, cls, bad = CLASSES[cls_name]
    assert {f.name for f in dataclasses.fields(cls)} == {case[0] for case in bad}


# ---------------------------------------------------------------------------------------------
# the good values still build


@pytest.mark.parametrize("build", [
    GLM53Config, GLM53Config.tiny, GLM53Config.h200, GLM53Config.h200_stack, lambda: GLM53Config.h200(attn_impl="flex"),
    lambda: GLM53Config.from_hf(GLM53Config.tiny().to_hf_dict()),
    lambda: GLM53Config.from_hf(GLM53Config.h200().to_hf_dict()),
    lambda: GLM53Config.tiny(n_routed_experts=32, num_experts_per_tok=8, n_group=4, topk_group=2),
    lambda: GLM53Config.tiny(linear_lower_bound=None, n_shared_experts=0, hc_eps=0.0, linear_head_dim=256),
    lambda: GLM53Config.tiny(index_topk=3, index_kpool=1),
    PrecisionConfig.reference, PrecisionConfig.serving_aligned, lambda: PrecisionConfig.from_env({}),
    lambda: PrecisionConfig.serving_aligned().replace(batch_invariant=True),
    MismatchSettings, lambda: MismatchSettings(preset="h200_stack", device="cuda", target_entropy=11.0),
    bench_layer._Setup, lambda: bench_layer._Setup(device="cpu", preset="tiny", backend="aot_eager", mode=None,
                                                   captures=("reduce-overhead", "manual"), eager_attn="eager"),
], ids=lambda f: getattr(f, "__qualname__", "lambda"))
def test_good_configs_build(build):
    build()


def test_every_toggle_and_registered_benchmark_builds():
    assert len(PrecisionConfig.reference().toggles()) == 10 and len(PrecisionConfig.serving_aligned().toggles()) == 10
    assert all(isinstance(b, Benchmark) for b in BENCHES.values())


def test_from_hf_of_the_transformers_defaults():
    hf = pytest.importorskip("transformers.models.glm5_next.configuration_glm5_next")
    cfg = GLM53Config.from_hf(hf.Glm5NextTextConfig())
    assert (cfg.num_hidden_layers, cfg.index_topk, cfg.index_kpool) == (45, 2048, 16)


def test_numbers_are_normalized():
    """A numpy int is an int, an int given for a float is a float (the values enter graphs as literals)."""
    cfg = GLM53Config.tiny(hidden_size=np.int64(128), routed_scaling_factor=2, rms_norm_eps=np.float32(1e-5))
    assert type(cfg.hidden_size) is int and cfg.hidden_size == 128
    assert type(cfg.routed_scaling_factor) is float and type(cfg.rms_norm_eps) is float
    assert type(PrecisionConfig(logits_budget_mb=np.int32(64)).logits_budget_mb) is int
    assert GLM53Config.tiny(layer_types=["linear_attention", "indexed_attention", "indexed_attention"]) == \
        GLM53Config.tiny()


# ---------------------------------------------------------------------------------------------
# the rules are the ops' rules


@pytest.mark.parametrize("topk", [-4, 0, 1, 3, 4, 6, 8, 16, 18, 2048, 4.0, True])
@pytest.mark.parametrize("pool", [-1, 0, 1, 2, 3, 4, 16, 4.0, True])
def test_index_topk_and_kpool_follow_the_indexer_rule(topk, pool):
    """GLM53Config accepts (index_topk, index_kpool) exactly when the KPool op accepts (topk,
    pool_size): positive ints, pool_size divides topk; no stricter rule."""
    try:
        check_pool_geometry(topk, pool)
        op_ok = True
    except ValueError:
        op_ok = False
    try:
        GLM53Config.tiny(index_topk=topk, index_kpool=pool)
        cfg_ok = True
    except ValueError:
        cfg_ok = False
    assert cfg_ok == op_ok


def test_constants_are_the_ops_constants():
    assert graph_config._INDEXER_HEADS == workspace.SUPPORTED_HEADS
    assert graph_config._INDEX_HEAD_DIM == kpool_reference.HEAD_DIM
    assert graph_config._KDA_MAX_HEAD_DIM == kda_reference.MAX_HEAD_DIM


# ---------------------------------------------------------------------------------------------
# the helpers


def test_check_fields_refuses_a_table_that_leaves_a_field_out():
    @dataclasses.dataclass(frozen=True)
    class Two:
        a: int = 1
        b: int = 2

        def __post_init__(self):
            validation.check_fields(self, "Two.", {"a": validation.integer(1)})

    with pytest.raises(TypeError, match=r"missing \['b'\]"):
        Two()


@pytest.mark.parametrize("rule,value,message", [
    (validation.integer(1), 0, "x must be a positive int, got 0"),
    (validation.integer(1), 2.0, "x must be a positive int, got float 2.0"),
    (validation.integer(0), True, "x must be a non-negative int, got bool True"),
    (validation.integer(1, 8), 9, "x must be an int in [1, 8], got 9"),
    (validation.real(gt=0), NAN, "x must be a finite number > 0, got nan"),
    (validation.real(lt=0), 0, "x must be a finite number < 0, got 0"),
    (validation.boolean(), 1, "x must be a bool, got int 1"),
    (validation.one_of((32, 64)), 32.0, "x must be one of (32, 64), got 32.0"),
    (validation.sequence(validation.one_of(("a",))), ("a", "b"), "x[1] must be one of ('a',), got 'b'"),
])
def test_rule_messages(rule, value, message):
    with pytest.raises(ValueError) as err:
        rule("x", value)
    assert str(err.value) == message
