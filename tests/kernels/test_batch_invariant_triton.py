"""Triton kernels of the batch_invariant family against the CPU reference
(``inductor_ext.ops.batch_invariant_reference``) and the batch-invariance checker.

Without CUDA the kernels run on CPU tensors under Triton's interpreter, which Triton decides when it
is first imported, so this needs its own process: ``TRITON_INTERPRET=1 pytest
tests/kernels/test_batch_invariant_triton.py`` (otherwise those tests skip and say so). Two
interpreter fixes apply inside each test (``tests.support.batch_invariant.interpreter_numerics``):
RNE float casts always, and for the matmul's bitwise tests a row-position-independent ``tl.dot``
(products summed in ascending k, the reference's in-block order) in place of OpenBLAS.

Contracts checked under the interpreter: RMSNorm, LayerNorm and the row sum bitwise equal to the
reference (same lanes, same tree, IEEE sqrt/divide, no FMA in numpy); log-softmax within
``LSM_TOL`` (numpy's exp/log against torch's); the matmul bitwise with the ordered dot, within
``MM_TOL`` (FP32 output, relative L2) with numpy's own dot; every kernel batch-invariant; a planted
launch whose K block is chosen from M rejected. With CUDA the ``cuda``-marked tests run the compiled
kernels through the ``glm53::bi_*`` ops: bitwise invariance for M = 1..64 and inside a shuffled
4096-row call, the reference within the GPU tolerances ``GPU_TOL``, and CUDA-graph capture.
"""

import importlib
import os

import pytest
import torch

from inductor_ext.ops import batch_invariant_reference as ref
from tests.support.batch_invariant import assert_bitwise, check_batch_invariance, interpreter_numerics, rel_l2
from tests.support.triton_interpreter import apply_interpreter_shims

pytest.importorskip("triton")

BF16, FP32 = torch.bfloat16, torch.float32
LSM_TOL = {"rel_l2": 1e-6, "max_abs": 1e-5}  # numpy's exp/log vs torch's: a few FP32 ulps
MM_TOL = 1e-6  # numpy's BLAS dot (other in-block order) vs the reference, FP32 output, relative L2
# GPU vs the CPU reference (MMA order inside a K block; FMA contraction; approximate exp/log):
# relative L2 for FP32 outputs; 16-bit outputs at most 2 ulp apart (a 1-ulp change of RMSNorm's x̂
# moves weight · x̂ by up to 2)
GPU_TOL = {"fp32": 2e-6, "ulps16": 2, "far_fraction": 1e-4}
SMALL_TILES = (16, 16, 2, 4, 2)  # BLOCK_M, BLOCK_N, GROUP_M, warps, stages: several tiles at small M
# rows per call in the interpreter invariance checks: the matmul's cross 16-row tiles (probes 17),
# the row kernels' (one program per row, no M argument at all) fewer
SIZES = {"matmul": (1, 2, 3, 5, 8, 16, 17), "rows": (1, 2, 5, 8)}


def _randn(*shape, dtype=FP32, scale=1.0, seed=0):
    return (torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale).to(dtype)


