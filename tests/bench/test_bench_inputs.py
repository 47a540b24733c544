"""inductor_ext.bench.inputs: shapes, dtypes, seeds and packing of the shared input builders, and
the same numbers as the tests' own builders draw (``tests/support``)."""

import pytest
import torch

from graphs import GLM53Config
from graphs.modules import FP32_PARAMS
from inductor_ext.bench import inputs
from tests.support.fp64 import CASES, make_inputs
from tests.support.kpool import HIDDEN, QR, kp_inputs


def test_cu_seqlens_and_two_documents():
    cu = inputs.cu_seqlens((5, 0, 3))
    assert cu.dtype == torch.int64 and cu.tolist() == [0, 5, 5, 8]
    assert inputs.two_documents(8192) == (5120, 3072) and inputs.two_documents(31) == (19, 12)


@pytest.mark.parametrize("case", [c for c in CASES if not c.initial_state], ids=lambda c: c.name)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kda_inputs_draw_what_the_fp64_tests_draw(case, dtype):
    x, cu = inputs.kda_inputs(case.lengths, case.heads, case.k_dim, case.v_dim, dtype=dtype, seed=3)
    ref = make_inputs(case, dtype, seed=3)
    assert list(x) == list(inputs.KDA_ARGS)
    for name in inputs.KDA_ARGS:
        assert x[name].dtype == ref[name].dtype and torch.equal(x[name], ref[name]), name
    assert (cu is None) == (ref["cu_seqlens"] is None)
    if cu is not None:
        assert torch.equal(cu, ref["cu_seqlens"])


def test_kda_inputs_shapes_gate_and_leaves():
    x, cu = inputs.kda_inputs((10,), 3, 8, 4, requires_grad=True)
    assert cu is None
    assert {n: tuple(t.shape) for n, t in x.items()} == {
        "q": (1, 10, 3, 8), "k": (1, 10, 3, 8), "v": (1, 10, 3, 4), "g": (1, 10, 3, 8), "beta": (1, 10, 3)}
    assert x["g"].dtype == torch.float32 and all(x[n].dtype == torch.bfloat16 for n in ("q", "k", "v", "beta"))
    assert bool((x["g"] <= 0).all() and (x["g"] >= -5).all())
    assert all(t.is_leaf and t.requires_grad for t in x.values())
    again, _ = inputs.kda_inputs((10,), 3, 8, 4)
    assert all(torch.equal(again[n], x[n].detach()) for n in x) and not again["q"].requires_grad


def test_kpool_inputs_draw_what_the_kpool_tests_draw():
    x, qr, cu = inputs.kpool_inputs((30, 41), HIDDEN, QR, seed=11)
    rx, rqr, rcu = kp_inputs((30, 41), seed=11)
    assert torch.equal(x, rx) and torch.equal(qr, rqr) and torch.equal(cu, rcu)
    assert x.dtype == qr.dtype == torch.bfloat16 and x.shape == (71, HIDDEN) and qr.shape == (71, QR)


def test_kpool_inputs_and_weights_share_a_generator():
    gen = torch.Generator().manual_seed(0)
    x, q_resid, cu = inputs.kpool_inputs((16,), 32, 24, generator=gen)
    w = inputs.kpool_weights(2, 32, 24, 8, 4, gen)
    assert cu.tolist() == [0, 16]
    assert list(w) == ["wq_b", "wk", "k_norm_weight", "k_norm_bias", "weights_proj", "compress_gate", "compress_ape"]
    assert w["wq_b"].shape == (16, 24) and w["compress_ape"].shape == (4, 8)
    assert w["compress_ape"].dtype == torch.float32 and w["wk"].dtype == torch.bfloat16
    assert torch.equal(w["k_norm_weight"], torch.ones(8)) and torch.equal(w["k_norm_bias"], torch.zeros(8))
    fresh = torch.Generator().manual_seed(0)
    assert torch.equal(inputs.kpool_inputs((16,), 32, 24, generator=fresh)[0], x)
    assert torch.equal(inputs.kpool_weights(2, 32, 24, 8, 4, fresh)["wk"], w["wk"])  # same seed, same stream
    unused = torch.Generator().manual_seed(0)
    assert not torch.equal(inputs.kpool_weights(2, 32, 24, 8, 4, unused)["wk"], w["wk"])  # drawn after the inputs


def test_moe_inputs():
    gate_up, x = inputs.moe_inputs(16, 32, 8)
    assert gate_up.shape == (16, 16) and x.shape == (16, 32) and gate_up.dtype == x.dtype == torch.bfloat16
    assert gate_up.float().abs().max() > 10  # std 6: reaches SwiGLU's limit


def test_decoder_layer_and_layer_inputs():
    cfg = GLM53Config.tiny()
    layer = inputs.decoder_layer(cfg, "kda")
    again = inputs.decoder_layer(cfg, "kda")
    for (name, p), q in zip(layer.named_parameters(), again.parameters()):
        assert torch.equal(p, q), name
        want = torch.float32 if any(key in name for key in FP32_PARAMS) else torch.bfloat16
        assert p.dtype == want, name
    (x, x_check), cu = inputs.layer_inputs(cfg, 64, count=2)
    assert x.shape == x_check.shape == (64, cfg.hc_mult, cfg.hidden_size) and x.dtype == torch.bfloat16
    assert not torch.equal(x, x_check) and cu.tolist() == [0, 40, 64]
    (x1,), _ = inputs.layer_inputs(cfg, 64)
    assert torch.equal(x1, x)
