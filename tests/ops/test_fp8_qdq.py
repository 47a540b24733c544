"""glm53::fp8_qdq on CPU against an FP64 quantizer written from the formula, bit for bit.

The reference rounds to e4m3 itself (round half to even, 3 mantissa bits, subnormal step 2^-9) and
takes ceil(log2(·)) from frexp, so it shares nothing with the op or with torch's float8 cast.
FP64 reproduces each FP32 step of the contract exactly: a division or product rounded from FP64 to
FP32 equals the FP32 operation (FP64 carries more than 2·24 + 2 bits).
"""

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend

from inductor_ext import ops

FMTS = ("ue8m0", "fp32")
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def _pow2_ceil(r):
    m, e = torch.frexp(r)  # r = m · 2^e, m in [0.5, 1)
    return torch.where(m == 0.5, e - 1, e).double().exp2()


def _round_e4m3(v):
    """Round FP64 values with |v| <= 448 to the nearest e4m3fn value (ties to even)."""
    _, e = torch.frexp(v.abs())
    ulp = torch.where(v.abs() < 2.0 ** -6, torch.full_like(v, 2.0 ** -9), (e - 4).double().exp2())
    return torch.round(v / ulp) * ulp


def reference(x, scale_fmt):
    """(â, s) of the contract in FP64: â in x's dtype, s FP32 [..., D/128]."""
    a = x.double().unflatten(-1, (-1, 128))
    amax = a.abs().amax(-1, keepdim=True).clamp_min(torch.tensor(1e-6, dtype=torch.float32).item())
    ratio = (amax / 448).float().double()  # the FP32 division
    s = _pow2_ceil(ratio) if scale_fmt == "ue8m0" else ratio
    q = _round_e4m3((a / s).float().double().clamp(-448, 448))
    out = (q * s).float().to(x.dtype).flatten(-2)
    return out, s.squeeze(-1).float()


