"""glm53::fp32_linear on CPU against an FP64 matmul and its hand-written VJP."""

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend

from inductor_ext import ops
from tests.support.fp64 import assert_rel_l2

# relative-L2 tolerances against FP64: FP32 output; gradients per input dtype (one rounding)
TOL = {"y": 2e-6, "grad": {torch.float32: 2e-6, torch.bfloat16: 4e-3}}

CASES = [  # (name, x shape, out features, x dtype, weight dtype, bias)
    ("bf16-B2-T7-48to33-bias", (2, 7, 48), 33, torch.bfloat16, torch.bfloat16, True),
    ("fp32-T63-60to17-nobias", (63, 60), 17, torch.float32, torch.float32, False),
    ("x-bf16-w-fp32-T5-128to64-bias", (5, 128), 64, torch.bfloat16, torch.float32, True),
]
ids = [c[0] for c in CASES]


def _inputs(case, requires_grad=False):
    _, shape, out_f, xd, wd, has_bias = case
    x = torch.randn(shape).to(xd)
    w = (torch.randn(out_f, shape[-1]) * shape[-1] ** -0.5).to(wd)
    b = torch.randn(out_f).to(wd) if has_bias else None
    leaves = [t.requires_grad_(requires_grad) if t is not None else None for t in (x, w, b)]
    return leaves


def _fp64(x, w, b, dy):
    """Reference from the formula: y = x wᵀ + b; dx = dy w, dw = dyᵀ x, db = Σ dy (all FP64)."""
    xd, wd = x.double(), w.double()
    y = xd @ wd.t() + (b.double() if b is not None else 0.0)
    dyd = dy.double().reshape(-1, dy.shape[-1])
    grads = {"x": dy.double() @ wd, "weight": dyd.t() @ xd.reshape(-1, x.shape[-1])}
    if b is not None:
        grads["bias"] = dyd.sum(0)
    return y, grads


@pytest.mark.parametrize("case", CASES, ids=ids)
def test_forward_and_grads_match_fp64(case):
    x, w, b = _inputs(case, requires_grad=True)
    y = ops.fp32_linear(x, w, b)
    assert y.dtype == torch.float32, "y must be FP32"
    dy = torch.randn_like(y)
    y.backward(dy)
    y_ref, g_ref = _fp64(x.detach(), w.detach(), None if b is None else b.detach(), dy)
    assert_rel_l2("y", y, y_ref, TOL["y"])
    for name, leaf in (("x", x), ("weight", w), ("bias", b)):
        if leaf is None:
            continue
        assert leaf.grad.dtype == leaf.dtype, f"d{name} dtype {leaf.grad.dtype} != {leaf.dtype}"
        assert_rel_l2(f"d{name}", leaf.grad, g_ref[name], TOL["grad"][leaf.dtype])


def test_fp32_accuracy_beats_bf16_matmul():
    # the point of the op: a BF16 matmul of the same BF16 inputs is >= 10x further from FP64
    x, w, b = _inputs(CASES[0])
    y_ref, _ = _fp64(x, w, b, torch.zeros(*x.shape[:-1], w.shape[0]))
    err32 = assert_rel_l2("y", ops.fp32_linear(x, w, b), y_ref, TOL["y"])
    err16 = ((torch.nn.functional.linear(x, w, b).double() - y_ref).norm() / y_ref.norm()).item()
    assert err16 > 10 * err32, f"y: bf16 matmul error {err16:.2e} not >> fp32 error {err32:.2e}"


def test_autocast_does_not_change_the_result():
    x, w, b = _inputs(CASES[0], requires_grad=True)
    y = ops.fp32_linear(x, w, b)
    grads = torch.autograd.grad(y.square().sum(), (x, w, b))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y_ac = ops.fp32_linear(x, w, b)
        grads_ac = torch.autograd.grad(y_ac.square().sum(), (x, w, b))
    assert y_ac.dtype == torch.float32, "y under autocast must stay FP32"
    assert torch.equal(y_ac, y), "y under autocast differs from y without"
    for name, a, e in zip(("dx", "dweight", "dbias"), grads_ac, grads):
        assert torch.equal(a, e), f"{name} under autocast differs from {name} without"


def test_bad_inputs_raise():
    x = torch.randn(4, 8)
    with pytest.raises(ValueError, match="weight must be"):
        ops.fp32_linear(x, torch.randn(3, 9))
    with pytest.raises(ValueError, match="bias must be"):
        ops.fp32_linear(x, torch.randn(3, 8), torch.randn(4))
    with pytest.raises(ValueError, match="x must be bfloat16, float16 or float32"):
        ops.fp32_linear(x.long(), torch.randn(3, 8))
    with pytest.raises(ValueError, match="one device"):
        ops.fp32_linear(x, torch.randn(3, 8, device="meta"))


@pytest.mark.parametrize("case", CASES[:2], ids=ids[:2])
def test_opcheck(case):
    torch.library.opcheck(torch.ops.glm53.fp32_linear, tuple(_inputs(case, requires_grad=True)))


def test_compile_forward_backward_one_graph():
    torch._dynamo.reset()

    def step(x, w, b):
        y = ops.fp32_linear(x, w, b)
        return torch.autograd.grad(y.square().mean(), (x, w, b))

    def loss(x, w, b):
        return ops.fp32_linear(x, w, b).square().mean()

    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(loss, backend=counter, fullgraph=True)
    x, w, b = _inputs(CASES[0], requires_grad=True)
    got = torch.autograd.grad(compiled(x, w, b), (x, w, b))
    expected = step(x, w, b)
    for name, a, e in zip(("dx", "dweight", "dbias"), got, expected):
        torch.testing.assert_close(a, e, rtol=0, atol=0, msg=lambda m, n=name: f"{n} (compiled): {m}")
    assert counter.frame_count == 1, f"expected one graph, got {counter.frame_count}"
    torch._dynamo.reset()
