"""Inductor decompositions of the fusible glm53 ops (lowerings/): the generated CPU code holds no
extern call to a lowered op, each op shares a kernel with its producer or consumer, eager and
aot_eager keep the reference kernels, and FP16 (no exact rounding form) stays opaque."""

import re

import pytest
import torch
from torch.testing import FileCheck

import inductor_ext
import lowerings
from inductor_ext import ops
from lowerings._compat import inductor_config, inductor_decomposition, run_and_get_code

BF16 = torch.bfloat16
LOWERED = ("fp8_qdq", "swiglu", "fp32_linear", "mhc_post")
ATEN = ("sigmoid", "silu")  # on CUDA: ATen's formulas (lowerings/sigmoid.py)
OPAQUE = ("layer_norm_fp32", "mhc_pre")  # a row reduction: Inductor would sum it in its own order


def compile_and_code(fn, *args):
    """(compiled outputs, generated code) of ``torch.compile(fn, fullgraph=True)``, no cache."""
    inductor_ext.enable()
    with inductor_config.patch(fx_graph_cache=False):
        out, codes = run_and_get_code(torch.compile(fn, fullgraph=True), *args)
    return out, "\n".join(codes)


def kernels(code):
    """Names of the C++ kernels Inductor generated (one per fused group)."""
    return re.findall(r"^(cpp_fused_\w+) = async_compile", code, flags=re.M)


def assert_no_extern_call(code, *names):
    for name in names:
        FileCheck().check_not(f"torch.ops.glm53.{name}.default(").run(code)


def bits(t):
    """Bit pattern view: NaN payloads included, so "equal" means bitwise equal."""
    return t.contiguous().view({BF16: torch.int16, torch.float16: torch.int16, torch.float32: torch.int32}[t.dtype])


def assert_bitwise(out, ref, name):
    assert out.dtype == ref.dtype and out.shape == ref.shape, name
    diff = (bits(out) != bits(ref)).sum().item()
    assert diff == 0, f"{name}: {diff} elements differ bitwise from the reference kernel"


def _mlp(x, w_up, w_down):
    """MoE-expert-like chain: bf16 up projection, serving SwiGLU, FP8 QDQ, FP32 down projection."""
    gate, up = torch.matmul(x, w_up.t()).chunk(2, dim=-1)
    h = ops.fp8_qdq(ops.swiglu(gate, up, mode="serving"), scale_fmt="ue8m0")
    return ops.fp32_linear(h, w_down)


@pytest.fixture(scope="module")
def mlp_case():
    x = torch.randn(48, 256, dtype=BF16)
    w_up = torch.randn(2 * 512, 256, dtype=BF16) * 0.1
    w_down = torch.randn(256, 512, dtype=BF16) * 0.05
    out, code = compile_and_code(_mlp, x, w_up, w_down)
    return out, code, _mlp(x, w_up, w_down)


def test_register_all_is_idempotent_and_inductor_only():
    """register_all() puts one decomposition per lowered op and per ATen op it rewrites into
    Inductor's table (twice = once)."""
    lowerings.register_all()
    first = {op: inductor_decomposition(op) for op in lowerings.decompositions()}
    lowerings.register_all()
    assert {op.name() for op in first} == {f"glm53::{n}" for n in LOWERED} | {f"aten::{n}" for n in ATEN}
    assert all(inductor_decomposition(op) is fn and fn is not None for op, fn in first.items())


def test_mlp_swiglu_qdq_and_down_cast_fuse_into_one_kernel(mlp_case):
    """SwiGLU + FP8 QDQ + the FP32 cast of the down projection's input: one kernel between two
    GEMMs, no extern call to any of the three ops."""
    _, code, _ = mlp_case
    assert_no_extern_call(code, "swiglu", "fp8_qdq", "fp32_linear")
    fused = [k for k in kernels(code) if "swiglu" in k]
    assert len(fused) == 1 and "fp8_qdq" in fused[0] and "fp32_linear" in fused[0], kernels(code)
    FileCheck().check("extern_kernels.mm(").check(fused[0] + "(").check("extern_kernels.mm(").run(code)


