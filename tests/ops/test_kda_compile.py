"""kda_chunk under torch.compile: one graph, precision as a literal, one compile per config."""

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend

import inductor_ext
from inductor_ext import PrecisionConfig, ops
from tests.support.fp64 import CASES, make_inputs

ARGS = ("q", "k", "v", "g", "beta")


def _leaves(case, dtype=torch.float32):
    inputs = make_inputs(case, dtype)
    leaves = [inputs[n].clone().requires_grad_(True) for n in ARGS]
    h0 = torch.randn(len(case.lengths), case.heads, case.k_dim, case.v_dim, requires_grad=True)
    return leaves, h0, inputs["cu_seqlens"]


def step(q, k, v, g, beta, h0, cu_seqlens):
    o, final = ops.kda_chunk(q, k, v, g, beta, initial_state=h0, cu_seqlens=cu_seqlens)
    return o.float().square().mean() + final.square().mean()


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_forward_backward_one_graph_and_config_recompiles_once(backend):
    inductor_ext.enable()
    counter = CompileCounterWithBackend(backend)
    compiled = torch.compile(step, backend=counter, fullgraph=True)
    leaves, h0, cu = _leaves(CASES[0])
    grads = {}
    for prec in ("bf16", "fp32"):
        with inductor_ext.precision(PrecisionConfig(kda=prec)):
            loss = compiled(*leaves, h0, cu)
            grads[prec] = torch.autograd.grad(loss, [*leaves, h0])
            with torch.compiler.set_stance("fail_on_recompile"):
                for _ in range(2):
                    torch.autograd.grad(compiled(*leaves, h0, cu), [*leaves, h0])
            eager = torch.autograd.grad(step(*leaves, h0, cu), [*leaves, h0])
        for name, a, b in zip([*ARGS, "h0"], grads[prec], eager):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=lambda m, n=name: f"d{n} ({prec}): {m}")
    assert counter.frame_count == 2, "exactly one compile per config"
    # back to the first config: the cached graph is reused
    with inductor_ext.precision(PrecisionConfig(kda="bf16")), torch.compiler.set_stance("fail_on_recompile"):
        compiled(*leaves, h0, cu)


def test_precision_is_a_literal_in_the_graph():
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm

    compiled = torch.compile(step, backend=backend, fullgraph=True)
    leaves, h0, cu = _leaves(CASES[0])
    for prec in ("bf16", "fp32"):
        with inductor_ext.precision(PrecisionConfig(kda=prec)):
            compiled(*leaves, h0, cu)
    (call_bf16,), (call_fp32,) = (
        [n for n in gm.graph.nodes if n.target in (torch.ops.glm53.kda_chunk, torch.ops.glm53.kda_chunk.default)]
        for gm in graphs
    )
    assert call_bf16.args[8] == "bf16" and call_fp32.args[8] == "fp32"
    assert call_bf16.args[9] is True  # residuals: the graph has a backward


def test_explicit_precision_ignores_active_config():
    counter = CompileCounterWithBackend("aot_eager")
    fn = torch.compile(lambda *a: ops.kda_chunk(*a, precision="fp32")[0], backend=counter, fullgraph=True)
    leaves, _, _ = _leaves(CASES[1])
    fn(*leaves)
    with inductor_ext.precision(PrecisionConfig.serving_aligned()), torch.compiler.set_stance("fail_on_recompile"):
        fn(*leaves)
    assert counter.frame_count == 1


def test_inductor_backward_graph_holds_the_backward_op():
    from torch._inductor.utils import run_and_get_code

    inductor_ext.enable()
    compiled = torch.compile(step, backend="inductor", fullgraph=True)
    leaves, h0, cu = _leaves(CASES[0])

    def run():
        compiled(*leaves, h0, cu).backward()

    _, codes = run_and_get_code(run)
    code = "\n".join(codes)
    assert "glm53.kda_chunk.default" in code and "glm53.kda_chunk_bwd.default" in code
