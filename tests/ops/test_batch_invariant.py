"""glm53::bi_* (batch_invariant family) on CPU: batch invariance, accuracy against FP64, gradients
against the FP64 VJP, opcheck, bad input, one compiled graph, and a planted batch-variant linear
that the invariance checker must reject; for ``bi_grouped_linear`` (MoE experts) every row of a
grouped call, whatever the group sizes (empty groups included), bitwise the row alone through
``bi_linear``, and each group's dweight bitwise bi_linear's dweight of that group's rows alone.

Invariance: rows 0..63 computed alone (one row per call) must equal, bitwise, the same rows of
calls with M = 1..64 rows and of a shuffled 4096-row call (``tests/support/batch_invariant.py``).
Accuracy (DESIGN §6): a BF16 output is within 2x the BF16 rounding floor of the FP64 result
(relative L2); FP32 outputs within ``TOL_FP32``.
"""

import numpy as np
import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend

from inductor_ext.ops import batch_invariant as bi
from inductor_ext.ops import batch_invariant_reference as ref
from tests.support.batch_invariant import (
    check_batch_invariance,
    grouped_case,
    grouped_linear_fp64,
    layer_norm_fp64,
    linear_fp64,
    log_softmax_fp64,
    planted_linear,
    rel_l2,
    rms_norm_fp64,
    rounding_floor,
)