def test_mlp_compiled_equals_eager_bitwise(mlp_case):
    """Fusion keeps SwiGLU's BF16 rounding before the QDQ: the FP32 result is bitwise eager's."""
    out, _, ref = mlp_case
    assert_bitwise(out, ref, "mlp output")


def test_ops_with_a_row_reduction_stay_opaque():
    """layer_norm_fp32 and mhc_pre have no decomposition: Inductor calls their kernels (which
    compute eager's bits); the mhc_post of both precisions after them is one kernel with its
    consumer, bitwise eager."""
    assert all(inductor_decomposition(getattr(torch.ops.glm53, n).default) is None for n in OPAQUE)
    N, D = 4, 128
    x = torch.randn(8, N, D, dtype=BF16)
    fn, base, scale = torch.randn((2 + N) * N, N * D) * 0.02, torch.randn((2 + N) * N) * 0.1, torch.rand(3)
    w, b = torch.randn(D, dtype=BF16), torch.randn(D, dtype=BF16)

    def layer(x, fn, base, scale, w, b):
        mixed, post, comb = ops.mhc_pre(x * 2, fn, base, scale)
        f = ops.layer_norm_fp32(mixed * 3, w, b)
        return ops.mhc_post(f, x, post, comb, precision="fp32") + 1, ops.mhc_post(f, x, post, comb, precision="bf16")

    out, code = compile_and_code(layer, x, fn, base, scale, w, b)
    for name in OPAQUE:
        FileCheck().check(f"torch.ops.glm53.{name}.default(").run(code)
    assert_no_extern_call(code, "mhc_post")
    assert any("mhc_post" in k and "add" in k for k in kernels(code)), kernels(code)
    for got, ref, name in zip(out, layer(x, fn, base, scale, w, b), ("mhc_post fp32", "mhc_post bf16")):
        assert_bitwise(got, ref, name)


def test_aot_eager_keeps_the_reference_kernels():
    """Only Inductor decomposes: aot_eager's forward graph still calls every glm53 op."""
    from torch._dynamo.testing import AotEagerAndRecordGraphs

    inductor_ext.enable()
    N, D = 4, 128
    x, w = torch.randn(8, 256, dtype=BF16), torch.randn(128, 256, dtype=BF16)
    s = torch.randn(8, N, D, dtype=BF16)
    fn, base, scale = torch.randn((2 + N) * N, N * D) * 0.02, torch.randn((2 + N) * N) * 0.1, torch.rand(3)

    def f(x, w, s, fn, base, scale):
        h = ops.fp8_qdq(ops.swiglu(x, x))
        y = ops.layer_norm_fp32(ops.fp32_linear(h, w).to(BF16))
        mixed, post, comb = ops.mhc_pre(s, fn, base, scale)
        return y, ops.mhc_post(mixed, s, post, comb, precision="fp32")

    backend = AotEagerAndRecordGraphs()
    torch._dynamo.reset()
    torch.compile(f, backend=backend, fullgraph=True)(x, w, s, fn, base, scale)
    called = {n.target.name() for g in backend.fw_graphs for n in g.graph.nodes
              if isinstance(n.target, torch._ops.OpOverload)}
    assert {f"glm53::{n}" for n in LOWERED + OPAQUE} <= called, called


@pytest.mark.parametrize("dtype", [BF16, torch.float16], ids=["bf16", "fp16"])
def test_rounding_kept_across_fused_producers_and_consumers(dtype):
    """Plain ATen producers (``g * 1.7``) and consumers (``* 3``) fused with swiglu / fp8_qdq
    keep every rounding of eager (Inductor alone would skip the BF16/FP16 round trips): no extern
    call, results bitwise the reference kernels', for BF16 and FP16."""
    g, u = torch.randn(4, 256, dtype=dtype) * 4, torch.randn(4, 256, dtype=dtype) * 4
    fn = lambda g, u: (ops.fp8_qdq(ops.swiglu(g * 1.7, u)), ops.swiglu(g, u * 1.3) * 3)  # noqa: E731
    out, code = compile_and_code(fn, g, u)
    assert_no_extern_call(code, "swiglu", "fp8_qdq")
    for got, ref, name in zip(out, fn(g, u), ("producer -> swiglu -> fp8_qdq", "swiglu -> consumer")):
        assert_bitwise(got, ref, f"{dtype} {name}")