# ---------------------------------------------------------------------------------------------
# interpreter (CPU)
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def kb():
    """The kernel package in interpreter mode (CPU tensors), one intra-op thread (the tests make
    many tiny calls; threads change no result)."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("interpreter tests: run `TRITON_INTERPRET=1 pytest tests/kernels/test_batch_invariant_triton.py` "
                    "(own process)")
    apply_interpreter_shims()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield importlib.import_module("inductor_ext.kernels.batch_invariant")
    torch.set_num_threads(threads)


@pytest.fixture
def small_lanes(monkeypatch):
    """64 lanes in the reference too, so short rows (D = 150) take several blocks and a tail."""
    monkeypatch.setattr(ref, "ROW_BLOCK", 64)
    return 64


@pytest.fixture
def small_tiles(monkeypatch):
    mm = importlib.import_module("inductor_ext.kernels.batch_invariant.matmul")
    for dtype in (BF16, torch.float16, FP32):
        monkeypatch.setitem(mm.CONFIGS, dtype, SMALL_TILES)


@pytest.mark.parametrize("xd,wd", [(BF16, BF16), (FP32, FP32), (BF16, FP32)], ids=["bf16", "fp32", "x-bf16-w-fp32"])
def test_rms_norm_bitwise(kb, small_lanes, xd, wd):
    x, w = _randn(9, 150, dtype=xd, scale=2), _randn(150, dtype=wd, seed=1) + 1
    with interpreter_numerics(ordered_dot=False):
        got = kb.bi_rms_norm_rows(x, w, 1e-6, ref.rms_norm_output_dtype(xd, wd), small_lanes)
    assert_bitwise("rms_norm", got, ref.bi_rms_norm_reference(x, w, 1e-6))


@pytest.mark.parametrize("affine", ["both", "weight", "none"])
def test_layer_norm_bitwise(kb, small_lanes, affine):
    x = _randn(3, 3, 150, dtype=BF16, scale=3) + 2
    w = _randn(150, seed=1) + 1 if affine != "none" else None
    b = _randn(150, dtype=BF16, seed=2) if affine == "both" else None
    with interpreter_numerics(ordered_dot=False):
        got = kb.bi_layer_norm_rows(x, w, b, 1e-5, small_lanes)
    assert_bitwise("layer_norm", got, ref.bi_layer_norm_reference(x, w, b, 1e-5))


def test_norms_bitwise_at_the_real_row_block(kb):
    """ROW_BLOCK = 1024 lanes, D = 1100: two blocks, the second one a 76-element tail."""
    x, w = _randn(4, 1100, dtype=BF16, scale=2), _randn(1100, dtype=BF16, seed=1) + 1
    with interpreter_numerics(ordered_dot=False):
        rms = kb.bi_rms_norm_rows(x, w, 1e-6, BF16, ref.ROW_BLOCK)
        ln = kb.bi_layer_norm_rows(x, w, None, 1e-5, ref.ROW_BLOCK)
    assert_bitwise("rms_norm", rms, ref.bi_rms_norm_reference(x, w, 1e-6))
    assert_bitwise("layer_norm", ln, ref.bi_layer_norm_reference(x, w, None, 1e-5))


def test_row_sum_bitwise_contiguous_and_transposed(kb, small_lanes):
    x = _randn(150, 5)
    with interpreter_numerics(ordered_dot=False):
        cols = kb.bi_row_sum_rows(x.t(), small_lanes)  # the backward's column sums, read in place
        rows = kb.bi_row_sum_rows(x.t().contiguous(), small_lanes)
    assert_bitwise("row_sum of xᵀ", cols, ref.bi_row_sum_reference(x.t()))
    assert_bitwise("row_sum", rows, cols)


@pytest.mark.parametrize("dtype", [FP32, BF16], ids=["fp32", "bf16"])
def test_log_softmax_close(kb, small_lanes, dtype):
    x = _randn(9, 150, dtype=dtype, scale=4)
    x[0, 3] = 40.0  # one dominant logit
    with interpreter_numerics(ordered_dot=False):
        got = kb.bi_log_softmax_rows(x, small_lanes)
    want = ref.bi_log_softmax_reference(x)
    err, mx = rel_l2(got, want), (got - want).abs().max().item()
    assert got.dtype == FP32 and err <= LSM_TOL["rel_l2"] and mx <= LSM_TOL["max_abs"], (
        f"log_softmax: relative L2 {err:.2e}, max |Δ| {mx:.2e} > {LSM_TOL}")


_MM_CASES = [  # (name, x dtype, weight dtype, out dtype, bias)
    ("bf16-bias", BF16, BF16, BF16, True),
    ("bf16-to-fp32", BF16, BF16, FP32, False),
    ("fp32-ieee", FP32, FP32, FP32, True),
    ("x-bf16-w-fp32", BF16, FP32, FP32, True),
]


@pytest.mark.parametrize("tiles", ["default", "small"])
@pytest.mark.parametrize("case", _MM_CASES, ids=[c[0] for c in _MM_CASES])
def test_matmul_bitwise_with_ordered_dot(kb, request, case, tiles):
    if tiles == "small":
        request.getfixturevalue("small_tiles")
    _, xd, wd, od, has_bias = case
    x, w = _randn(2, 37, 150, dtype=xd), _randn(40, 150, dtype=wd, scale=150**-0.5, seed=1)
    b = _randn(40, seed=2) if has_bias else None
    with interpreter_numerics(ordered_dot=True):
        got = kb.bi_matmul(x, w, b, od, ref.BLOCK_K)
    assert_bitwise("bi_matmul", got, ref.bi_linear_reference(x, w, b, od))


def test_matmul_strided_operands_of_the_backward(kb, small_tiles):
    """dweight = dyᵀ · xᵀ read in place from transposed views (no copies), as the backward does."""
    dy, x = _randn(70, 40, dtype=BF16), _randn(70, 150, dtype=BF16, seed=1)
    with interpreter_numerics(ordered_dot=True):
        got = kb.bi_matmul(dy.t(), x.t(), None, BF16, ref.BLOCK_K)
    assert_bitwise("dweight", got, ref.bi_linear_reference(dy.t(), x.t(), None, BF16))


def test_matmul_close_with_numpy_dot(kb):
    x, w, b = _randn(37, 150, dtype=BF16), _randn(40, 150, dtype=BF16, scale=150**-0.5, seed=1), _randn(40, seed=2)
    with interpreter_numerics(ordered_dot=False):
        got = kb.bi_matmul(x, w, b, FP32, ref.BLOCK_K)
    err = rel_l2(got, ref.bi_linear_reference(x, w, b, FP32))
    assert err <= MM_TOL, f"bi_matmul with numpy's dot: relative L2 {err:.2e} > {MM_TOL:.0e}"


def test_kernels_are_batch_invariant(kb, small_tiles, small_lanes):
    w, b = _randn(40, 150, dtype=BF16, scale=150**-0.5, seed=1), _randn(40, seed=2)
    g = _randn(150, dtype=BF16, seed=3) + 1
    cases = [  # (name, rows -> rows, rows, sizes, rows of the shuffled big call)
        ("matmul", lambda x: kb.bi_matmul(x, w, b, FP32, ref.BLOCK_K), _randn(17, 150, dtype=BF16), "matmul", 80),
        ("rms_norm", lambda x: kb.bi_rms_norm_rows(x, g, 1e-6, BF16, small_lanes), _randn(8, 150, dtype=BF16),
         "rows", 24),
        ("log_softmax", lambda x: kb.bi_log_softmax_rows(x, small_lanes), _randn(8, 150, scale=4), "rows", 24),
    ]
    with interpreter_numerics(ordered_dot=True):
        for name, fn, x, sizes, big in cases:
            failures = check_batch_invariance(fn, x, sizes=SIZES[sizes], big=big)
            assert not failures, f"{name}: " + "; ".join(failures)


def test_checker_rejects_a_planted_launch(kb, small_tiles):
    """The same kernel launched with a K block chosen from M (16 below 8 rows, else 64): the checker
    must reject it; with the fixed block it passes."""
    w = _randn(40, 150, scale=150**-0.5, seed=1)
    x = _randn(9, 150)

    def planted(rows):
        return kb.bi_matmul(rows, w, None, FP32, 16 if rows.shape[0] < 8 else 64)

    with interpreter_numerics(ordered_dot=True):
        failures = check_batch_invariance(planted, x, sizes=(1, 2, 8, 9), big=0)
        fixed = check_batch_invariance(lambda rows: kb.bi_matmul(rows, w, None, FP32, 64), x, sizes=(1, 8, 9), big=0)
    assert [f.split(":")[0] for f in failures] == ["M=8", "M=9"], failures
    assert not fixed, fixed


def test_bad_block_raises(kb):
    with pytest.raises(ValueError, match="power of two"):
        kb.bi_row_sum_rows(torch.randn(2, 3), 48)


# ---------------------------------------------------------------------------------------------
# GPU (compiled kernels through the ops)
# ---------------------------------------------------------------------------------------------


def _cuda_cases():
    """(name, op on CUDA, its reference on CPU, CPU input rows)."""
    bi = importlib.import_module("inductor_ext.ops.batch_invariant")
    w = _randn(1024, 4096, dtype=BF16, scale=4096**-0.5, seed=1)
    wv = _randn(8192, 1024, dtype=BF16, scale=1024**-0.5, seed=4)
    g = _randn(4096, dtype=BF16, seed=2) + 1
    wc, wvc, gc = w.cuda(), wv.cuda(), g.cuda()
    return [
        ("linear-bf16", lambda x: bi.bi_linear(x, wc), lambda x: ref.bi_linear_reference(x, w, None, BF16),
         _randn(64, 4096, dtype=BF16)),
        ("linear-to-fp32", lambda x: bi.bi_linear(x, wvc, out_dtype=FP32),
         lambda x: ref.bi_linear_reference(x, wv, None, FP32), _randn(64, 1024, dtype=BF16)),
        ("rms_norm", lambda x: bi.bi_rms_norm(x, gc), lambda x: ref.bi_rms_norm_reference(x, g, 1e-6),
         _randn(64, 4096, dtype=BF16)),
        ("layer_norm", lambda x: bi.bi_layer_norm(x, gc, None), lambda x: ref.bi_layer_norm_reference(x, g, None, 1e-5),
         _randn(64, 4096, dtype=BF16)),
        ("log_softmax", bi.bi_log_softmax, ref.bi_log_softmax_reference, _randn(64, 8192, scale=4)),
    ]


@pytest.mark.cuda
def test_cuda_batch_invariant_and_close_to_reference():
    from inductor_ext import backends

    assert backends.available("triton"), "the cuda tests exercise the Triton kernels"
    for name, fn, reference, x in _cuda_cases():
        failures = check_batch_invariance(lambda rows, f=fn: f(rows.cuda()).cpu(), x)
        assert not failures, f"{name}: " + "; ".join(failures)
        got, want = fn(x.cuda()).cpu(), reference(x)
        if got.dtype == FP32:
            err = rel_l2(got, want)
            assert err <= GPU_TOL["fp32"], f"{name}: relative L2 {err:.2e} > {GPU_TOL['fp32']:.0e}"
        else:
            ulp = torch.finfo(got.dtype).eps * want.float().abs().clamp_min(torch.finfo(got.dtype).tiny)
            far = ((got.float() - want.float()).abs() > GPU_TOL["ulps16"] * ulp).sum().item()
            # the tensor cores sum each K block in their own order: where a dot product cancels, the
            # two FP32 sums round to BF16 values more than 2 ulp of |want| apart (H200: 5 elements of
            # the linear-bf16 case); invariance above is exact either way
            assert far <= GPU_TOL["far_fraction"] * got.numel(), \
                f"{name}: {far} elements more than {GPU_TOL['ulps16']} ulp from the reference"


@pytest.mark.cuda
def test_cuda_backward_and_graph_capture():
    bi = importlib.import_module("inductor_ext.ops.batch_invariant")
    x = _randn(300, 512, dtype=BF16).cuda().requires_grad_(True)
    w = _randn(256, 512, dtype=BF16, scale=512**-0.5, seed=1).cuda().requires_grad_(True)
    g = (_randn(512, dtype=BF16, seed=2) + 1).cuda().requires_grad_(True)

    def step():
        return bi.bi_log_softmax(bi.bi_linear(bi.bi_rms_norm(x, g), w, out_dtype=FP32))

    eager = step()
    grads = torch.autograd.grad(eager[:, 0].sum(), (x, w, g))
    again = torch.autograd.grad(step()[:, 0].sum(), (x, w, g))
    for name, a, e in zip(("dx", "dweight", "dgamma"), again, grads):
        assert torch.equal(a, e), f"{name}: the backward is not deterministic"
    with torch.no_grad():
        step()  # warm up (Triton compiles outside the capture)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = step()
        graph.replay()
    assert torch.equal(captured, eager.detach()), "the CUDA-graph replay differs from eager"
