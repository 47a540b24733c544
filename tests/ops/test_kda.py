"""glm53::kda_chunk / kda_recurrent on CPU against the independent FP64 recurrence and VJP."""

import pytest
import torch

from inductor_ext import ops
from tests.support.fp64 import CASES, TOL, assert_rel_l2, make_inputs, recurrence_fp64, rel_l2, round_bf16, vjp_fp64

ARGS = ("q", "k", "v", "g", "beta")
ids = [c.name for c in CASES]


def _call(fn, inputs, **kw):
    return fn(*(inputs[n] for n in ARGS), initial_state=inputs["initial_state"],
              cu_seqlens=inputs["cu_seqlens"], **kw)


def _reference(inputs):
    scale = inputs["q"].shape[-1] ** -0.5
    o, final = recurrence_fp64(*(inputs[n] for n in ARGS), scale, inputs["initial_state"], inputs["cu_seqlens"])
    return scale, o, final


@pytest.mark.parametrize("case", CASES, ids=ids)
def test_fp32_forward_and_state(case):
    inputs = make_inputs(case, torch.float32)
    _, o_ref, s_ref = _reference(inputs)
    o, s = _call(ops.kda_chunk, inputs, precision="fp32")
    assert o.dtype == torch.float32 and s.dtype == torch.float32
    assert_rel_l2("o", o, o_ref, TOL["fp32"]["o"])
    assert_rel_l2("final_state", s, s_ref, TOL["fp32"]["state"])


@pytest.mark.parametrize("case", CASES, ids=ids)
def test_recurrent_matches_fp64(case):
    inputs = make_inputs(case, torch.float32)
    _, o_ref, s_ref = _reference(inputs)
    o, s = _call(ops.kda_recurrent, inputs)
    assert_rel_l2("o", o, o_ref, TOL["fp32"]["o"])
    assert_rel_l2("final_state", s, s_ref, TOL["fp32"]["state"])


def _fp32_grads(case):
    inputs = make_inputs(case, torch.float32)
    leaves = {n: inputs[n].clone().requires_grad_(True) for n in ARGS}
    if inputs["initial_state"] is not None:
        leaves["initial_state"] = inputs["initial_state"].clone().requires_grad_(True)
    o, s = _call(ops.kda_chunk, {**inputs, **leaves}, precision="fp32")
    do, dht = torch.randn_like(o), torch.randn_like(s)
    torch.autograd.backward((o, s), (do, dht))
    expected = vjp_fp64(inputs, inputs["q"].shape[-1] ** -0.5, do, dht)
    return {n: leaves[n].grad for n in expected}, expected


@pytest.mark.parametrize("case", CASES, ids=ids)
def test_fp32_gradients_match_fp64_vjp(case):
    actual, expected = _fp32_grads(case)
    for name in expected:
        assert actual[name].dtype == torch.float32, name
        assert_rel_l2(f"d{name}", actual[name], expected[name], TOL["fp32"]["grad"])


def test_gradient_check_bites_on_planted_error():
    # a 25 % scaling error on one gradient must fail the same check the test above applies
    actual, expected = _fp32_grads(CASES[0])
    with pytest.raises(AssertionError, match="dg: relative L2"):
        assert_rel_l2("dg", actual["g"] * 1.25, expected["g"], TOL["fp32"]["grad"])


@pytest.mark.parametrize("case", CASES, ids=ids)
def test_bf16_inputs_against_rounded_fp64(case):
    inputs = make_inputs(case, torch.bfloat16)
    _, o_ref, _ = _reference(inputs)
    best = round_bf16(o_ref)  # the best a BF16 output can be
    tol = TOL["bf16_io"]
    o32, _ = _call(ops.kda_chunk, inputs, precision="fp32")
    o16, _ = _call(ops.kda_chunk, inputs, precision="bf16")
    assert o32.dtype == o16.dtype == torch.bfloat16
    err32, err16 = rel_l2(o32, best), rel_l2(o16, best)
    assert err32 <= tol["fp32"], f"o (fp32 precision): relative L2 {err32:.3e} > {tol['fp32']:.1e}"
    assert tol["bf16_low"] <= err16 <= tol["bf16_high"], f"o (bf16 precision): relative L2 {err16:.3e}"
    assert err16 >= tol["ratio"] * err32, f"fp32 only {err16 / err32:.1f}x closer than bf16"


def test_bf16_backward_runs_in_bf16():
    inputs = make_inputs(CASES[0], torch.bfloat16)
    leaves = {n: inputs[n].clone().requires_grad_(True) for n in ARGS}
    o, s = _call(ops.kda_chunk, {**inputs, **leaves}, precision="bf16")
    (o.float().square().sum() + s.sum()).backward()
    for n in ARGS:
        assert leaves[n].grad.dtype == inputs[n].dtype, n
        assert torch.isfinite(leaves[n].grad).all() and leaves[n].grad.abs().sum() > 0, n


