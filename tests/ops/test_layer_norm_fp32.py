"""glm53::layer_norm_fp32 on CPU against an FP64 LayerNorm written from the formula and its VJP."""

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend

from inductor_ext import ops
from tests.support.fp64 import assert_rel_l2, round_bf16

# relative L2 against FP64: FP32 in/out; BF16 results against the FP64 result rounded to BF16
TOL = {torch.float32: {"y": 1e-6, "grad": 1e-5}, torch.bfloat16: {"y": 2e-3, "grad": 4e-3}}

CASES = [  # (name, x shape, dtype, affine)
    ("bf16-T63-D128-affine", (63, 128), torch.bfloat16, True),
    ("fp32-B2-T5-D60-affine", (2, 5, 60), torch.float32, True),
    ("bf16-T9-D32-plain", (9, 32), torch.bfloat16, False),
]
ids = [c[0] for c in CASES]
EPS = 1e-6


def _inputs(case, requires_grad=False):
    _, shape, dtype, affine = case
    x = (torch.randn(shape) * 3 + 1.5).to(dtype)
    w = (1 + 0.5 * torch.randn(shape[-1])).to(dtype) if affine else None
    b = torch.randn(shape[-1]).to(dtype) if affine else None
    return [t.requires_grad_(requires_grad) if t is not None else None for t in (x, w, b)]


def _fp64(x, w, b, eps):
    """FP64 LayerNorm from the definition (biased variance), differentiable for the VJP."""
    mu = x.mean(-1, keepdim=True)
    var = (x - mu).square().mean(-1, keepdim=True)
    y = (x - mu) / torch.sqrt(var + eps)
    if w is not None:
        y = y * w + b
    return y


@pytest.mark.parametrize("case", CASES, ids=ids)
def test_forward_and_grads_match_fp64(case):
    x, w, b = _inputs(case, requires_grad=True)
    y = ops.layer_norm_fp32(x, w, b, eps=EPS)
    assert y.dtype == x.dtype, f"y dtype {y.dtype} != x dtype {x.dtype}"
    dy = torch.randn_like(y)
    y.backward(dy)
    leaves = {"x": x, "weight": w, "bias": b}
    ref = {n: (t.detach().double().requires_grad_(True) if t is not None else None) for n, t in leaves.items()}
    y_ref = _fp64(ref["x"], ref["weight"], ref["bias"], EPS)
    y_ref.backward(dy.double())
    tol = TOL[case[2]]
    best = round_bf16 if case[2] == torch.bfloat16 else (lambda t: t)
    assert_rel_l2("y", y, best(y_ref.detach()), tol["y"])
    for name, leaf in leaves.items():
        if leaf is None:
            continue
        assert leaf.grad.dtype == leaf.dtype, f"d{name} dtype {leaf.grad.dtype} != {leaf.dtype}"
        assert_rel_l2(f"d{name}", leaf.grad, best(ref[name].grad), tol["grad"])


def test_bf16_output_is_one_rounding_of_fp32():
    # BF16 input: the result equals the FP32 LayerNorm of the same values rounded once
    x, w, b = _inputs(CASES[0])
    y32 = ops.layer_norm_fp32(x.float(), w.float(), b.float(), eps=EPS)
    y16 = ops.layer_norm_fp32(x, w, b, eps=EPS)
    assert torch.equal(y16, y32.to(torch.bfloat16)), "y (bf16) is not the rounded FP32 result"


def test_bad_inputs_raise():
    x = torch.randn(4, 8)
    with pytest.raises(ValueError, match="weight must be"):
        ops.layer_norm_fp32(x, torch.ones(7))
    with pytest.raises(ValueError, match="eps must be a finite number > 0"):
        ops.layer_norm_fp32(x, eps=0.0)
    with pytest.raises(ValueError, match="x must be bfloat16"):
        ops.layer_norm_fp32(x.int())
    with pytest.raises(ValueError, match="one device"):
        ops.layer_norm_fp32(x, torch.ones(8, device="meta"))


@pytest.mark.parametrize("case", CASES, ids=ids)
def test_opcheck(case):
    x, w, b = _inputs(case, requires_grad=True)
    torch.library.opcheck(torch.ops.glm53.layer_norm_fp32, (x, w, b, EPS))


def test_compile_forward_backward_one_graph():
    torch._dynamo.reset()

    def loss(x, w, b):
        return ops.layer_norm_fp32(x, w, b, eps=EPS).float().square().mean()

    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(loss, backend=counter, fullgraph=True)
    leaves = _inputs(CASES[0], requires_grad=True)
    got = torch.autograd.grad(compiled(*leaves), leaves)
    expected = torch.autograd.grad(loss(*leaves), leaves)
    for name, a, e in zip(("dx", "dweight", "dbias"), got, expected):
        torch.testing.assert_close(a, e, rtol=0, atol=0, msg=lambda m, n=name: f"{n} (compiled): {m}")
    assert counter.frame_count == 1, f"expected one graph, got {counter.frame_count}"
    torch._dynamo.reset()