BF16, FP32 = torch.bfloat16, torch.float32
TOL_FP32 = 2e-6  # relative L2 of FP32 outputs and of FP32 gradients against FP64
FLOOR_FACTOR = 2.0  # BF16 outputs: at most this times the BF16 rounding floor
GRAD_FLOOR_FACTOR = 2.0  # BF16 gradients, the same rule
K, N, D, V = 150, 40, 1100, 1100  # K, D, V not multiples of their blocks (64, 1024): tails are exercised


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """One intra-op thread: the reference kernels are elementwise torch ops, so threads change no
    result (test_invariance_with_all_threads), but the invariance checks make ~130 tiny calls per
    case and two OpenMP threads on a shared 2-core machine stall at every barrier."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _randn(*shape, dtype=FP32, scale=1.0, seed=0):
    return (torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale).to(dtype)


# (name, rows-in -> rows-out, inputs with the row on dim 0)
def _invariance_cases():
    w_bf, w_32 = _randn(N, K, dtype=BF16, scale=K**-0.5, seed=1), _randn(N, K, scale=K**-0.5, seed=1)
    b = _randn(N, seed=2)
    g_bf, g_32 = _randn(D, dtype=BF16, seed=3) + 1, _randn(D, seed=3) + 1
    ln_b = _randn(D, seed=4)
    return [
        ("linear-bf16", lambda x: bi.bi_linear(x, w_bf, b), _randn(64, K, dtype=BF16)),
        ("linear-bf16-to-fp32", lambda x: bi.bi_linear(x, w_bf, b, out_dtype=FP32), _randn(64, K, dtype=BF16)),
        ("linear-fp32", lambda x: bi.bi_linear(x, w_32), _randn(64, K)),
        ("rms_norm-bf16", lambda x: bi.bi_rms_norm(x, g_bf), _randn(64, D, dtype=BF16)),
        ("rms_norm-fp32", lambda x: bi.bi_rms_norm(x, g_32), _randn(64, D)),
        ("layer_norm-bf16", lambda x: bi.bi_layer_norm(x, g_bf, ln_b), _randn(64, D, dtype=BF16, scale=3) + 1),
        ("layer_norm-fp32", lambda x: bi.bi_layer_norm(x, None, None), _randn(64, D, scale=3) + 1),
        ("log_softmax-fp32", bi.bi_log_softmax, _randn(64, V, scale=4)),
        ("log_softmax-bf16", bi.bi_log_softmax, _randn(64, V, dtype=BF16, scale=4)),
        ("row_sum-fp32", bi.bi_row_sum, _randn(64, V)),
    ]


INVARIANCE = _invariance_cases()


@pytest.mark.parametrize("case", INVARIANCE, ids=[c[0] for c in INVARIANCE])
def test_rows_are_batch_invariant(case):
    name, fn, x = case
    failures = check_batch_invariance(fn, x)
    assert not failures, f"{name}: " + "; ".join(failures)


def test_invariance_with_all_threads():
    name, fn, x = INVARIANCE[0]
    threads = torch.get_num_threads()
    torch.set_num_threads(max(2, torch.get_num_threads()))
    try:
        one = fn(x)
        failures = check_batch_invariance(fn, x, sizes=[1, 7, 64], big=512)
    finally:
        torch.set_num_threads(threads)
    assert not failures, f"{name}, {torch.get_num_threads()} threads: " + "; ".join(failures)
    assert torch.equal(one, fn(x)), f"{name}: one thread and several differ"


def test_norm_backward_dx_is_batch_invariant():
    """dx rows of bi_rms_norm (given each row's dy) do not depend on the other rows (its row
    statistics run through bi_row_sum)."""
    g = _randn(D, dtype=BF16, seed=3) + 1

    def dx_rms(x, dy):
        x = x.clone().requires_grad_(True)
        return torch.autograd.grad(bi.bi_rms_norm(x, g), x, dy)[0]

    inputs = (_randn(64, D, dtype=BF16), _randn(64, D, dtype=BF16, seed=5))
    failures = check_batch_invariance(dx_rms, inputs, sizes=[1, 2, 3, 17, 33, 64], big=512)
    assert not failures, "drms_norm/dx: " + "; ".join(failures)


@pytest.mark.parametrize("x_dtype", [BF16, FP32], ids=["bf16", "fp32-x"])
def test_linear_backward_gemms_are_torch_matmul(x_dtype):
    """dx and dweight of bi_linear are torch.matmul of the same operands (in FP32 when a dtype differs),
    bitwise, so the backward costs the device's GEMM; dbias is bi_row_sum's: rows with dy = 0
    appended to the batch leave it bitwise unchanged."""
    n = 300  # dx reduces over n, dweight over the 70 rows: several 64-long blocks each
    x, w, b = _randn(70, K, dtype=x_dtype), _randn(n, K, dtype=BF16, seed=1), _randn(n, seed=2)
    leaves = [t.clone().requires_grad_(True) for t in (x, w, b)]
    dy = _randn(70, n, dtype=BF16, seed=5)
    dx, dw, db = torch.autograd.grad(bi.bi_linear(*leaves, out_dtype=BF16), leaves, dy)
    compute = BF16 if x_dtype == BF16 else FP32  # dx in FP32 for an FP32 x; dweight: x's dtype differs
    assert torch.equal(dx, (dy.to(compute) @ w.to(compute)).to(x_dtype)), "dx is not torch.matmul's"
    assert torch.equal(dw, (dy.to(compute).t() @ x.to(compute)).to(BF16)), "dweight is not torch.matmul's"
    x_pad = torch.cat([x, _randn(130, K, dtype=x_dtype, seed=6)]).requires_grad_(True)
    dy_pad = torch.cat([dy, torch.zeros(130, n, dtype=BF16)])
    db_pad = torch.autograd.grad(bi.bi_linear(x_pad, leaves[1], leaves[2], out_dtype=BF16), leaves[2], dy_pad)[0]
    assert torch.equal(db_pad, db), "dbias changed when zero-gradient rows were appended"


# ---------------------------------------------------------------------------------------------
# the planted failure
# ---------------------------------------------------------------------------------------------


def test_checker_rejects_a_planted_batch_variant_linear():
    x, w = _randn(64, K), _randn(N, K, scale=K**-0.5, seed=1)
    assert rel_l2(planted_linear(x, w), linear_fp64(x, w)) <= TOL_FP32, "the planted variant is a correct matmul"
    failures = check_batch_invariance(lambda rows: planted_linear(rows, w), x, big=0)
    assert failures, "the checker accepted a linear whose K block is chosen from the row count"
    assert all(f.startswith("M=") for f in failures)
    assert all(int(f.split(":")[0][2:]) >= 32 for f in failures), f"only M >= 32 changes the order: {failures}"
    assert not check_batch_invariance(lambda rows: bi.bi_linear(rows, w), x, big=0), "bi_linear must pass"


# ---------------------------------------------------------------------------------------------
# accuracy against FP64
# ---------------------------------------------------------------------------------------------


def _assert_close_to_fp64(name, out, ref64):
    err = rel_l2(out, ref64)
    if out.dtype == FP32:
        assert err <= TOL_FP32, f"{name}: relative L2 {err:.2e} > {TOL_FP32:.0e}"
    else:
        floor = rounding_floor(ref64, out.dtype)
        assert err <= FLOOR_FACTOR * floor, f"{name}: relative L2 {err:.2e} > {FLOOR_FACTOR} x floor {floor:.2e}"


@pytest.mark.parametrize("dtype", [BF16, FP32], ids=["bf16", "fp32"])
def test_forward_matches_fp64(dtype):
    x, w, b = _randn(3, 37, K, dtype=dtype), _randn(N, K, dtype=dtype, scale=K**-0.5, seed=1), _randn(N, seed=2)
    _assert_close_to_fp64("linear", bi.bi_linear(x, w, b), linear_fp64(x, w, b))
    _assert_close_to_fp64("linear->fp32", bi.bi_linear(x, w, b, out_dtype=FP32), linear_fp64(x, w, b))
    xn, g, beta = _randn(3, 37, D, dtype=dtype, scale=3) + 1, _randn(D, dtype=dtype, seed=3) + 1, _randn(D, seed=4)
    _assert_close_to_fp64("rms_norm", bi.bi_rms_norm(xn, g, 1e-6), rms_norm_fp64(xn, g, 1e-6))
    _assert_close_to_fp64("layer_norm", bi.bi_layer_norm(xn, g, beta, 1e-5), layer_norm_fp64(xn, g, beta, 1e-5))
    xl = _randn(3, 37, V, dtype=dtype, scale=4)
    out = bi.bi_log_softmax(xl)
    assert out.dtype == FP32
    _assert_close_to_fp64("log_softmax", out, log_softmax_fp64(xl))
    _assert_close_to_fp64("row_sum", bi.bi_row_sum(xl), xl.double().sum(-1))


def test_output_dtypes_follow_the_model():
    x = _randn(4, 16, dtype=BF16)
    assert bi.bi_rms_norm(x, torch.ones(16, dtype=BF16)).dtype == BF16
    assert bi.bi_rms_norm(x, torch.ones(16)).dtype == FP32  # weight FP32: torch promotes weight * x̂
    assert bi.bi_layer_norm(x, torch.ones(16), torch.zeros(16)).dtype == BF16
    assert bi.bi_linear(x, torch.ones(3, 16)).dtype == BF16
    assert bi.bi_row_sum(x).dtype == FP32 and bi.bi_log_softmax(x).dtype == FP32


def test_rms_norm_equals_the_model_within_one_rounding():
    """Against graphs' RMSNorm formula (x * rsqrt): the same result up to the last bit of x̂ (the
    op divides by sqrt, the model multiplies by rsqrt)."""
    x, g = _randn(64, D, dtype=BF16, scale=2), _randn(D, dtype=BF16, seed=3) + 1
    xf = x.float()
    model = g * (xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + 1e-6)).to(BF16)
    got = bi.bi_rms_norm(x, g, 1e-6)
    ulps = (got.float() - model.float()).abs() / model.float().abs().clamp_min(1e-30)
    assert (ulps <= 2.0**-7).all(), f"max relative difference {ulps.max().item():.2e} > one BF16 ulp"


# ---------------------------------------------------------------------------------------------
# gradients against the FP64 VJP
# ---------------------------------------------------------------------------------------------


def _grad_case(op, dtype):
    if op == "linear":
        leaves = [_randn(2, 19, K, dtype=dtype), _randn(N, K, dtype=dtype, scale=K**-0.5, seed=1), _randn(N, seed=2)]
        return leaves, bi.bi_linear, linear_fp64
    if op == "rms_norm":
        leaves = [_randn(2, 19, D, dtype=dtype, scale=2), _randn(D, dtype=dtype, seed=3) + 1]
        return leaves, lambda x, g: bi.bi_rms_norm(x, g, 1e-6), lambda x, g: rms_norm_fp64(x, g, 1e-6)
    if op == "layer_norm":
        leaves = [_randn(2, 19, D, dtype=dtype, scale=2) + 1, _randn(D, dtype=dtype, seed=3) + 1, _randn(D, seed=4)]
        return leaves, lambda *a: bi.bi_layer_norm(*a, 1e-5), lambda *a: layer_norm_fp64(*a, 1e-5)
    leaves = [_randn(2, 19, V, dtype=dtype, scale=4)]
    return leaves, bi.bi_log_softmax, log_softmax_fp64


@pytest.mark.parametrize("dtype", [BF16, FP32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("op", ["linear", "rms_norm", "layer_norm", "log_softmax"])
def test_grads_match_fp64_vjp(op, dtype):
    leaves, fn, fn64 = _grad_case(op, dtype)
    leaves = [t.requires_grad_(True) for t in leaves]
    y = fn(*leaves)
    dy = _randn(*y.shape, dtype=y.dtype, seed=9)
    grads = torch.autograd.grad(y, leaves, dy)
    leaves64 = [t.detach().double().requires_grad_(True) for t in leaves]
    grads64 = torch.autograd.grad(fn64(*leaves64), leaves64, dy.double())
    for i, (g, g64, leaf) in enumerate(zip(grads, grads64, leaves)):
        assert g.dtype == leaf.dtype, f"{op} grad {i}: dtype {g.dtype} != {leaf.dtype}"
        err = rel_l2(g, g64)
        tol = TOL_FP32 * 5 if g.dtype == FP32 else GRAD_FLOOR_FACTOR * rounding_floor(g64, g.dtype)
        assert err <= tol, f"{op} grad {i} ({g.dtype}): relative L2 {err:.2e} > {tol:.2e}"


# ---------------------------------------------------------------------------------------------
# opcheck, bad input, compile
# ---------------------------------------------------------------------------------------------


def test_opcheck():
    x = _randn(3, 5, 70, dtype=BF16).requires_grad_(True)
    w = _randn(9, 70, dtype=BF16, seed=1).requires_grad_(True)
    b = _randn(9, seed=2).requires_grad_(True)
    g = (_randn(70, seed=3) + 1).requires_grad_(True)
    for op, args in ((torch.ops.glm53.bi_linear, (x, w, b, FP32)), (torch.ops.glm53.bi_rms_norm, (x, g, 1e-6)),
                     (torch.ops.glm53.bi_layer_norm, (x, None, g, 1e-5)), (torch.ops.glm53.bi_log_softmax, (x,)),
                     (torch.ops.glm53.bi_row_sum, (x,))):
        torch.library.opcheck(op, args)


def test_bad_inputs_raise():
    x = torch.randn(4, 8)
    cases = [
        (lambda: bi.bi_linear(x, torch.randn(3, 9)), "weight must be"),
        (lambda: bi.bi_linear(x, torch.randn(3, 8), torch.randn(4)), "bias must be"),
        (lambda: bi.bi_linear(x.long(), torch.randn(3, 8)), "x must be bfloat16, float16 or float32"),
        (lambda: bi.bi_linear(x, torch.randn(3, 8), out_dtype=torch.float64), "out_dtype must be"),
        (lambda: bi.bi_linear(x, torch.randn(3, 8, device="meta")), "one device"),
        (lambda: bi.bi_linear(torch.randn(4, 0), torch.randn(3, 0)), "D >= 1"),
        (lambda: bi.bi_rms_norm(x, torch.randn(7)), "weight must be"),
        (lambda: bi.bi_rms_norm(x, torch.randn(8), eps=0.0), "eps must be"),
        (lambda: bi.bi_layer_norm(x, None, torch.randn(9)), "bias must be"),
        (lambda: bi.bi_layer_norm(x, eps=-1.0), "eps must be"),
        (lambda: bi.bi_log_softmax(torch.zeros(3, dtype=torch.int32)), "x must be bfloat16"),
        (lambda: bi.bi_row_sum(torch.randn(())), "D >= 1"),
    ]
    for call, match in cases:
        with pytest.raises(ValueError, match=match):
            call()


def test_compile_forward_backward_one_graph():
    torch._dynamo.reset()

    def loss(x, w, g):
        h = bi.bi_rms_norm(x, g)
        return bi.bi_log_softmax(bi.bi_linear(h, w, out_dtype=FP32))[..., 0].sum()

    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(loss, backend=counter, fullgraph=True)
    leaves = [_randn(2, 5, 64, dtype=BF16), _randn(40, 64, dtype=BF16, seed=1), _randn(64, dtype=BF16, seed=3) + 1]
    leaves = [t.requires_grad_(True) for t in leaves]
    got = torch.autograd.grad(compiled(*leaves), leaves)
    expected = torch.autograd.grad(loss(*leaves), leaves)
    for name, a, e in zip(("dx", "dweight", "dgamma"), got, expected):
        assert torch.equal(a, e), f"{name} (compiled) differs from eager"
    assert counter.frame_count == 1, f"expected one graph, got {counter.frame_count}"
    torch._dynamo.reset()


def test_constants():
    assert ref.BLOCK_K == 64 and ref.ROW_BLOCK & (ref.ROW_BLOCK - 1) == 0


def test_sqrt_rn_is_ieee():
    """torch's FP32 sqrt on CPU is not correctly rounded; the reference's sqrt_rn (through FP64) is,
    as the Triton kernels' sqrt_rn is."""
    a = torch.rand(100_000, generator=torch.Generator().manual_seed(0)) * 100
    exact = torch.from_numpy(np.sqrt(a.numpy()))  # numpy's float32 sqrt: IEEE
    assert torch.equal(ref.sqrt_rn(a), exact)


