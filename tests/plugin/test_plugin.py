"""enable(): idempotent, salts Inductor's cache key; importing needs only torch."""

import subprocess
import sys

import pytest
import torch

import inductor_ext
from inductor_ext import plugin
from lowerings._compat import CustomGraphPass, inductor_config


@pytest.fixture
def clean_pass_slot():
    saved = inductor_config.post_grad_custom_post_pass
    inductor_config.post_grad_custom_post_pass = None
    yield
    inductor_config.post_grad_custom_post_pass = saved


def test_enable_is_idempotent(clean_pass_slot):
    inductor_ext.enable()
    first = inductor_config.post_grad_custom_post_pass
    inductor_ext.enable()
    assert inductor_config.post_grad_custom_post_pass is first and inductor_ext.is_enabled()
    assert first.uuid() == ("glm53-inductor", plugin.source_hash(), None)


def test_enable_keeps_an_existing_pass(clean_pass_slot):
    calls = []

    class Other(CustomGraphPass):
        def __call__(self, graph):
            calls.append(graph)

        def uuid(self):
            return "other"

    inductor_config.post_grad_custom_post_pass = Other()
    inductor_ext.enable()
    installed = inductor_config.post_grad_custom_post_pass
    assert installed.uuid()[-1] == "other"
    installed("graph")
    assert calls == ["graph"]


def test_enable_refuses_uncacheable_pass(clean_pass_slot):
    inductor_config.post_grad_custom_post_pass = lambda graph: None
    with pytest.raises(ValueError, match="CustomGraphPass"):
        inductor_ext.enable()


def test_source_hash_covers_package_sources():
    assert len(plugin.source_hash()) == 64


def test_import_needs_only_torch():
    # torch._inductor itself imports triton where it is installed: compare against that baseline
    code = ("import sys, torch, torch._inductor.config, torch._inductor.custom_graph_pass; "
            "optional = ('triton', 'fla', 'tilelang', 'lmdeploy'); "
            "before = {m for m in optional if m in sys.modules}; "
            "import inductor_ext, fake_impls, lowerings, graphs; "
            "bad = [m for m in optional if m in sys.modules and m not in before]; "
            "print(bad); sys.exit(1 if bad else 0)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_batch_invariant_graphs_never_split_a_reduction(monkeypatch):
    """In a forward graph holding glm53::bi_* ops (PrecisionConfig.batch_invariant) Inductor's
    reductions are neither split nor cooperative whatever the row count; other graphs, backward
    graphs of batch-invariant modules included (gradients carry no invariance contract), keep
    Inductor's choices."""
    from torch._inductor.choices import InductorChoices
    from torch._inductor.virtualized import V

    inductor_ext.enable()

    invariant = torch.fx.symbolic_trace(lambda x, w: torch.ops.glm53.bi_linear(x, w, None, torch.float32).sum(-1))
    plain = torch.fx.symbolic_trace(lambda x, w: torch.nn.functional.linear(x, w).sum(-1))
    monkeypatch.setattr(InductorChoices, "reduction_split_factor", staticmethod(lambda *a: 7))
    monkeypatch.setattr(InductorChoices, "should_use_cooperative_reduction", staticmethod(lambda *a: True))

    class Lowering:  # what the choices read of a GraphLowering
        def __init__(self, gm, is_backward=False):
            self.module = gm
            self.is_backward = is_backward

    dev = torch.device("cuda")
    for gm, backward, split, cooperative in ((invariant, False, 1, False), (plain, False, 7, True),
                                             (invariant, True, 7, True)):
        with V.set_graph_handler(Lowering(gm, backward)):
            assert V.choices.reduction_split_factor(dev, 1 << 20, 1, True) == split
            assert V.choices.reduction_split_factor(dev, 1 << 20, 1, False) == split
            assert V.choices.should_use_cooperative_reduction(dev, 1, 1 << 20) is cooperative
    assert V.choices.reduction_split_factor(dev, 1 << 20, 1, True) == 7  # outside any lowering


def test_enable_keeps_one_qdq_group_reduction_persistent(monkeypatch):
    import sympy
    from torch._inductor.choices import InductorChoices
    from torch._inductor.virtualized import V

    from lowerings import _compat

    inductor_ext.enable()
    assert type(V.choices).MAX_NUMEL == 128 and V.choices.uuid() == "glm53-persistent-reductions-128-xblock-8-bi-nosplit"
    if hasattr(inductor_config, "inductor_choices_class"):
        assert inductor_config.inductor_choices_class is type(V.choices)
    # Inductor's own test says no (as for the DEFAULT hint above 64 elements): ours overrides it up to 128
    monkeypatch.setattr(InductorChoices, "should_use_persistent_reduction", staticmethod(lambda f, c: False))

    class Features:
        def __init__(self, numel):
            self.reduction_numel = numel

    decide = V.choices.should_use_persistent_reduction
    assert decide(Features(sympy.Integer(128)), False) and decide(Features(64), False)
    assert not decide(Features(sympy.Integer(129)), False)
    assert not decide(Features(sympy.Symbol("s0", positive=True)), False)  # dynamic: Inductor decides
    # ... launched with XBLOCK 8 (4 warps), not an autotuned tile
    from torch._inductor.codegen.cpp import CppKernel
    from torch._inductor.codegen.triton import FixedTritonConfig, TritonKernel

    def fixed(numel, kernel_cls=TritonKernel, groups=({"x": 8192, "r0_": 128},), **kwargs):
        cfg = V.choices.triton_kernel_kwargs(kernel_cls, Features(numel), list(groups), kwargs).get("fixed_config")
        return None if cfg is None else cfg.config

    assert fixed(sympy.Integer(128)) == fixed(65) == fixed(128, groups=(8192, 128)) == {"XBLOCK": 8}
    assert fixed(129) is fixed(64) is fixed(1) is fixed(sympy.Symbol("s0", positive=True)) is None
    assert fixed(128, groups=({"x": 64, "y": 128, "r0_": 128},)) is None  # a tiled reduction keeps autotuning
    assert fixed(128, kernel_cls=CppKernel) is None and fixed(128, override_persistent_reduction=False) is None
    assert fixed(128, fixed_config=FixedTritonConfig({"XBLOCK": 2})) == {"XBLOCK": 2}  # someone else's stays
    # a mix-order reduction (CUDA, torch 2.11) launches with RSPLIT_SIZE: XBLOCK alone fails its compile
    assert fixed(128, mix_order_reduction=True, override_persistent_reduction=True) is None
    monkeypatch.setattr(inductor_config.triton, "persistent_reductions", False)
    assert not decide(Features(128), False) and fixed(128) is None
    # someone else's choices class is left alone
    if hasattr(inductor_config, "inductor_choices_class"):
        monkeypatch.setattr(inductor_config, "inductor_choices_class", InductorChoices)
        assert not _compat.install_persistent_reductions(128)
        assert inductor_config.inductor_choices_class is InductorChoices
