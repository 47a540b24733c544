"""PrecisionConfig: validation, presets, from_env mapping, the precision() context."""

import dataclasses

import expecttest
import pytest

import inductor_ext
from inductor_ext import PrecisionConfig


def test_presets():
    ref, srv = PrecisionConfig.reference(), PrecisionConfig.serving_aligned()
    assert ref == PrecisionConfig()
    assert (srv.kda, srv.kpool, srv.kpool_pooling, srv.head_proj, srv.mhc_post, srv.swiglu, srv.moe_act) == (
        "fp32", "fp8", "fp32", "fp32", "fp32", "serving", "fp8_ue8m0")
    assert hash(ref) != hash(srv)
    with pytest.raises(dataclasses.FrozenInstanceError):
        ref.kda = "fp32"


@pytest.mark.parametrize("field,value", [("kda", "fp16"), ("moe_act", "fp8"), ("mqa_layout", "dense"),
                                         ("logits_budget_mb", 0), ("logits_budget_mb", 1.5), ("logits_budget_mb", True)])
def test_bad_values_raise(field, value):
    with pytest.raises(ValueError, match=f"PrecisionConfig.{field}"):
        PrecisionConfig(**{field: value})


def test_toggles_cover_every_single_field_change():
    toggles = PrecisionConfig.reference().toggles()
    assert "kda=fp32" in toggles and "moe_act=fp8_fp32scale" in toggles
    for key, cfg in toggles.items():
        name, value = key.split("=")
        diff = [f.name for f in dataclasses.fields(cfg) if getattr(cfg, f.name) != getattr(PrecisionConfig(), f.name)]
        assert diff == [name] and getattr(cfg, name) == value


@pytest.mark.parametrize("env,expected", [
    ({}, {}),
    ({"XTUNER_GLM53_KDA_FP32": "1"}, {"kda": "fp32"}),
    ({"XTUNER_GLM53_KDA_FP32": "0"}, {}),
    ({"XTUNER_GLM53_KPOOL_BF16": "1"}, {"kpool": "bf16", "kpool_pooling": "fp32", "head_proj": "fp32"}),
    ({"XTUNER_GLM53_KPOOL_BF16": "0"}, {"kpool": "fp8", "head_proj": "fp32"}),
    ({"XTUNER_GLM53_LMDEPLOY_SWIGLU": "1", "FP8": "1"}, {"swiglu": "serving", "moe_act": "fp8_ue8m0"}),
])
def test_from_env(env, expected):
    assert PrecisionConfig.from_env(env) == PrecisionConfig.reference().replace(**expected)


def test_from_env_rejects_other_values():
    with pytest.raises(ValueError, match="XTUNER_GLM53_KDA_FP32 must be '0' or '1'"):
        PrecisionConfig.from_env({"XTUNER_GLM53_KDA_FP32": "yes"})


def test_precision_context_nests_and_restores():
    a, b = PrecisionConfig(kda="fp32"), PrecisionConfig(swiglu="serving")
    assert inductor_ext.active_config() == PrecisionConfig.reference()
    with inductor_ext.precision(a):
        with inductor_ext.precision(b):
            assert inductor_ext.active_config() is b
        assert inductor_ext.active_config() is a
    assert inductor_ext.active_config() == PrecisionConfig.reference()
    with pytest.raises(ValueError, match="takes a PrecisionConfig"):
        with inductor_ext.precision("fp32"):
            pass


class TestMessagesAndVocabulary(expecttest.TestCase):
    """Inline expected strings (expecttest: ``EXPECTTEST_ACCEPT=1`` rewrites them on an intended change)."""

    def test_bad_value_message(self):
        with self.assertRaises(ValueError) as err:
            PrecisionConfig(kda="fp16")
        self.assertExpectedInline(str(err.exception), """PrecisionConfig.kda must be one of ('bf16', 'fp32'), got 'fp16'""")

    def test_vocabulary_is_defined_once(self):
        from inductor_ext import config
        from inductor_ext.ops import kda_reference, kpool, mhc_reference
        from inductor_ext.ops.swiglu import MODES

        assert kda_reference.PRECISIONS is config.KDA_PRECISIONS and mhc_reference.PRECISIONS is config.MHC_POST_PRECISIONS
        assert kpool.PRECISIONS is config.KPOOL_PRECISIONS and MODES is config.SWIGLU_MODES
        self.assertExpectedInline(repr(config.CHOICES), """{'kda': ('bf16', 'fp32'), 'kpool': ('bf16', 'fp8'), 'kpool_pooling': ('reference', 'fp32'), 'head_proj': ('model', 'fp32'), 'mhc_post': ('bf16', 'fp32'), 'swiglu': ('native', 'serving'), 'moe_act': ('none', 'fp8_ue8m0', 'fp8_fp32scale'), 'mqa_layout': ('compact', 'legacy'), 'mla': ('decompressed', 'absorbed')}""")

    def test_wrapper_precision_none_follows_the_active_config(self):
        import torch

        from inductor_ext import ops

        gate, up = torch.randn(4, 8, dtype=torch.bfloat16), torch.randn(4, 8, dtype=torch.bfloat16)
        for mode in ("native", "serving"):
            with inductor_ext.precision(PrecisionConfig(swiglu=mode)):
                assert torch.equal(ops.swiglu(gate, up), ops.swiglu(gate, up, mode=mode)), mode