# ---------------------------------------------------------------------------------------------
# bi_grouped_linear (MoE experts)
# ---------------------------------------------------------------------------------------------

E_GROUPS = 5
PROBE_GROUPS = (0, 0, 1, 3, 3, 3, 4, 1, 0, 4, 3, 1)  # group 2 never holds a probe (often empty)
# group sizes of the grouped calls around the probes (>= the probes of each group): empty groups,
# one-row groups, a large call; the last case has 7 rows past the last offset (zeros)
GROUP_COUNTS = [((3, 3, 0, 4, 2), 0), ((3, 3, 1, 4, 2), 0), ((9, 3, 0, 40, 2), 0), ((3, 70, 5, 4, 130), 0),
                ((200, 3, 0, 300, 90), 7)]


def _grouped_weights(dtype, seed=1):
    return _randn(E_GROUPS, N, K, dtype=dtype, scale=K**-0.5, seed=seed)


@pytest.mark.parametrize("xd,wd", [(BF16, BF16), (FP32, FP32), (BF16, FP32)], ids=["bf16", "fp32", "x-bf16-w-fp32"])
def test_grouped_rows_equal_rows_alone(xd, wd):
    """Every probe row inside grouped calls of many group sizes (empty groups, a row-less tail) is
    bitwise bi_linear of that row alone against its group's weight; rows past the last offset are 0."""
    w = _grouped_weights(wd)
    probes = _randn(len(PROBE_GROUPS), K, dtype=xd, seed=7)
    alone = torch.cat([bi.bi_linear(probes[i:i + 1], w[e]) for i, e in enumerate(PROBE_GROUPS)])
    g = torch.Generator().manual_seed(0)
    for counts, tail in GROUP_COUNTS:
        x, offs, where = grouped_case(probes, PROBE_GROUPS, counts, generator=g, tail=tail)
        y = bi.bi_grouped_linear(x, w, offs)
        assert y.dtype == xd and y.shape == (x.shape[0], N)
        bad = (y[where] != alone).any(1).nonzero().flatten().tolist()
        assert not bad, f"counts {counts}: probe rows {bad} differ from the rows computed alone"
        assert (y[offs[-1]:] == 0).all() and not torch.signbit(y[offs[-1]:]).any(), "rows past the last offset"