def test_documents_do_not_leak():
    # the second document's output must not depend on the first document's tokens
    case = CASES[0]
    a = make_inputs(case, torch.float32, seed=1)
    b = {n: (x.clone() if x is not None else None) for n, x in a.items()}
    b["v"][:, :37] += 1.0
    b["k"][:, :37] *= -1.0
    for prec in ("bf16", "fp32"):
        oa, _ = _call(ops.kda_chunk, a, precision=prec)
        ob, _ = _call(ops.kda_chunk, b, precision=prec)
        assert torch.equal(oa[:, 37:], ob[:, 37:]), prec
        assert not torch.equal(oa[:, :37], ob[:, :37]), prec


def test_fp32_causal_is_fp32_on_the_cpu():
    """"fp32_causal" (what batch-invariant layers pass) is "fp32"'s arithmetic: on the CPU the one
    reference kernel, bitwise, gradients too; it only changes which decay path the CUDA kernel takes."""
    inputs = make_inputs(CASES[0], torch.float32)
    leaves = {n: inputs[n].clone().requires_grad_(True) for n in ARGS}
    results = []
    for precision in ("fp32", "fp32_causal"):
        o, s = _call(ops.kda_chunk, {**inputs, **leaves}, precision=precision)
        grads = torch.autograd.grad((o.square().sum() + s.sum()), list(leaves.values()))
        results.append((o, s, *grads))
    assert all(torch.equal(a, b) for a, b in zip(*results))
    with pytest.raises(ValueError, match="fp32_causal"):
        _call(ops.kda_chunk, inputs, precision="fp64")


@pytest.mark.parametrize("precision", ["bf16", "fp32", "fp32_causal"])
@pytest.mark.parametrize("packed", [False, True], ids=["single", "packed"])
def test_opcheck(precision, packed):
    case = CASES[0] if packed else CASES[1]
    inputs = make_inputs(case, torch.float32)
    h0 = torch.randn(len(case.lengths), case.heads, case.k_dim, case.v_dim, requires_grad=True)
    args = [inputs[n].requires_grad_(True) for n in ARGS]
    torch.library.opcheck(torch.ops.glm53.kda_chunk, (*args, 0.3, h0, inputs["cu_seqlens"], precision, True))
    plain = [x.detach() for x in args]
    torch.library.opcheck(torch.ops.glm53.kda_chunk, (*plain, 0.3, h0.detach(), inputs["cu_seqlens"], precision, False))
    torch.library.opcheck(torch.ops.glm53.kda_recurrent,
                          (*(x.detach() for x in args), 0.3, h0.detach(), inputs["cu_seqlens"]))


def test_opcheck_backward_op():
    inputs = make_inputs(CASES[0], torch.float32)
    args = [inputs[n] for n in ARGS]
    out = torch.ops.glm53.kda_chunk(*args, 0.3, None, inputs["cu_seqlens"], "fp32", True)
    do, dht = torch.randn_like(out[0]), torch.randn_like(out[1])
    # CPU: the reference backward (torch.func.vjp) cannot run under opcheck's dispatch modes, so
    # only the registration is checked here; the forward's opcheck runs this op through
    # aot_dispatch, and the CUDA test runs the full opcheck on the flash-linear-attention kernel.
    torch.library.opcheck(torch.ops.glm53.kda_chunk_bwd,
                          (*args, 0.3, None, inputs["cu_seqlens"], "fp32", *out[2:], do, dht),
                          test_utils="test_autograd_registration")


@pytest.mark.parametrize("precision", ["bf16", "fp32"])
def test_forward_only_call_drops_residuals(precision):
    """No gradient needed: the wrapper asks for no residuals (empty, same dtypes), o and the final
    state are bitwise those of the call that keeps them, and a backward through a residual-free
    call fails with a message instead of reading empty tensors."""
    case = CASES[0]
    inputs = make_inputs(case, torch.float32)
    args = [inputs[n] for n in ARGS]
    full = torch.ops.glm53.kda_chunk(*args, 0.3, None, inputs["cu_seqlens"], precision, True)
    with torch.no_grad():
        o, state = ops.kda_chunk(*(x.requires_grad_(True) for x in args), scale=0.3,
                                 cu_seqlens=inputs["cu_seqlens"], precision=precision)
    assert torch.equal(o, full[0]) and torch.equal(state, full[1])
    bare = torch.ops.glm53.kda_chunk(*(x.detach() for x in args), 0.3, None, inputs["cu_seqlens"], precision, False)
    assert all(r.numel() == 0 and r.dtype == f.dtype for r, f in zip(bare[2:], full[2:]))
    leaf = args[0].detach().requires_grad_(True)
    out = torch.ops.glm53.kda_chunk(leaf, *args[1:], 0.3, None, inputs["cu_seqlens"], precision, False)
    with pytest.raises(RuntimeError, match="residuals=False"):
        out[0].sum().backward()
