"""glm53::kda_chunk on CUDA (precision bf16: flash-linear-attention's kernels; fp32: the own FP32-grade
Triton kernels): accuracy, opcheck, compile, capture.

Run on the H200: ``python -m pytest -m cuda tests/ops/test_kda_cuda.py``.
"""

import pytest
import torch

import inductor_ext
from inductor_ext import PrecisionConfig, backends, ops
from inductor_ext.bench import timing
from tests.support.fp64 import TOL, Case, assert_rel_l2, make_inputs, recurrence_fp64, rel_l2, round_bf16, vjp_fp64

pytestmark = pytest.mark.cuda
ARGS = ("q", "k", "v", "g", "beta")
# one geometry (the GLM-5.3 H=64, K=V=128) keeps flash-linear-attention's autotuning to one round
# per dtype and layout; the lengths give packing, the 129-token chunk boundary and a initial state
CASES = [
    Case("packed-37-28", (37, 28), heads=64, k_dim=128, v_dim=128),
    Case("T129-chunk-boundary", (129,), heads=64, k_dim=128, v_dim=128),
    Case("H64-K128-T65", (65,), heads=64, k_dim=128, v_dim=128),
    Case("initial-state-packed", (70, 9), heads=64, k_dim=128, v_dim=128, initial_state=True),
]
ids = [c.name for c in CASES]



@pytest.fixture(autouse=True, scope="module")
def _needs_fla():
    if not backends.available("fla"):
        pytest.skip("fla-core not installed")


def _call(fn, inputs, **kw):
    return fn(*(inputs[n] for n in ARGS), initial_state=inputs["initial_state"],
              cu_seqlens=inputs["cu_seqlens"], **kw)


@pytest.mark.parametrize("case", CASES, ids=ids)
def test_fp32_precision_forward_and_grads(case):
    inputs = make_inputs(case, torch.float32, device="cuda")
    leaves = {n: inputs[n].clone().requires_grad_(True) for n in ARGS}
    if inputs["initial_state"] is not None:
        leaves["initial_state"] = inputs["initial_state"].clone().requires_grad_(True)
    o, s = _call(ops.kda_chunk, {**inputs, **leaves}, precision="fp32")
    scale = case.k_dim ** -0.5
    o_ref, s_ref = recurrence_fp64(*(inputs[n] for n in ARGS), scale, inputs["initial_state"], inputs["cu_seqlens"])
    errs = {"o": assert_rel_l2("o", o, o_ref, TOL["fp32"]["o"]),
            "state": assert_rel_l2("final_state", s, s_ref, TOL["fp32"]["state"])}
    do, dht = torch.randn_like(o), torch.randn_like(s)
    torch.autograd.backward((o, s), (do, dht))
    expected = vjp_fp64(inputs, scale, do, dht)
    for name in expected:
        errs[f"d{name}"] = assert_rel_l2(f"d{name}", leaves[name].grad, expected[name], TOL["fp32"]["grad"])
    print(f"\n[fp32 {case.name}] " + " ".join(f"{k}={v:.2e}" for k, v in errs.items()))


@pytest.mark.parametrize("case", CASES, ids=ids)
def test_bf16_inputs_against_rounded_fp64(case):
    inputs = make_inputs(case, torch.bfloat16, device="cuda")
    o_ref, _ = recurrence_fp64(*(inputs[n] for n in ARGS), case.k_dim ** -0.5, inputs["initial_state"],
                               inputs["cu_seqlens"])
    best = round_bf16(o_ref)
    err32 = rel_l2(_call(ops.kda_chunk, inputs, precision="fp32")[0], best)
    err16 = rel_l2(_call(ops.kda_chunk, inputs, precision="bf16")[0], best)
    print(f"\n[bf16 io {case.name}] fp32={err32:.2e} bf16={err16:.2e}")
    assert TOL["bf16_io"]["bf16_low"] <= err16 <= TOL["bf16_io"]["bf16_high"], f"o (bf16): {err16:.3e}"
    assert err32 < err16, f"o: fp32 precision {err32:.3e} not closer than bf16 {err16:.3e}"