def test_grouped_backward_equals_bi_linear_per_group():
    """dx rows are ``bi_linear(dy row, weight[e]ᵀ)``; dweight[e] is bitwise ``bi_linear(dyᵀ, xᵀ)`` of
    group e's rows alone (its fixed 64-row blocks from the group's first row); an empty group's
    dweight is an exact 0."""
    w = _grouped_weights(BF16).requires_grad_(True)
    counts = (70, 0, 1, 130, 9)
    offs = torch.tensor(counts).cumsum(0).to(torch.int32)
    x = _randn(sum(counts), K, dtype=BF16, seed=7).requires_grad_(True)
    dy = _randn(sum(counts), N, dtype=BF16, seed=8)
    dx, dw = torch.autograd.grad(bi.bi_grouped_linear(x, w, offs), (x, w), dy)
    assert dx.dtype == BF16 and dw.dtype == BF16 and dw.shape == w.shape
    ends = [0, *offs.tolist()]
    for e, (lo, hi) in enumerate(zip(ends, ends[1:])):
        if hi == lo:
            assert torch.equal(dw[e], torch.zeros_like(dw[e])) and not torch.signbit(dw[e]).any()
            continue
        xe, we, dye = x[lo:hi].detach(), w[e].detach(), dy[lo:hi]
        assert torch.equal(dx[lo:hi], bi.bi_linear(dye, we.t())), f"group {e}: dx differs from bi_linear(dy, wᵀ)"
        assert torch.equal(dw[e], bi.bi_linear(dye.t(), xe.t())), f"group {e}: dweight differs from bi_linear(dyᵀ, xᵀ)"


