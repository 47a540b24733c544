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
launch whose K block is chosen from M rejected; the grouped matmul (``glm53::bi_grouped_linear``,
its dx and dweight) bitwise equal to the reference with empty groups, groups straddling tiles and
rows past the last offset, its rows those of single-row dense launches, and a planted tile map (one
tile reading the neighbouring group's weight) rejected. With CUDA the ``cuda``-marked tests run the compiled
kernels through the ``glm53::bi_*`` ops: bitwise invariance for M = 1..64 and inside a shuffled
4096-row call, the reference within the GPU tolerances ``GPU_TOL``, and CUDA-graph capture.
"""

import importlib
import os

import pytest
import torch

from inductor_ext.ops import batch_invariant_reference as ref
from tests.support.batch_invariant import (
    assert_bitwise,
    check_batch_invariance,
    grouped_case,
    interpreter_numerics,
    rel_l2,
)
from tests.support.triton_interpreter import apply_interpreter_shims

pytest.importorskip("triton")

BF16, FP32 = torch.bfloat16, torch.float32
LSM_TOL = {"rel_l2": 1e-6, "max_abs": 1e-5}  # numpy's exp/log vs torch's: a few FP32 ulps
MM_TOL = 1e-6  # numpy's BLAS dot (other in-block order) vs the reference, FP32 output, relative L2
# GPU vs the CPU reference (MMA order inside a K block; FMA contraction; approximate exp/log):
# relative L2 for FP32 outputs; 16-bit outputs at most 2 ulp apart (a 1-ulp change of RMSNorm's x̂
# moves weight · x̂ by up to 2)
GPU_TOL = {"fp32": 2e-6, "ulps16": 2, "far_fraction": 1e-4, "bf16_grad": 1e-2}
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


@pytest.mark.parametrize("n,k", [(24, 150), (150, 24), (24, 24)], ids=["skinny-n", "short-k", "both"])
def test_matmul_skinny_fp32_tiles_bitwise(kb, n, k):
    """FP32 tiles fitted to a skinny product (launch_config: 32 columns for N = 24, one 32-wide K
    block for K = 24) give the reference's values, bias and strided weight included."""
    x, w, b = _randn(37, k), _randn(k, n, scale=k**-0.5, seed=1).t(), _randn(n, seed=2)
    config = kb.launch_config(FP32, n, k, ref.BLOCK_K)
    assert (config[:2], config[5]) == ((16, 32) if n <= 32 else (64, 64), 32 if k <= 32 else 64)
    with interpreter_numerics(ordered_dot=True):
        got = kb.bi_matmul(x, w, b, FP32, ref.BLOCK_K)
    assert_bitwise("bi_matmul", got, ref.bi_linear_reference(x, w, b, FP32))


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


# grouped matmul (MoE experts): group sizes with empty groups, a group straddling tile boundaries,
# rows past the last offset; 16-row tiles here (SMALL_TILES) or the default 128 / 64
_GROUPED_COUNTS = (0, 19, 1, 0, 21, 3)  # ends 0, 19, 20, 20, 41, 44: group 4 spans rows 20..40
_GROUPED_TAIL = 3


def _nonzero_bits(t):
    """Any element whose bits are not +0.0."""
    return bool((t.contiguous().view(torch.int16 if t.element_size() == 2 else torch.int32) != 0).any())


def _cdiv(a, b):
    return -(-a // b)


def _grouped_operands(xd, wd):
    counts = _GROUPED_COUNTS
    offs = torch.tensor(counts).cumsum(0).to(torch.int32)
    x = _randn(sum(counts) + _GROUPED_TAIL, 150, dtype=xd, seed=3)
    w = _randn(len(counts), 40, 150, dtype=wd, scale=150**-0.5, seed=4)
    return x, w, offs


@pytest.mark.parametrize("tiles", ["default", "small"])
@pytest.mark.parametrize("xd,wd", [(BF16, BF16), (FP32, FP32), (BF16, FP32)], ids=["bf16", "fp32", "x-bf16-w-fp32"])
def test_grouped_matmul_bitwise_with_ordered_dot(kb, request, xd, wd, tiles):
    """Forward, dx (the weight transposed per group, a strided view) and dweight bitwise equal to the
    reference, whose rows are bi_linear's rows alone (tests/ops)."""
    if tiles == "small":
        request.getfixturevalue("small_tiles")
    x, w, offs = _grouped_operands(xd, wd)
    dy = _randn(x.shape[0], 40, dtype=xd, seed=5)
    starts, ends = ref.group_bounds(offs, x.shape[0])
    with interpreter_numerics(ordered_dot=True):
        y = kb.bi_grouped_matmul(x, w, starts, ends, xd, ref.BLOCK_K)
        dx = kb.bi_grouped_matmul(dy, w.transpose(1, 2), starts, ends, xd, ref.BLOCK_K)
        dw = kb.bi_grouped_matmul_wgrad(dy, x, starts, ends, wd, ref.BLOCK_K)
    assert_bitwise("grouped y", y, ref.bi_grouped_linear_reference(x, w, offs))
    assert_bitwise("grouped dx", dx, ref.bi_grouped_linear_reference(dy, w.transpose(1, 2), offs))
    assert_bitwise("grouped dweight", dw, ref.bi_grouped_linear_wgrad_reference(dy, x, offs, wd))
    assert not _nonzero_bits(y[-_GROUPED_TAIL:]) and not _nonzero_bits(dw[0]) and not _nonzero_bits(dw[3])


def test_grouped_tile_map_covers_every_row_once(kb):
    """Random offsets (many empty groups, equal offsets, a tail): the slots of each group cover its
    rows exactly once in 16-row tiles, the used slots fit the static bound cdiv(M, 16) + E."""
    mm = importlib.import_module("inductor_ext.kernels.batch_invariant.matmul")
    g = torch.Generator().manual_seed(0)
    for trial in range(20):
        E, M = int(torch.randint(1, 12, (1,), generator=g)), int(torch.randint(0, 200, (1,), generator=g))
        offs = torch.randint(0, M + 1, (E,), generator=g).sort().values.to(torch.int32)
        starts, ends = ref.group_bounds(offs, M)
        group, row0, end = mm.grouped_tile_map(starts, ends, M, 16).long()
        assert group.numel() == _cdiv(M, 16) + E
        owner = torch.full((M,), -1, dtype=torch.long)
        for t in (group >= 0).nonzero().flatten().tolist():
            rows = torch.arange(row0[t], min(row0[t] + 16, end[t]))
            assert rows.numel() > 0 and (owner[rows] == -1).all(), f"trial {trial}: slot {t} overlaps or is empty"
            owner[rows] = group[t]
        want = torch.searchsorted(offs.long(), torch.arange(M), right=True)  # E for the rows past offs[-1]
        assert torch.equal(owner, want), f"trial {trial}: offs {offs.tolist()}"


def test_grouped_rows_equal_single_row_launches(kb, small_tiles):
    """Rows of grouped launches of several group sizes equal the dense kernel on each row alone."""
    probe_groups = (0, 2, 2, 3, 0, 2)
    w, probes = _randn(4, 40, 150, dtype=BF16, scale=150**-0.5, seed=4), _randn(6, 150, dtype=BF16, seed=3)
    gen = torch.Generator().manual_seed(0)
    with interpreter_numerics(ordered_dot=True):
        alone = torch.cat([kb.bi_matmul(probes[i:i + 1], w[e], None, BF16, ref.BLOCK_K)
                           for i, e in enumerate(probe_groups)])
        for counts, tail in (((2, 0, 3, 1), 0), ((17, 0, 3, 15), 2), ((2, 5, 33, 1), 0)):
            x, offs, where = grouped_case(probes, probe_groups, counts, generator=gen, tail=tail)
            starts, ends = ref.group_bounds(offs, x.shape[0])
            y = kb.bi_grouped_matmul(x, w, starts, ends, BF16, ref.BLOCK_K)
            assert_bitwise(f"counts {counts}", y[where], alone)


def test_checker_rejects_a_planted_tile_map(kb, small_tiles, monkeypatch):
    """A tile map whose second tile of group 1 reads group 2's weight (rows 16..18 of a 19-row group):
    the bitwise comparison with the reference must fail on exactly those rows."""
    mm = importlib.import_module("inductor_ext.kernels.batch_invariant.matmul")
    real = mm.grouped_tile_map

    def planted(starts, ends, rows, block_m):
        meta = real(starts, ends, rows, block_m).clone()
        meta[0, 1] += 1  # slot 1: group 1's rows 16..18, the neighbouring group's weight
        return meta

    monkeypatch.setattr(mm, "grouped_tile_map", planted)
    x, w, offs = _grouped_operands(BF16, BF16)
    starts, ends = ref.group_bounds(offs, x.shape[0])
    with interpreter_numerics(ordered_dot=True):
        y = kb.bi_grouped_matmul(x, w, starts, ends, BF16, ref.BLOCK_K)
    want = ref.bi_grouped_linear_reference(x, w, offs)
    with pytest.raises(AssertionError, match="elements differ"):
        assert_bitwise("planted", y, want)
    bad_rows = (y != want).any(1).nonzero().flatten().tolist()
    assert bad_rows == [16, 17, 18], bad_rows


def test_bad_block_raises(kb):
    with pytest.raises(ValueError, match="power of two"):
        kb.bi_row_sum_rows(torch.randn(2, 3), 48)


# ---------------------------------------------------------------------------------------------
# GPU (compiled kernels through the ops)
# ---------------------------------------------------------------------------------------------


def _cuda_cases():
    """(name, op on CUDA, its reference on CPU, CPU input rows, its FP64 product or None). A case
    with an FP64 product is one long FP32 FMA chain, measured against FP64 (see the test)."""
    bi = importlib.import_module("inductor_ext.ops.batch_invariant")
    w = _randn(1024, 4096, dtype=BF16, scale=4096**-0.5, seed=1)
    wv = _randn(8192, 1024, dtype=BF16, scale=1024**-0.5, seed=4)
    g = _randn(4096, dtype=BF16, seed=2) + 1
    wm = _randn(24, 16384, dtype=BF16, scale=16384**-0.5, seed=5)  # mHC's projection (SKINNY_FP32 tiles)
    wc, wvc, gc, wmc = w.cuda(), wv.cuda(), g.cuda(), wm.cuda()
    return [
        ("linear-skinny-fp32", lambda x: bi.bi_linear(x, wmc, out_dtype=FP32),
         lambda x: ref.bi_linear_reference(x, wm, None, FP32), _randn(64, 16384),
         lambda x: x.double() @ wm.double().t()),
        ("linear-bf16", lambda x: bi.bi_linear(x, wc), lambda x: ref.bi_linear_reference(x, w, None, BF16),
         _randn(64, 4096, dtype=BF16), None),
        ("linear-to-fp32", lambda x: bi.bi_linear(x, wvc, out_dtype=FP32),
         lambda x: ref.bi_linear_reference(x, wv, None, FP32), _randn(64, 1024, dtype=BF16), None),
        ("rms_norm", lambda x: bi.bi_rms_norm(x, gc), lambda x: ref.bi_rms_norm_reference(x, g, 1e-6),
         _randn(64, 4096, dtype=BF16), None),
        ("layer_norm", lambda x: bi.bi_layer_norm(x, gc, None), lambda x: ref.bi_layer_norm_reference(x, g, None, 1e-5),
         _randn(64, 4096, dtype=BF16), None),
        ("log_softmax", bi.bi_log_softmax, ref.bi_log_softmax_reference, _randn(64, 8192, scale=4), None),
    ]


@pytest.mark.cuda
def test_cuda_batch_invariant_and_close_to_reference():
    from inductor_ext import backends

    assert backends.available("triton"), "the cuda tests exercise the Triton kernels"
    for name, fn, reference, x, fp64 in _cuda_cases():
        failures = check_batch_invariance(lambda rows, f=fn: f(rows.cuda()).cpu(), x)
        assert not failures, f"{name}: " + "; ".join(failures)
        got, want = fn(x.cuda()).cpu(), reference(x)
        if fp64 is not None:
            # one FMA chain over the whole K (the reference adds 64-term block sums): both against
            # FP64, the chain within 2·eps·sqrt(K) (its rounding-error scale for random signs)
            exact = fp64(x)
            err, ref_err = rel_l2(got, exact), rel_l2(want, exact)
            bound = 2 * torch.finfo(FP32).eps * x.shape[1] ** 0.5
            assert err <= bound, f"{name}: relative L2 to FP64 {err:.2e} > {bound:.1e} (reference: {ref_err:.2e})"
        elif got.dtype == FP32:
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


_CUDA_PROBE_GROUPS = tuple(i % 7 for i in range(28))  # group 7 of 8 holds no probe
# group sizes around the probes: tiny groups, empty groups, groups straddling 128-row tiles, a
# 4096-row call with very uneven groups, rows past the last offset
_CUDA_COUNTS = [((4,) * 7 + (0,), 0), ((4, 5, 4, 4, 300, 4, 129, 1), 0), ((4, 4, 4, 4, 4, 4, 4, 0), 9),
                ((1000, 4, 4, 2500, 4, 257, 4, 0), 323)]


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [BF16, FP32], ids=["bf16", "fp32"])
def test_cuda_grouped_rows_equal_bi_linear_rowwise(dtype):
    """Every row of grouped calls of many group sizes is bitwise the Triton bi_linear of that row
    alone; dx and each group's dweight: FP32 bitwise bi_linear(dy, wᵀ) and bi_linear(dyᵀ, xᵀ) on the
    group alone, BF16 (torch._grouped_mm) close to cuBLAS on the group; the reference within GPU_TOL."""
    bi = importlib.import_module("inductor_ext.ops.batch_invariant")
    E, N, K = 8, 1024, 2048
    w = _randn(E, N, K, dtype=dtype, scale=K**-0.5, seed=1).cuda()
    probes = _randn(len(_CUDA_PROBE_GROUPS), K, dtype=dtype, seed=2)
    alone = torch.cat([bi.bi_linear(probes[i:i + 1].cuda(), w[e]) for i, e in enumerate(_CUDA_PROBE_GROUPS)]).cpu()
    gen = torch.Generator().manual_seed(0)
    for counts, tail in _CUDA_COUNTS:
        x, offs, where = grouped_case(probes, _CUDA_PROBE_GROUPS, counts, generator=gen, tail=tail)
        y = bi.bi_grouped_linear(x.cuda(), w, offs.cuda()).cpu()
        assert_bitwise(f"counts {counts}", y[where], alone)
        assert not y[offs[-1]:].any(), "rows past the last offset must be 0"
    counts, _ = _CUDA_COUNTS[1]
    x, offs, _ = grouped_case(probes, _CUDA_PROBE_GROUPS, counts, generator=gen)
    xc, wc = x.cuda().requires_grad_(True), w.clone().requires_grad_(True)
    y = bi.bi_grouped_linear(xc, wc, offs.cuda())
    dy = _randn(*y.shape, dtype=dtype, seed=3).cuda()
    dx, dw = torch.autograd.grad(y, (xc, wc), dy)
    ends = [0, *offs.tolist()]
    for e, (lo, hi) in enumerate(zip(ends, ends[1:])):
        if hi == lo:
            assert not dw[e].any(), f"group {e} has no rows: its dweight must be 0"
            continue
        xe, dye = xc[lo:hi].detach(), dy[lo:hi]
        if dtype == BF16:  # the backward's GEMMs are torch._grouped_mm's (N, K multiples of 8)
            want_dx, want_dw = dye.float() @ w[e].float(), dye.float().t() @ xe.float()
            assert rel_l2(dx[lo:hi], want_dx) <= GPU_TOL["bf16_grad"], f"group {e} dx"
            assert rel_l2(dw[e], want_dw) <= GPU_TOL["bf16_grad"], f"group {e} dweight"
        else:
            assert_bitwise(f"group {e} dx", dx[lo:hi], bi.bi_linear(dye, w[e].t()))
            assert_bitwise(f"group {e} dweight", dw[e], bi.bi_linear(dye.t(), xe.t()))
    got, want = y.detach().cpu(), ref.bi_grouped_linear_reference(x, w.cpu(), offs)
    if dtype == FP32:
        assert rel_l2(got, want) <= GPU_TOL["fp32"]
    else:
        ulp = torch.finfo(BF16).eps * want.float().abs().clamp_min(torch.finfo(BF16).tiny)
        far = ((got.float() - want.float()).abs() > GPU_TOL["ulps16"] * ulp).sum().item()
        assert far <= GPU_TOL["far_fraction"] * got.numel(), f"{far} elements more than 2 ulp from the reference"


@pytest.mark.cuda
def test_cuda_grouped_backward_and_graph_capture():
    """Deterministic backward; the forward's and the backward's kernels (called as the ops autograd
    calls) captured in one CUDA graph with offs on the device, replayed after the group sizes
    change in place: equal to eager with the new sizes."""
    bi = importlib.import_module("inductor_ext.ops.batch_invariant")
    E, N, K, M = 8, 256, 512, 600
    x = _randn(M, K, dtype=BF16).cuda().requires_grad_(True)
    w = _randn(E, N, K, dtype=BF16, scale=K**-0.5, seed=1).cuda().requires_grad_(True)
    dy = _randn(M, N, dtype=BF16, seed=2).cuda()
    offs = torch.tensor([0, 150, 150, 300, 301, 450, 599, 600], dtype=torch.int32).cuda()

    def step():
        y = bi.bi_grouped_linear(x, w, offs)
        return (y, *torch.autograd.grad(y, (x, w), dy))

    eager = step()
    for name, a, e in zip(("y", "dx", "dweight"), step(), eager):
        assert torch.equal(a, e), f"{name}: not deterministic"

    def kernels():  # the same three kernels called directly: autograd's engine does not capture here
        xd, wd = x.detach(), w.detach()
        dx = torch._grouped_mm(dy, wd, offs=offs)  # the backward's, where BF16 N, K fit _grouped_mm
        return (torch.ops.glm53.bi_grouped_linear(xd, wd, offs),
                torch.where((torch.arange(M, device=dx.device) < offs[-1])[:, None], dx, 0),
                torch._grouped_mm(dy.t(), xd, offs=offs))

    for name, a, e in zip(("y", "dx", "dweight"), kernels(), eager):
        assert torch.equal(a, e), f"{name}: the op calls differ from autograd's"
    from inductor_ext.bench.timing import capture  # warm-up on a side stream, then the capture

    static = {}
    graph = capture(lambda: static.update(out=kernels()), warmup=1)
    captured = static["out"]
    offs.copy_(torch.tensor([64, 64, 200, 333, 333, 500, 500, 590], dtype=torch.int32))
    graph.replay()
    want = step()
    for name, a, e in zip(("y", "dx", "dweight"), captured, want):
        assert torch.equal(a, e), f"{name}: the CUDA-graph replay with new group sizes differs from eager"
