"""glm53::mhc_pre / mhc_post on CPU against transformers' Glm5NextTextHyperConnection (and the
decoder layer's expansion expression) and against an FP64 formula with its autograd VJP."""

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend
from transformers.models.glm5_next.configuration_glm5_next import Glm5NextTextConfig
from transformers.models.glm5_next.modeling_glm5_next import Glm5NextTextHyperConnection

from inductor_ext import ops
from tests.support.fp64 import assert_rel_l2, rel_l2, round_bf16

# relative L2; "hf" = against transformers on the same inputs, "fp64" = against the FP64 formula
# (BF16 dx: transformers sums two BF16 partial gradients in BF16, mhc_pre rounds the FP32 sum once;
# measured 3.3e-3 apart)
TOL = {
    "fp32": {"hf_grad": 1e-5, "fp64_out": 1e-6, "fp64_grad": 1e-5},
    "bf16": {"hf_grad": 1e-2, "post_fp32": 2e-3, "post_grad": 4e-3},
}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
PARAMS = ("fn", "base", "scale")


def _module(D, dtype, seed=0):
    cfg = Glm5NextTextConfig(hidden_size=D, hc_mult=4)
    hc = Glm5NextTextHyperConnection(cfg)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():  # random, non-trivial coefficients (fn in the model dtype, base/scale FP32)
        hc.fn.copy_(torch.randn(hc.fn.shape, generator=gen) * 0.2)
        hc.base.copy_(torch.randn(hc.base.shape, generator=gen) * 0.5)
        hc.scale.copy_(1 + 0.3 * torch.randn(3, generator=gen))
    hc.fn.data = hc.fn.data.to(dtype)
    return cfg, hc


def _streams(shape, dtype):
    return (torch.randn(shape) * (1 + torch.arange(shape[-2]))[:, None]).to(dtype)


def _ours(cfg, hc, x, w_f, precision):
    mixed, post, comb = ops.mhc_pre(x, hc.fn, hc.base, hc.scale, norm_eps=cfg.rms_norm_eps,
                                    hc_eps=cfg.hc_eps, sinkhorn_iters=cfg.hc_sinkhorn_iters)
    return ops.mhc_post(mixed * w_f, x, post, comb, precision=precision), (mixed, post, comb)


def _transformers(hc, x, w_f):
    """Glm5NextTextDecoderLayer's use of the module around a sublayer f(h) = h · w_f."""
    residual, dtype = x, x.dtype
    post, comb, collapsed = hc(x)
    h = collapsed * w_f
    out = post.to(dtype).unsqueeze(-1) * h.unsqueeze(-2) + torch.matmul(comb.to(dtype).transpose(-1, -2), residual)
    return out, (collapsed, post, comb)


def _fp64_pre(x, fn, base, scale, norm_eps=1e-5, hc_eps=1e-6, iters=20):
    """The mHC coefficient formula in FP64 (differentiable), written from its definition."""
    N = x.shape[-2]
    flat = x.flatten(-2)
    z = flat / torch.sqrt(flat.pow(2).mean(-1, keepdim=True) + norm_eps)
    logits = z @ fn.t()
    a_pre, a_post, a_comb = logits[..., :N], logits[..., N:2 * N], logits[..., 2 * N:].unflatten(-1, (N, N))
    pre = 1 / (1 + torch.exp(-(a_pre * scale[0] + base[:N]))) + hc_eps
    post = 2 / (1 + torch.exp(-(a_post * scale[1] + base[N:2 * N])))
    e = torch.exp(a_comb * scale[2] + base[2 * N:].view(N, N))
    m = e / e.sum(-1, keepdim=True) + hc_eps
    m = m / (m.sum(-2, keepdim=True) + hc_eps)
    for _ in range(iters - 1):
        m = m / (m.sum(-1, keepdim=True) + hc_eps)
        m = m / (m.sum(-2, keepdim=True) + hc_eps)
    mixed = torch.einsum("...s,...sd->...d", pre, x)
    return mixed, post, m


