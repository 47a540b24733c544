"""glm53::swiglu on CPU: "serving" against FP64 (one rounding), "native" against transformers'
BF16 expression and its autograd."""

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend
from transformers.activations import ACT2FN

from inductor_ext import ops
from tests.support.fp64 import assert_rel_l2, round_bf16

L = 10.0
# relative L2 against FP64 (BF16 results: against FP64 rounded to BF16)
TOL = {torch.float32: {"y": 1e-6, "grad": 1e-6}, torch.bfloat16: {"y": 1e-3, "grad": 4e-3}}
SHAPES = {"T63-F60": (63, 60), "B2-T7-F128": (2, 7, 128)}


def _inputs(shape, dtype, requires_grad=False):
    gate, up = torch.randn(shape) * 6, torch.randn(shape) * 6  # ~10 % of the entries beyond ±L
    gate.view(-1)[:3] = torch.tensor([L, -L, 2 * L])  # the clamp boundaries, exactly
    up.view(-1)[:3] = torch.tensor([L, -L, -2 * L])
    return gate.to(dtype).requires_grad_(requires_grad), up.to(dtype).requires_grad_(requires_grad)


def _fp64(gate, up):
    """FP64 serving formula, differentiable: g/(1+exp(-g)) · u with g = min(gate, L), u = clamp(up)."""
    g, u = gate.double().clamp(max=L), up.double().clamp(-L, L)
    return g / (1 + torch.exp(-g)) * u


def _transformers_native(gate, up):
    """Glm5NextTextMLP's activation on already projected gate/up, in their dtype."""
    return ACT2FN["silu"](gate.clamp(min=None, max=L)) * up.clamp(min=-L, max=L)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("shape", SHAPES.values(), ids=SHAPES.keys())
def test_serving_matches_fp64(shape, dtype):
    gate, up = _inputs(shape, dtype, requires_grad=True)
    y = ops.swiglu(gate, up, limit=L, mode="serving")
    assert y.dtype == dtype, f"y dtype {y.dtype} != {dtype}"
    dy = torch.randn_like(y)
    y.backward(dy)
    g64, u64 = (t.detach().double().requires_grad_(True) for t in (gate, up))
    y64 = _fp64(g64, u64)
    y64.backward(dy.double())
    best = round_bf16 if dtype == torch.bfloat16 else (lambda t: t)
    assert_rel_l2("y", y, best(y64.detach()), TOL[dtype]["y"])
    for name, leaf, ref in (("dgate", gate, g64.grad), ("dup", up, u64.grad)):
        assert leaf.grad.dtype == dtype, f"{name} dtype {leaf.grad.dtype} != {dtype}"
        assert_rel_l2(name, leaf.grad, best(ref), TOL[dtype]["grad"])
    # the clamp boundaries pass the gradient (closed interval), beyond them it is zero
    assert torch.equal(gate.grad.view(-1)[2], torch.zeros((), dtype=dtype)), "dgate beyond the limit"
    assert (gate.grad.view(-1)[:2] != 0).all(), "dgate at the limit"
    assert torch.equal(up.grad.view(-1)[2], torch.zeros((), dtype=dtype)), "dup beyond the limit"


def test_serving_rounds_once_native_twice():
    # serving BF16 output = the correctly rounded FP64 value (FP32 math error << BF16 half-ulp);
    # native rounds silu and the product separately, so it misses the correct rounding more often
    gate, up = _inputs((256, 128), torch.bfloat16)
    best = _fp64(gate, up).to(torch.bfloat16)
    miss_serving = (ops.swiglu(gate, up, mode="serving") != best).float().mean().item()
    miss_native = (ops.swiglu(gate, up, mode="native") != best).float().mean().item()
    assert miss_serving < 1e-3, f"y (serving): {miss_serving:.2%} not correctly rounded"
    assert miss_native > 10 * max(miss_serving, 1e-4), f"y (native) misses only {miss_native:.2%}"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_native_equals_transformers_forward_and_autograd(dtype):
    gate, up = _inputs(SHAPES["T63-F60"], dtype, requires_grad=True)
    y = ops.swiglu(gate, up, limit=L, mode="native")
    g2, u2 = (t.detach().clone().requires_grad_(True) for t in (gate, up))
    y_ref = _transformers_native(g2, u2)
    assert torch.equal(y, y_ref), "y (native) differs from transformers' expression"
    dy = torch.randn_like(y)
    y.backward(dy)
    y_ref.backward(dy)
    assert torch.equal(gate.grad, g2.grad), "dgate (native) differs from transformers' autograd"
    assert torch.equal(up.grad, u2.grad), "dup (native) differs from transformers' autograd"
    # and it stays close to FP64
    best = round_bf16 if dtype == torch.bfloat16 else (lambda t: t)
    assert_rel_l2("y (native)", y, best(_fp64(gate.detach(), up.detach())), 4 * TOL[dtype]["y"])


def test_bad_inputs_raise():
    g = torch.randn(4, 8, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="mode must be one of"):
        ops.swiglu(g, g, mode="fast")
    with pytest.raises(ValueError, match="limit must be a finite number > 0"):
        ops.swiglu(g, g, limit=-1.0)
    with pytest.raises(ValueError, match="share a shape"):
        ops.swiglu(g, g[:, :4])
    with pytest.raises(ValueError, match="share a dtype"):
        ops.swiglu(g, g.float())
    with pytest.raises(ValueError, match="one device"):
        ops.swiglu(g, g.to("meta"))


@pytest.mark.parametrize("mode", ["native", "serving"])
def test_opcheck(mode):
    for dtype in (torch.bfloat16, torch.float32):
        gate, up = _inputs((7, 60), dtype, requires_grad=True)
        torch.library.opcheck(torch.ops.glm53.swiglu, (gate, up, L, mode))


@pytest.mark.parametrize("mode", ["native", "serving"])
def test_compile_forward_backward_one_graph(mode):
    torch._dynamo.reset()

    def loss(gate, up):
        return ops.swiglu(gate, up, limit=L, mode=mode).float().square().mean()

    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(loss, backend=counter, fullgraph=True)
    leaves = _inputs((7, 60), torch.bfloat16, requires_grad=True)
    got = torch.autograd.grad(compiled(*leaves), leaves)
    expected = torch.autograd.grad(loss(*leaves), leaves)
    for name, a, e in zip(("dgate", "dup"), got, expected):
        torch.testing.assert_close(a, e, rtol=0, atol=0, msg=lambda m, n=name: f"{n} (compiled {mode}): {m}")
    assert counter.frame_count == 1, f"expected one graph, got {counter.frame_count}"
    torch._dynamo.reset()