def _make(dtype, shape=(5, 3, 256)):
    x = torch.randn(shape) * torch.logspace(-3, 3, shape[-1] // 128).repeat_interleave(128)
    flat = x.view(-1, 128)
    flat[0] = 0.0  # amax below the 1e-6 floor
    flat[1, :4] = torch.tensor([56.0, -3.0, 1e-5, 2.0 ** -12])  # amax/448 = 2^-3 exactly
    flat[1, 4:] = 0.5
    flat[2].clamp_(-0.4, 0.4)  # amax/448 one FP32 ulp above 2^-10: torch.log2 rounds onto -10
    flat[2, 7] = torch.nextafter(torch.tensor(0.4375), torch.tensor(1.0))
    flat[3] *= 1e4  # large group
    return x.to(dtype)


def assert_bitwise(name, actual, expected):
    if actual.dtype != expected.dtype or actual.shape != expected.shape:
        raise AssertionError(f"{name}: {actual.dtype}{tuple(actual.shape)} != {expected.dtype}{tuple(expected.shape)}")
    bad = (actual != expected) & ~(actual.isnan() & expected.isnan())
    if bad.any():
        raise AssertionError(f"{name}: {int(bad.sum())} of {bad.numel()} elements differ from the reference")


@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
def test_matches_fp64_reference_bitwise(dtype, fmt):
    x = _make(dtype)
    out, s = ops.fp8_qdq(x, scale_fmt=fmt, return_scale=True)
    ref_out, ref_s = reference(x, fmt)
    assert_bitwise("scale", s, ref_s)
    assert_bitwise("x_qdq", out, ref_out)
    assert torch.equal(ops.fp8_qdq(x, scale_fmt=fmt), out), "x_qdq without return_scale"


def test_ue8m0_scale_is_a_power_of_two_and_ceil_is_exact():
    x = _make(torch.float32)
    _, s = ops.fp8_qdq(x, scale_fmt="ue8m0", return_scale=True)
    mantissa, _ = torch.frexp(s)
    assert (mantissa == 0.5).all(), f"scale: not powers of two: {s[mantissa != 0.5][:5].tolist()}"
    flat = s.view(-1)
    assert flat[1] == 2.0 ** -3, f"scale (amax/448 = 2^-3 exactly): {flat[1].item()}"
    assert flat[2] == 2.0 ** -9, f"scale (amax/448 one ulp above 2^-10): {flat[2].item()}"
    assert flat[0] == 2.0 ** -28, f"scale (amax floored at 1e-6): {flat[0].item()}"


def test_planted_wrong_scale_fails_the_checks():
    x = _make(torch.bfloat16)
    out, s = ops.fp8_qdq(x, scale_fmt="ue8m0", return_scale=True)
    ref_out, ref_s = reference(x, "ue8m0")
    # a reference built with the scale doubled (floor-vs-ceil off by one) must not pass
    a = x.double().unflatten(-1, (-1, 128))
    planted = _round_e4m3((a / (2 * ref_s.double()[..., None])).clamp(-448, 448)) * 2 * ref_s.double()[..., None]
    with pytest.raises(AssertionError, match="x_qdq: .* differ"):
        assert_bitwise("x_qdq", out, planted.float().to(x.dtype).flatten(-2))
    with pytest.raises(AssertionError, match="scale: .* differ"):
        assert_bitwise("scale", s, ref_s * 2)
    # an FP32-style scale (amax/448) is not a power of two
    _, s_fp32 = ops.fp8_qdq(x, scale_fmt="fp32", return_scale=True)
    assert not (torch.frexp(s_fp32)[0] == 0.5).all(), "power-of-two check cannot see a wrong scale"


@pytest.mark.parametrize("fmt", FMTS)
def test_a_group_holding_inf_or_nan_comes_out_all_nan(fmt):
    """The contract for non-finite groups: scale inf (or NaN), every output of the group NaN; the
    other groups of the row are untouched."""
    x = torch.randn(2, 384)
    x[0, 5], x[1, 130] = float("inf"), float("nan")
    out, s = ops.fp8_qdq(x, scale_fmt=fmt, return_scale=True)
    assert s[0, 0] == float("inf") and s[1, 1].isnan(), f"scales of the non-finite groups: {s.tolist()}"
    assert out[0, :128].isnan().all() and out[1, 128:256].isnan().all(), "a non-finite group has finite outputs"
    finite = torch.ones_like(out, dtype=torch.bool)
    finite[0, :128] = finite[1, 128:256] = False
    assert out[finite].isfinite().all(), "a finite group was touched"


@pytest.mark.parametrize("fmt", FMTS)
def test_error_is_fp8_sized(fmt):
    # e4m3 keeps 3 mantissa bits: relative L2 error a few percent, never zero
    x = torch.randn(64, 512)
    out = ops.fp8_qdq(x, scale_fmt=fmt)
    err = ((out - x).norm() / x.norm()).item()
    assert 5e-3 < err < 5e-2, f"x_qdq ({fmt}): relative L2 {err:.3e} outside e4m3's range"


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
def test_backward_is_straight_through(dtype):
    x = _make(dtype).requires_grad_(True)
    out = ops.fp8_qdq(x)
    dy = torch.randn_like(out)
    (dx,) = torch.autograd.grad(out, x, dy)
    assert dx.dtype == dtype, f"dx dtype {dx.dtype} != {dtype}"
    assert torch.equal(dx, dy), "dx is not the straight-through identity"


def test_bad_inputs_raise():
    with pytest.raises(ValueError, match="divisible by the group size 128"):
        ops.fp8_qdq(torch.randn(4, 100))
    with pytest.raises(ValueError, match="divisible by the group size 128"):
        ops.fp8_qdq(torch.randn(()))
    with pytest.raises(ValueError, match="scale_fmt must be one of"):
        ops.fp8_qdq(torch.randn(4, 128), scale_fmt="e8m0")
    with pytest.raises(ValueError, match="x must be bfloat16"):
        ops.fp8_qdq(torch.zeros(4, 128, dtype=torch.int32))


@pytest.mark.parametrize("fmt", FMTS)
def test_opcheck(fmt):
    for dtype in DTYPES.values():
        x = _make(dtype, (3, 256)).requires_grad_(True)
        torch.library.opcheck(torch.ops.glm53.fp8_qdq, (x, fmt))


def test_compile_forward_backward_one_graph():
    torch._dynamo.reset()

    def loss(x):
        return (ops.fp8_qdq(x, scale_fmt="ue8m0").float() * torch.arange(x.shape[-1])).sum()

    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(loss, backend=counter, fullgraph=True)
    x = _make(torch.bfloat16).requires_grad_(True)
    value = compiled(x)
    (got,) = torch.autograd.grad(value, x)
    (expected,) = torch.autograd.grad(loss(x), x)
    torch.testing.assert_close(value, loss(x), rtol=0, atol=0, msg=lambda m: f"loss (compiled): {m}")
    torch.testing.assert_close(got, expected, rtol=0, atol=0, msg=lambda m: f"dx (compiled): {m}")
    assert counter.frame_count == 1, f"expected one graph, got {counter.frame_count}"
    torch._dynamo.reset()