SHAPES = {"B2-S5-N4-D32": (2, 5, 4, 32), "B1-S7-N4-D60": (1, 7, 4, 60)}


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("shape", SHAPES.values(), ids=SHAPES.keys())
def test_bf16_precision_matches_transformers(shape, dtype):
    key = "fp32" if dtype == torch.float32 else "bf16"
    cfg, hc = _module(shape[-1], dtype)
    x = _streams(shape, dtype).requires_grad_(True)
    w_f = (1 + torch.randn(shape[-1])).to(dtype)
    out, coeffs = _ours(cfg, hc, x, w_f, "bf16")
    x_hf = x.detach().clone().requires_grad_(True)
    out_hf, coeffs_hf = _transformers(hc, x_hf, w_f)
    # same torch ops in the same order on the same CPU: the forward is bit-identical
    for name, a, e in zip(("mixed", "post", "comb", "out"), (*coeffs, out), (*coeffs_hf, out_hf)):
        assert a.dtype == e.dtype, f"{name} dtype {a.dtype} != transformers' {e.dtype}"
        assert torch.equal(a, e), f"{name} differs from transformers (relative L2 {rel_l2(a, e):.2e})"
    dy = torch.randn_like(out)
    grads = torch.autograd.grad(out, [x, *(getattr(hc, p) for p in PARAMS)], dy)
    grads_hf = torch.autograd.grad(out_hf, [x_hf, *(getattr(hc, p) for p in PARAMS)], dy)
    for name, a, e in zip(("dx", "dfn", "dbase", "dscale"), grads, grads_hf):
        assert a.dtype == e.dtype, f"{name} dtype {a.dtype} != transformers' {e.dtype}"
        assert_rel_l2(name, a, e, TOL[key]["hf_grad"])


@pytest.mark.parametrize("shape", SHAPES.values(), ids=SHAPES.keys())
def test_pre_matches_fp64_forward_and_vjp(shape):
    cfg, hc = _module(shape[-1], torch.float32)
    x = _streams(shape, torch.float32).requires_grad_(True)
    leaves = [x, hc.fn, hc.base, hc.scale]
    outs = ops.mhc_pre(*leaves)
    leaves64 = [t.detach().double().requires_grad_(True) for t in leaves]
    outs64 = _fp64_pre(*leaves64)
    for name, a, e in zip(("mixed", "post", "comb"), outs, outs64):
        assert_rel_l2(name, a, e.detach(), TOL["fp32"]["fp64_out"])
    cots = [torch.randn_like(o) for o in outs]
    grads = torch.autograd.grad(outs, leaves, cots)
    grads64 = torch.autograd.grad(outs64, leaves64, [c.double() for c in cots])
    for name, a, e in zip(("dx", "dfn", "dbase", "dscale"), grads, grads64):
        assert a.dtype == torch.float32, f"{name} dtype {a.dtype}"
        assert_rel_l2(name, a, e, TOL["fp32"]["fp64_grad"])
    comb = outs[2]
    assert_rel_l2("comb column sums", comb.sum(-2), torch.ones_like(comb.sum(-2)), 1e-5)


def test_post_fp32_rounds_once_and_beats_bf16():
    shape = SHAPES["B2-S5-N4-D32"]
    res = _streams(shape, torch.bfloat16)
    f = torch.randn(*shape[:-2], shape[-1]).to(torch.bfloat16)
    post = 2 * torch.rand(shape[:-1])
    comb = torch.softmax(torch.randn(*shape[:-1], shape[-2]), -1)
    exact = post.double()[..., None] * f.double()[..., None, :] + torch.einsum(
        "...so,...sd->...od", comb.double(), res.double())
    best = round_bf16(exact)
    out32 = ops.mhc_post(f, res, post, comb, precision="fp32")
    out16 = ops.mhc_post(f, res, post, comb, precision="bf16")
    err32 = assert_rel_l2("out (fp32)", out32, best, TOL["bf16"]["post_fp32"])
    miss32 = (out32.double() != best).double().mean().item()
    assert miss32 < 1e-3, f"out (fp32): {miss32:.2%} of the elements are not the correctly rounded value"
    err16 = rel_l2(out16, best)
    assert err16 > 3 * err32, f"out (bf16) error {err16:.2e} not above fp32's {err32:.2e}"


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_post_grads_match_fp64_vjp(precision):
    shape = SHAPES["B1-S7-N4-D60"]
    leaves = [torch.randn(*shape[:-2], shape[-1]), _streams(shape, torch.float32),
              2 * torch.rand(shape[:-1]), torch.softmax(torch.randn(*shape[:-1], shape[-2]), -1)]
    leaves = [t.to(torch.bfloat16) if i < 2 else t for i, t in enumerate(leaves)]
    leaves = [t.requires_grad_(True) for t in leaves]
    out = ops.mhc_post(*leaves, precision=precision)
    dy = torch.randn_like(out)
    grads = torch.autograd.grad(out, leaves, dy)
    l64 = [t.detach().double().requires_grad_(True) for t in leaves]
    out64 = l64[2][..., None] * l64[0][..., None, :] + torch.einsum("...so,...sd->...od", l64[3], l64[1])
    grads64 = torch.autograd.grad(out64, l64, dy.double())
    tol = TOL["bf16"]["post_grad"] * (1 if precision == "fp32" else 3)
    for name, leaf, a, e in zip(("df", "dresidual", "dpost", "dcomb"), leaves, grads, grads64):
        assert a.dtype == leaf.dtype, f"{name} dtype {a.dtype} != {leaf.dtype}"
        assert_rel_l2(f"{name} ({precision})", a, e.to(leaf.dtype).double(), tol)