def test_grouped_backward_runs_grouped_mm_where_it_fits():
    """BF16 with N and K multiples of 8: dx and dweight are torch._grouped_mm's of the same operands
    (bitwise), close to the FP64 VJP; rows past the last offset get dx = 0, an empty group dweight = 0."""
    n, k, counts, tail = 96, 160, (140, 0, 23, 1, 75), 5  # reductions longer than one 64-block
    offs = torch.tensor(counts).cumsum(0).to(torch.int32)
    x = _randn(sum(counts) + tail, k, dtype=BF16, seed=7).requires_grad_(True)
    w = _randn(E_GROUPS, n, k, dtype=BF16, scale=k**-0.5, seed=1).requires_grad_(True)
    dy = _randn(x.shape[0], n, dtype=BF16, seed=9)
    dx, dw = torch.autograd.grad(bi.bi_grouped_linear(x, w, offs), (x, w), dy)
    end = offs[-1].item()
    assert torch.equal(dx[:end], torch._grouped_mm(dy, w.detach(), offs=offs)[:end]), "dx is not _grouped_mm's"
    assert torch.equal(dw, torch._grouped_mm(dy.t(), x.detach(), offs=offs)), "dweight is not _grouped_mm's"
    assert torch.equal(dx[end:], torch.zeros_like(dx[end:])), "rows past the last offset: dx = 0"
    assert torch.equal(dw[1], torch.zeros_like(dw[1])), "the empty group's dweight must be 0"
    leaves64 = [t.detach().double().requires_grad_(True) for t in (x, w)]
    grads64 = torch.autograd.grad(grouped_linear_fp64(*leaves64, offs), leaves64, dy.double())
    for name, g, g64 in zip(("dx", "dweight"), (dx, dw), grads64):
        err, tol = rel_l2(g, g64), GRAD_FLOOR_FACTOR * rounding_floor(g64, BF16)
        assert err <= tol, f"grouped {name}: relative L2 {err:.2e} > {tol:.2e}"