@pytest.mark.parametrize("precision", ["bf16", "fp32"])
def test_cuda_close_to_cpu_reference(precision):
    case = CASES[3]
    cpu = make_inputs(case, torch.bfloat16)
    gpu = {n: (x.cuda() if x is not None else None) for n, x in cpu.items()}
    o_cpu, s_cpu = _call(ops.kda_chunk, cpu, precision=precision)
    o_gpu, s_gpu = _call(ops.kda_chunk, gpu, precision=precision)
    assert_rel_l2("o", o_gpu.cpu(), o_cpu, 1e-2)
    assert_rel_l2("final_state", s_gpu.cpu(), s_cpu, 1e-2)


@pytest.mark.parametrize("precision", ["bf16", "fp32"])
@pytest.mark.parametrize("packed", [False, True], ids=["single", "packed"])
def test_opcheck_cuda(precision, packed):
    case = CASES[0] if packed else CASES[1]
    inputs = make_inputs(case, torch.bfloat16, device="cuda")
    args = [inputs[n].requires_grad_(inputs[n].is_floating_point()) for n in ARGS]
    h0 = torch.randn(len(case.lengths), case.heads, case.k_dim, case.v_dim, device="cuda", requires_grad=True)
    torch.library.opcheck(torch.ops.glm53.kda_chunk, (*args, 0.3, h0, inputs["cu_seqlens"], precision, True),
                          atol=2e-2, rtol=2e-2)
    plain = [x.detach() for x in args]
    torch.library.opcheck(torch.ops.glm53.kda_chunk, (*plain, 0.3, h0.detach(), inputs["cu_seqlens"], precision, False),
                          atol=2e-2, rtol=2e-2)
    out = torch.ops.glm53.kda_chunk(*plain, 0.3, h0.detach(), inputs["cu_seqlens"], precision, True)
    torch.library.opcheck(torch.ops.glm53.kda_chunk_bwd,
                          (*plain, 0.3, h0.detach(), inputs["cu_seqlens"], precision, *out[2:],
                           torch.randn_like(out[0]), torch.randn_like(out[1])), atol=2e-2, rtol=2e-2)


def test_compiled_inductor_and_cuda_graph_capture():
    inductor_ext.enable()
    case = CASES[0]
    inputs = make_inputs(case, torch.bfloat16, device="cuda")
    leaves = [inputs[n].clone().requires_grad_(True) for n in ARGS]
    cu = inputs["cu_seqlens"]

    def step(ls=leaves):
        o, s = ops.kda_chunk(*ls, cu_seqlens=cu)
        return torch.autograd.grad(o.float().square().sum() + s.sum(), ls)

    compiled_fwd = torch.compile(lambda *a: ops.kda_chunk(*a, cu_seqlens=cu)[0], backend="inductor", fullgraph=True)
    for prec in ("bf16", "fp32"):
        with inductor_ext.precision(PrecisionConfig(kda=prec)):
            # the eager reference runs on copies: autograd on the captured leaves on the default
            # stream would leave their AccumulateGrad nodes there, and capture then fails with
            # "operation would make the legacy stream depend on a capturing blocking stream"
            eager = step([x.detach().clone().requires_grad_(True) for x in leaves])
            static = {}
            graph = timing.capture(lambda: static.update(grads=step()))  # fails on any host sync
            for grad in static["grads"]:
                grad.fill_(float("nan"))
            graph.replay()
            torch.cuda.synchronize()
            with torch.no_grad():  # a graph kept alive here would pin the leaves' AccumulateGrad
                # nodes to the default stream, and the next precision's capture would fail as above
                ref_o = ops.kda_chunk(*leaves, cu_seqlens=cu)[0]
                torch.testing.assert_close(compiled_fwd(*leaves), ref_o, msg=lambda m: f"compiled o ({prec}): {m}")
            for name, a, b in zip(ARGS, static["grads"], eager):
                torch.testing.assert_close(a, b, msg=lambda m, n=name: f"d{n} ({prec}): {m}")