def test_bad_inputs_raise():
    cfg, hc = _module(32, torch.float32)
    x = _streams((2, 3, 4, 32), torch.float32)
    with pytest.raises(ValueError, match=r"fn must be \[\(2\+N\)\*N, N\*D\]"):
        ops.mhc_pre(x[..., :16], hc.fn, hc.base, hc.scale)
    with pytest.raises(ValueError, match="scale must be"):
        ops.mhc_pre(x, hc.fn, hc.base, hc.scale[:2])
    with pytest.raises(ValueError, match="sinkhorn_iters must be an int >= 1"):
        ops.mhc_pre(x, hc.fn, hc.base, hc.scale, sinkhorn_iters=0)
    with pytest.raises(ValueError, match="x must be"):
        ops.mhc_pre(x.int(), hc.fn, hc.base, hc.scale)
    post, comb = torch.rand(2, 3, 4), torch.rand(2, 3, 4, 4)
    with pytest.raises(ValueError, match="precision must be one of"):
        ops.mhc_post(x[..., 0, :], x, post, comb, precision="fp16")
    with pytest.raises(ValueError, match="comb must be"):
        ops.mhc_post(x[..., 0, :], x, post, comb[..., :3], precision="fp32")
    with pytest.raises(ValueError, match="share a dtype"):
        ops.mhc_post(x[..., 0, :].bfloat16(), x, post, comb, precision="fp32")
    with pytest.raises(ValueError, match="one device"):
        ops.mhc_post(x[..., 0, :], x, post.to("meta"), comb, precision="fp32")


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
def test_opcheck(dtype):
    cfg, hc = _module(32, dtype)
    x = _streams((2, 3, 4, 32), dtype).requires_grad_(True)
    args = (x, hc.fn, hc.base, hc.scale, 1e-5, 1e-6, 20)
    torch.library.opcheck(torch.ops.glm53.mhc_pre, args)
    mixed, post, comb = (t.detach().requires_grad_(True) for t in torch.ops.glm53.mhc_pre(*args))
    for precision in ("bf16", "fp32"):
        torch.library.opcheck(torch.ops.glm53.mhc_post, (mixed, x, post, comb, precision))


@pytest.mark.parametrize("precision", ["bf16", "fp32"])
def test_compile_layer_forward_backward_one_graph(precision):
    torch._dynamo.reset()
    cfg, hc = _module(32, torch.bfloat16)
    w_f = torch.randn(32).to(torch.bfloat16)

    def loss(x, fn, base, scale):
        mixed, post, comb = ops.mhc_pre(x, fn, base, scale)
        out = ops.mhc_post(torch.tanh(mixed) * w_f, x, post, comb, precision=precision)
        return out.float().square().mean()

    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(loss, backend=counter, fullgraph=True)
    leaves = [_streams((2, 5, 4, 32), torch.bfloat16).requires_grad_(True), hc.fn, hc.base, hc.scale]
    got = torch.autograd.grad(compiled(*leaves), leaves)
    expected = torch.autograd.grad(loss(*leaves), leaves)
    for name, a, e in zip(("dx", "dfn", "dbase", "dscale"), got, expected):
        torch.testing.assert_close(a, e, rtol=0, atol=0, msg=lambda m, n=name: f"{n} (compiled {precision}): {m}")
    assert counter.frame_count == 1, f"expected one graph, got {counter.frame_count}"
    torch._dynamo.reset()