@pytest.mark.parametrize("dtype", [BF16, FP32], ids=["bf16", "fp32"])
def test_grouped_forward_and_grads_match_fp64(dtype):
    counts, tail = (40, 0, 23, 1, 61), 5
    offs = torch.tensor(counts).cumsum(0).to(torch.int32)
    x = _randn(sum(counts) + tail, K, dtype=dtype, seed=7).requires_grad_(True)
    w = _grouped_weights(dtype).requires_grad_(True)
    y = bi.bi_grouped_linear(x, w, offs)
    ref64 = grouped_linear_fp64(x.detach(), w.detach(), offs)
    _assert_close_to_fp64("grouped_linear", y, ref64)
    dy = _randn(*y.shape, dtype=dtype, seed=9)
    grads = torch.autograd.grad(y, (x, w), dy)
    leaves64 = [t.detach().double().requires_grad_(True) for t in (x, w)]
    grads64 = torch.autograd.grad(grouped_linear_fp64(*leaves64, offs), leaves64, dy.double())
    for name, g, g64 in zip(("dx", "dweight"), grads, grads64):
        assert g.dtype == dtype
        err = rel_l2(g, g64)
        tol = TOL_FP32 * 5 if dtype == FP32 else GRAD_FLOOR_FACTOR * rounding_floor(g64, dtype)
        assert err <= tol, f"grouped {name} ({dtype}): relative L2 {err:.2e} > {tol:.2e}"
    assert torch.equal(grads[1][1], torch.zeros_like(grads[1][1])), "the empty group's dweight must be 0"
    assert torch.equal(grads[0][-tail:], torch.zeros_like(grads[0][-tail:])), "rows past the last offset: dx = 0"


def test_grouped_opcheck():
    offs = torch.tensor([3, 3, 9, 14], dtype=torch.int32)
    x = _randn(16, 70, dtype=BF16).requires_grad_(True)
    w = _randn(4, 9, 70, dtype=BF16, seed=1).requires_grad_(True)
    torch.library.opcheck(torch.ops.glm53.bi_grouped_linear, (x, w, offs))
    torch.library.opcheck(torch.ops.glm53.bi_grouped_linear, (x.detach().float(), w.detach(), offs))
    torch.library.opcheck(torch.ops.glm53.bi_grouped_linear_wgrad, (_randn(16, 9, dtype=BF16), x.detach(), offs, FP32))


def test_grouped_bad_inputs_raise():
    x, w, offs = torch.randn(6, 8), torch.randn(3, 4, 8), torch.tensor([2, 2, 6], dtype=torch.int32)
    cases = [
        (lambda: bi.bi_grouped_linear(x[None], w, offs), "x must be \\[M, K\\]"),
        (lambda: bi.bi_grouped_linear(torch.randn(6, 0), torch.randn(3, 4, 0), offs), "K >= 1"),
        (lambda: bi.bi_grouped_linear(x, w[0], offs), "weight must be \\[E >= 1"),
        (lambda: bi.bi_grouped_linear(x, torch.randn(3, 4, 9), offs), "K=8"),
        (lambda: bi.bi_grouped_linear(x, torch.randn(0, 4, 8), offs[:0]), "E >= 1"),
        (lambda: bi.bi_grouped_linear(x.long(), w, offs), "x must be bfloat16"),
        (lambda: bi.bi_grouped_linear(x, w.double(), offs), "weight must be bfloat16"),
        (lambda: bi.bi_grouped_linear(x, w, offs.long()), "offs must be int32"),
        (lambda: bi.bi_grouped_linear(x, w, offs.tolist()), "offs must be a tensor"),
        (lambda: bi.bi_grouped_linear(x, w, offs[:2]), "offs must be \\[E=3\\]"),
        (lambda: bi.bi_grouped_linear(x, w, offs[None]), "offs must be \\[E=3\\]"),
        (lambda: bi.bi_grouped_linear(x, w, offs.to("meta")), "one device"),
        (lambda: bi.bi_grouped_linear(x, w, torch.tensor([2, 1, 6], dtype=torch.int32)), "non-decreasing"),
        (lambda: bi.bi_grouped_linear(x, w, torch.tensor([2, 2, 7], dtype=torch.int32)), "non-decreasing"),
        (lambda: bi.bi_grouped_linear(x, w, torch.tensor([-1, 2, 6], dtype=torch.int32)), "non-decreasing"),
    ]
    for call, match in cases:
        with pytest.raises(ValueError, match=match):
            call()


def test_grouped_compile_one_graph():
    """The Experts routing (offs by searchsorted, in the graph) and both projections through
    bi_grouped_linear: one graph under fullgraph, forward and gradients bitwise eager."""
    torch._dynamo.reset()

    def experts(x, indices, w1, w2):
        sorted_ids, order = torch.sort(indices.reshape(-1), stable=True)
        bounds = torch.arange(1, w1.shape[0] + 1, dtype=sorted_ids.dtype)
        offs = torch.searchsorted(sorted_ids, bounds).to(torch.int32)
        xs = x[:, None, :].expand(*indices.shape, x.shape[-1]).reshape(-1, x.shape[-1])[order]
        h = bi.bi_grouped_linear(xs, w1, offs)
        return bi.bi_grouped_linear(torch.relu(h), w2, offs).float().square().sum()

    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(experts, backend=counter, fullgraph=True)
    indices = torch.tensor([[0, 3], [3, 1], [0, 3], [1, 0], [3, 0]])  # expert 2 unused: an empty group
    leaves = [_randn(5, 64, dtype=BF16), _randn(4, 32, 64, dtype=BF16, seed=1), _randn(4, 64, 32, dtype=BF16, seed=2)]
    leaves = [t.requires_grad_(True) for t in leaves]
    got_loss = compiled(leaves[0], indices, *leaves[1:])
    got = torch.autograd.grad(got_loss, leaves)
    want_loss = experts(leaves[0], indices, *leaves[1:])
    expected = torch.autograd.grad(want_loss, leaves)
    assert torch.equal(got_loss, want_loss), "compiled forward differs from eager"
    for name, a, e in zip(("dx", "dw1", "dw2"), got, expected):
        assert torch.equal(a, e), f"{name} (compiled) differs from eager"
    assert torch.equal(got[1][2], torch.zeros_like(got[1][2])), "unused expert: exact zero gradient"
    assert counter.frame_count == 1, f"expected one graph, got {counter.frame_count}"
    torch._dynamo.reset()
