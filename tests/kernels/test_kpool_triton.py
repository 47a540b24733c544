"""Triton kernels of the KPool indexer against the CPU reference (``inductor_ext.ops.kpool_reference``).

Without CUDA the kernels run on CPU tensors under Triton's interpreter, at small awkward sizes with
packed documents. Triton decides interpretation when it is first imported, so this needs its own
process: ``TRITON_INTERPRET=1 pytest tests/kernels/test_kpool_triton.py`` (otherwise those tests skip and say
so). With CUDA the ``cuda``-marked tests run the compiled kernels through the ``glm53::kpool_*`` ops
at larger sizes and inside a CUDA graph. Everything skips when triton is not installed.

Contracts checked: pools, scales, FP8 queries and folded head weights bitwise; BF16 scores within
1e-6 (relative L2 and max error over max |score|); FP8 scores, whose CUDA dots accumulate on the FP8
tensor cores as the serving scorer's do, within DeepGEMM's normalized error 5e-6 and 1e-3 relative;
selected token ids identical, order included (top pools, lower pool first among equal scores, in
ascending pool order).
"""

import importlib

import numpy as np
import pytest
import torch

from inductor_ext import workspace
from inductor_ext.ops import kpool_reference as ref
from tests.support.kpool import calc_diff
from tests.support.triton_interpreter import interpreter_kernels

pytest.importorskip("triton")

P = 4
LENGTHS = [13, 22, 7, 1, 9, 3]  # packed documents: short, single-token, no complete pool, T % P != 0
SCORE_TOL = {"bf16": 1e-6, "fp8": 1e-3}  # relative L2 and max error over max |score|
FP8_CALC_DIFF = 5e-6  # DeepGEMM's normalized error, the FP8 scorer's contract
FP8 = torch.float8_e4m3fn


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()])


def _assert_bitwise(name: str, got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape, f"{name}: {got.dtype}{tuple(got.shape)} vs {want.dtype}{tuple(want.shape)}"
    bad = (_bits(got.cpu()) != _bits(want.cpu())).nonzero()
    assert bad.numel() == 0, f"{name}: {bad.shape[0]} of {got.numel()} elements differ, first at {bad[:4].tolist()}"


def _assert_scores(name: str, got: torch.Tensor, want: torch.Tensor, precision: str) -> None:
    got, want = got.cpu().double(), want.cpu().double()
    rel = ((got - want).norm() / want.norm().clamp_min(1e-30)).item()
    mx = ((got - want).abs().max() / want.abs().max().clamp_min(1e-30)).item()
    tol = SCORE_TOL[precision]
    assert rel <= tol and mx <= tol, f"{name}: relative L2 {rel:.2e}, max/max|ref| {mx:.2e} > {tol}"
    if precision == "fp8":
        diff = calc_diff(got, want)
        assert diff <= FP8_CALC_DIFF, f"{name}: calc_diff {diff:.2e} > {FP8_CALC_DIFF}"
    print(f"\n[{name}] relative L2 {rel:.2e}, max/max|ref| {mx:.2e}")


def _layout(lengths, device="cpu"):
    T = sum(lengths)
    cu = torch.tensor([0, *np.cumsum(lengths).tolist()], dtype=torch.int64, device=device)
    return T, ref.layout_reference(cu, T, P)


def _compress_inputs(T, seed=0):
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(T, 128, generator=g).bfloat16()
    gate = (torch.randn(T, 128, generator=g) * 3).bfloat16()
    ape = torch.randn(P, 128, generator=g)
    return k, gate, ape


def _query_inputs(T, H, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(T, H, 128, generator=g)
    q[0, :3] *= 1e-7  # amax below the 1e-4 floor
    q[1] *= 1e-3  # e4m3 subnormals after scaling
    q[2, :, 0] = 448.0 * 2.0**-9 * 128**0.5  # an amax that is an exact power of two times 448
    return q.bfloat16(), torch.randn(T, H, generator=g) * H**-0.5


# ---------------------------------------------------------------------------------------------
# interpreter (CPU)
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def kt():
    """The kernel modules in interpreter mode (CPU tensors)."""
    return interpreter_kernels("inductor_ext.kernels.kpool", "tests/kernels/test_kpool_triton.py")


@pytest.mark.parametrize("mode", ref.COMPRESS_MODES)
def test_compress_bitwise(kt, mode):
    T, (pool_token, *_) = _layout(LENGTHS)
    k, gate, ape = _compress_inputs(T)
    pool, scale = kt.kpool_compress_fwd(k, gate, ape, pool_token, mode)
    want_pool, want_scale = ref.compress_reference(k, gate, ape, pool_token, mode)
    _assert_bitwise(f"pool[{mode}]", pool, want_pool)
    _assert_bitwise(f"scale[{mode}]", scale, want_scale)


def test_compress_bf16_ape(kt):
    T, (pool_token, *_) = _layout([17, 12])
    k, gate, ape = _compress_inputs(T, seed=3)
    pool, scale = kt.kpool_compress_fwd(k, gate, ape.bfloat16(), pool_token, "fp8_fp32")
    want_pool, want_scale = ref.compress_reference(k, gate, ape.bfloat16(), pool_token, "fp8_fp32")
    _assert_bitwise("pool", pool, want_pool)
    _assert_bitwise("scale", scale, want_scale)


@pytest.mark.parametrize("scale_fmt", ref.SCALE_FMTS)
@pytest.mark.parametrize("heads", [32, 64])
def test_quant_query_bitwise(kt, scale_fmt, heads):
    q, w = _query_inputs(11, heads)
    q8, w_eff = kt.kpool_quant_query_fwd(q, w, scale_fmt)
    want_q8, want_w = ref.quant_query_reference(q, w, scale_fmt)
    _assert_bitwise("q8", q8, want_q8)
    _assert_bitwise("w_eff", w_eff, want_w)


def _score_inputs(kt, M, S, H, precision, seed=0):
    q, w = _query_inputs(M, H, seed)
    k, gate, ape = _compress_inputs(P * S, seed + 1)
    pool_token = torch.arange(S) * P
    pool_token[-2:] = -1  # unused slots score 0
    if precision == "bf16":
        pool, scale = ref.compress_reference(k, gate, ape, pool_token, "bf16_fp32")
        return q, w, pool, scale
    pool, scale = ref.compress_reference(k, gate, ape, pool_token, "fp8_ue8m0")
    q8, w_eff = ref.quant_query_reference(q, w, "ue8m0")
    return q8, w_eff, pool, scale


@pytest.mark.parametrize("layout", workspace.LAYOUTS)
@pytest.mark.parametrize("precision", ["bf16", "fp8"])
@pytest.mark.parametrize("heads", workspace.SUPPORTED_HEADS)
@pytest.mark.parametrize("kernel", ["fold", "loop"])
def test_logits(kt, heads, precision, layout, kernel, monkeypatch):
    # fold: M not a multiple of bq (4, 2, 1), S not a multiple of the pool block (a small grid);
    # loop: 2 x 2 tiles of 64 tokens x 128 pools, both partial (forced despite the small grid)
    M, S = (7, 37) if kernel == "fold" else (70, 150)
    if kernel == "loop":
        monkeypatch.setattr(importlib.import_module("inductor_ext.kernels.kpool.score"), "_LOOP_MIN_PROGRAMS", 1)
    q, w, pool, scale = _score_inputs(kt, M, S, heads, precision)
    q = torch.cat((q, q), 1)[:, :heads]  # a view: token stride 2·H·128
    got = kt.kpool_logits_fwd(q, w, pool, scale, precision, layout)
    want = ref.logits_reference(q, w, pool, scale, precision, layout)
    assert got.shape == want.shape and got.stride() == want.stride(), f"logits view: {got.stride()} vs {want.stride()}"
    assert got.untyped_storage().nbytes() == workspace.mqa_logits_bytes(M, S, heads, layout), "logits storage bytes"
    _assert_scores(f"logits[{heads}-{precision}-{layout}]", got, want, precision)


@pytest.mark.parametrize("tail", ["compact", "fixed"])
def test_select_matches_reference(kt, tail):
    T, (_, q_lo, q_n, tail_start, tail_len) = _layout(LENGTHS)
    logits = workspace.logits_view(T, T // P, 32, "legacy", "cpu")  # strided, like the scorer's
    logits.copy_(torch.randn(T, T // P, generator=torch.Generator().manual_seed(5)))
    topk = 8  # 2 pools: most rows must choose
    got = kt.kpool_select_fwd(logits, q_lo, q_n, tail_start, tail_len, topk, P, tail)
    want = ref.select_reference(logits, q_lo, q_n, tail_start, tail_len, topk, P, tail)
    assert got.dtype == torch.int32 and got.shape == want.shape, f"ids: {got.dtype}{tuple(got.shape)}"
    bad = (got != want).any(1).nonzero().flatten()
    assert bad.numel() == 0, f"token ids differ in rows {bad.tolist()}: {got[bad[:2]].tolist()} vs {want[bad[:2]].tolist()}"


def test_select_whole_vector_reads_equal_slot_reads(kt):
    """The padded workspace view is read in whole 16-byte vectors, a tight tensor whose last row
    ends mid-vector slot by slot: same ids, equal to the reference."""
    ksel = importlib.import_module("inductor_ext.kernels.kpool.select")
    T, rows = _layout(LENGTHS)
    S = T // P
    assert S % 4 != 0
    padded = workspace.logits_view(T, S, 32, "legacy", "cpu")
    padded.copy_(torch.randn(T, S, generator=torch.Generator().manual_seed(6)))
    tight = padded.contiguous()
    assert ksel._whole_vectors(padded) and not ksel._whole_vectors(tight)
    want = ref.select_reference(padded, *rows[1:], 8, P, "compact")
    for logits in (padded, tight):
        assert torch.equal(kt.kpool_select_fwd(logits, *rows[1:], 8, P, "compact"), want)


def test_select_ties_lower_pool_first(kt):
    """Exact ties (scores in {0, 1, 2}, incl. -0.0): kernel and reference both take the lower
    pools among equal scores and list the picks in ascending pool order."""
    lengths = [23, 14]
    T, (_, q_lo, q_n, tail_start, tail_len) = _layout(lengths)
    S = T // P
    logits = torch.randint(0, 3, (T, S), generator=torch.Generator().manual_seed(7)).float()
    logits[logits == 0] = -0.0
    logits[::2][logits[::2] == -0.0] = 0.0
    topk = 12
    got = kt.kpool_select_fwd(logits, q_lo, q_n, tail_start, tail_len, topk, P, "compact")
    want = ref.select_reference(logits, q_lo, q_n, tail_start, tail_len, topk, P, "compact")
    K = topk // P
    for t in range(T):
        lo, n = int(q_lo[t]), int(q_n[t])
        nsel = min(n, K)
        doc_start = int(tail_start[t]) - P * n
        picked = sorted(sorted(range(n), key=lambda j: (-float(logits[t, lo + j]), j))[:nsel])
        expect = [doc_start + P * j + i for j in picked for i in range(P)]
        assert got[t, : nsel * P].tolist() == expect, f"row {t}: {got[t].tolist()} vs lower-index-first {expect}"
    assert torch.equal(got, want), "kernel and reference differ"


# ---------------------------------------------------------------------------------------------
# CUDA (compiled kernels through the ops)
# ---------------------------------------------------------------------------------------------


def _cuda_case(lengths, heads, seed=0):
    T, (pool_token, q_lo, q_n, tail_start, tail_len) = _layout(lengths)
    k, gate, ape = _compress_inputs(T, seed)
    q, w = _query_inputs(T, heads, seed)
    return dict(T=T, pool_token=pool_token, rows=(q_lo, q_n, tail_start, tail_len), k=k, gate=gate, ape=ape, q=q, w=w)


@pytest.mark.cuda
@pytest.mark.parametrize("lengths", [LENGTHS, [4096, 3000, 1, 903]], ids=["small", "8000"])
def test_cuda_compress_and_query_bitwise(lengths):
    from inductor_ext import ops

    c = _cuda_case(lengths, 64)
    dev = "cuda"
    for mode in ref.COMPRESS_MODES:
        got = ops.kpool_compress(c["k"].to(dev), c["gate"].to(dev), c["ape"].to(dev), c["pool_token"].to(dev), mode=mode)
        want = ref.compress_reference(c["k"], c["gate"], c["ape"], c["pool_token"], mode)
        _assert_bitwise(f"pool[{mode}]", got[0], want[0])
        _assert_bitwise(f"scale[{mode}]", got[1], want[1])
    for fmt in ref.SCALE_FMTS:
        got = ops.kpool_quant_query(c["q"].to(dev), c["w"].to(dev), scale_fmt=fmt)
        want = ref.quant_query_reference(c["q"], c["w"], fmt)
        _assert_bitwise(f"q8[{fmt}]", got[0], want[0])
        _assert_bitwise(f"w_eff[{fmt}]", got[1], want[1])


@pytest.mark.cuda
@pytest.mark.parametrize("layout", workspace.LAYOUTS)
@pytest.mark.parametrize("precision", ["bf16", "fp8"])
@pytest.mark.parametrize("heads", workspace.SUPPORTED_HEADS)
@pytest.mark.parametrize("M", [1021, 5], ids=["loop", "fold"])  # 16 x 8 tiles; a decode-sized M
def test_cuda_logits_heads(heads, precision, layout, M):
    from inductor_ext import ops

    S = 1000
    q, w, pool, scale = _score_inputs(None, M, S, heads, precision)
    got = ops.kpool_logits(q.cuda(), w.cuda(), pool.cuda(), scale.cuda(), precision=precision, layout=layout)
    want = ref.logits_reference(q, w, pool, scale, precision, layout)
    assert got.stride() == want.stride(), f"logits stride {got.stride()} vs {want.stride()}"
    _assert_scores(f"logits[{heads}-{precision}-{layout}]", got, want, precision)


@pytest.mark.cuda
@pytest.mark.parametrize("tail", ["compact", "fixed"])
def test_cuda_select_matches_reference(tail):
    from inductor_ext import ops

    lengths = [5000, 1, 3191]
    T, (_, q_lo, q_n, tail_start, tail_len) = _layout(lengths)
    logits = torch.randn(T, T // P, generator=torch.Generator().manual_seed(11))
    rows = [t.cuda() for t in (q_lo, q_n, tail_start, tail_len)]
    got = ops.kpool_select(logits.cuda(), *rows, topk=2048, pool_size=P, tail=tail)
    want = ref.select_reference(logits, q_lo, q_n, tail_start, tail_len, 2048, P, tail)
    bad = (got.cpu() != want).any(1).nonzero().flatten()
    assert bad.numel() == 0, f"token ids differ in {bad.numel()} rows, first {bad[:4].tolist()}"


@pytest.mark.cuda
def test_cuda_graph_replay_equals_eager():
    """The four Triton stages capture into one CUDA graph (no host sync) and replay bit-exactly."""
    from inductor_ext import ops

    c = _cuda_case([700, 333, 1], 32, seed=2)
    dev = {k: (v.cuda() if isinstance(v, torch.Tensor) else v) for k, v in c.items() if k != "rows"}
    rows = [t.cuda() for t in c["rows"]]

    def run():
        pool, scale = ops.kpool_compress(dev["k"], dev["gate"], dev["ape"], dev["pool_token"], mode="fp8_ue8m0")
        q8, w_eff = ops.kpool_quant_query(dev["q"], dev["w"], scale_fmt="ue8m0")
        logits = ops.kpool_logits(q8, w_eff, pool, scale, precision="fp8", layout="compact")
        return ops.kpool_select(logits, *rows, topk=64, pool_size=P, tail="compact")

    eager = run()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = run()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager), "CUDA-graph replay differs from eager"


def _check_rows(ids: torch.Tensor, cu: torch.Tensor, topk: int) -> None:
    """Vectorised selection invariants (compact tail): every id causal and in the query's
    document, no duplicates, -1 only as trailing padding, the visible incomplete pool present."""
    T = ids.shape[0]
    t = torch.arange(T)[:, None]
    bos = cu[torch.searchsorted(cu, torch.arange(T), right=True) - 1][:, None]
    valid = ids >= 0
    assert ((ids <= t) & (ids >= bos) | ~valid).all(), "future or other-document token"
    assert (valid.int().diff(dim=1) <= 0).all(), "-1 before a selected id (compact tail)"
    assert ((ids.diff(dim=1) > 0) | ~valid[:, 1:]).all(), "ids not ascending (compact tail)"
    srt = ids.sort(1).values
    assert not ((srt[:, 1:] == srt[:, :-1]) & (srt[:, 1:] >= 0)).any(), "duplicate token"
    tail_start = bos + P * ((t - bos + 1) // P)
    in_tail = (ids >= tail_start) & valid
    assert torch.equal(in_tail.sum(1, keepdim=True), t + 1 - tail_start), "tail is not the visible incomplete pool"
    want = torch.clamp((t - bos + 1) // P, max=topk // P) * P + (t + 1 - tail_start)
    assert torch.equal(valid.sum(1, keepdim=True), want), "wrong number of selected tokens"


def _stages(k, gate, w, q, ape, cu, kpool, topk):
    """``kpool_indexer``'s stages after the projections (one scoring chunk) on the tensors'
    device: (pool scores, selected token ids)."""
    from inductor_ext import ops

    T = q.shape[0]
    pool_token, q_lo, q_n, tail_start, tail_len = ops.kpool_layout(cu, T, P)
    if kpool == "bf16":
        pool, scale = ops.kpool_compress(k.bfloat16(), gate.bfloat16(), ape, pool_token, mode="bf16_fp32")
        q = q.bfloat16()
    else:
        pool, scale = ops.kpool_compress(k, gate, ape, pool_token, mode="fp8_ue8m0")
        q, w = ops.kpool_quant_query(q, w, scale_fmt="ue8m0")
    logits = ops.kpool_logits(q, w, pool, scale, precision=kpool, layout="compact")
    return logits, ops.kpool_select(logits, q_lo, q_n, tail_start, tail_len, topk=topk, pool_size=P, tail="compact")


def _near_tie_rows(got, want, logits, cu, topk, tol):
    """Rows whose CUDA and CPU pool picks differ only by pools scored within ``tol`` of the row's
    CPU threshold (the lowest CPU-selected score): what scores equal within the score contract
    may order differently. Returns (differing rows, of which near ties)."""
    T = got.shape[0]
    _, q_lo, q_n, _, _ = ref.layout_reference(cu, T, P)
    bos = cu[torch.searchsorted(cu, torch.arange(T), right=True) - 1]
    differ = (got.sort(1).values != want.sort(1).values).any(1).nonzero().flatten().tolist()
    ties = 0
    for r in differ:
        n = min(int(q_n[r]), topk // P)
        slots = [set(((ids[r, : n * P: P].long() - bos[r]) // P + q_lo[r]).tolist()) for ids in (got, want)]
        thr = logits[r, sorted(slots[1])].min()
        ties += all(abs(logits[r, s] - thr) <= tol for s in slots[0] ^ slots[1])
    return len(differ), ties


@pytest.mark.cuda
@pytest.mark.parametrize("kpool", ["bf16", "fp8"])
def test_cuda_packed_end_to_end(kpool):
    """The h200 indexer's size: packed documents (8195, 8189), 32 heads, head dim 128, top-k 2048: the
    whole ``kpool_indexer`` runs on CUDA, its selection invariants hold, and it equals the CPU
    reference kernels run from the same (CUDA) projections — the GEMMs before the pooling round
    differently on each device, which no kernel contract covers. Where token sets differ, every
    pool in the difference scores (CPU) within 2·tol·max|score| of the row's selection threshold
    (tol: the score contract, 1e-6 BF16, 1e-3 FP8): a near-tie that scores equal within the
    contract may order either way (FP8 scores are coarse, exact ties are common, and the FP8
    tensor cores' sums round them apart). Counted and printed."""
    from inductor_ext import ops

    hidden, q_rank, heads, topk = 512, 256, 32, 2048
    g = torch.Generator().manual_seed(5)
    rnd = lambda *s, std=0.05: (torch.randn(*s, generator=g) * std).bfloat16().cuda()  # noqa: E731
    wq_b, wk, proj, gate_w = rnd(heads * 128, q_rank), rnd(128, hidden), rnd(heads, hidden), rnd(128, hidden)
    norm_w, norm_b = torch.ones(128, device="cuda"), torch.zeros(128, device="cuda")
    ape = torch.randn(P, 128, generator=g).cuda()
    cu = torch.tensor([0, 8195, 8195 + 8189], dtype=torch.int64, device="cuda")
    T = int(cu[-1])
    x, q_resid = rnd(T, hidden, std=1.0), rnd(T, q_rank, std=1.0)
    got = ops.kpool_indexer(x, q_resid, wq_b, wk, norm_w, norm_b, proj, gate_w, ape, cu, topk=topk, pool_size=P,
                            kpool=kpool, kpool_pooling="fp32", head_proj="fp32").cpu()
    k, gate, w = ops.kpool_project(x, wk, norm_w, norm_b, proj, gate_w, head_proj="fp32")  # as the composite
    q = torch.nn.functional.linear(q_resid, wq_b).view(T, heads, 128)
    cu = cu.cpu()
    logits, want = _stages(k.cpu(), gate.cpu(), w.cpu(), q.cpu(), ape.cpu(), cu, kpool, topk)
    _check_rows(got, cu, topk)
    differ, ties = _near_tie_rows(got, want, logits, cu, topk, tol=2 * SCORE_TOL[kpool] * logits.abs().max().item())
    print(f"\n[kpool {kpool} packed (8195, 8189), H=32, top-k 2048] token sets differ in {differ} of "
          f"{got.shape[0]} rows, {ties} of them near-ties")
    assert ties == differ, f"{differ - ties} rows differ beyond a near-tie"


# ---------------------------------------------------------------------------------------------
# selection kernel paths (interpreter): resident blocks, long rows, ties, special scores
# ---------------------------------------------------------------------------------------------


def _lower_first_ids(logits, q_lo, q_n, tail_start, tail_len, topk, tail):
    """The exact output, written independently of the reference: the top pools (lower pool first
    among equal scores, -0.0 = +0.0) in ascending pool order, their tokens, the tail, -1 padding."""
    width = topk + P - 1
    out = torch.full((logits.shape[0], width), -1, dtype=torch.int32)
    K = min(topk // P, logits.shape[1])
    for t in range(logits.shape[0]):
        lo, n, ts, tl_ = (int(x[t]) for x in (q_lo, q_n, tail_start, tail_len))
        nsel = min(n, K)
        vals = logits[t, lo : lo + n].tolist()
        order = sorted(sorted(range(n), key=lambda j: (-vals[j], j))[:nsel])
        doc_start = ts - P * n
        ids = [doc_start + P * j + i for j in order for i in range(P)]
        out[t, : len(ids)] = torch.tensor(ids, dtype=torch.int32)
        base = nsel * P if tail == "compact" else topk
        out[t, base : base + P - 1] = torch.tensor([ts + i if i < tl_ else -1 for i in range(P - 1)], dtype=torch.int32)
    return out


def _check_select(kt, logits, rows, topk, tail):
    got = kt.kpool_select_fwd(logits, *rows, topk, P, tail)
    want = _lower_first_ids(logits, *rows, topk, tail)
    bad = (got != want).any(1).nonzero().flatten()
    assert bad.numel() == 0, f"rows {bad.tolist()[:8]} differ: {got[bad[:1]].tolist()} vs {want[bad[:1]].tolist()}"
    assert torch.equal(ref.select_reference(logits, *rows, topk, P, tail), want), "the reference differs"


def _special_scores(T, S, seed):
    """Continuous scores per row, then rows of: all equal, few distinct values (ties straddling
    the cut), +-0.0 with +inf and -3e38 mixed in, only negative (-inf in 9 of 10 slots: -inf ties
    straddle the cut of short rows), huge and tiny magnitudes."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, S, generator=g)
    kind = torch.arange(T) % 7
    x[kind == 1] = 0.75
    x[kind == 2] = torch.randint(-2, 3, (int((kind == 2).sum()), S), generator=g).float()
    signed_zero = torch.randint(0, 2, (int((kind == 3).sum()), S), generator=g).bool()
    x[kind == 3] = torch.where(signed_zero, torch.tensor(-0.0), torch.tensor(0.0))
    x[kind == 3, ::5] = float("inf")
    x[kind == 3, 1::7] = -3e38  # not -inf: the reference masks invisible slots with -inf
    x[kind == 4] = -x[kind == 4].abs() - 1.0
    x[(kind == 4)[:, None] & (torch.arange(S) % 10 != 0)] = float("-inf")
    x[kind == 5] = x[kind == 5] * 1e30
    x[kind == 6] = x[kind == 6] * 1e-40  # subnormals
    return x


@pytest.mark.parametrize("tail", ["compact", "fixed"])
def test_select_special_scores_exact(kt, tail):
    """Rows up to 90 pools (one and two resident block sizes), topk 40 (10 pools): every row equals
    the lower-index-first ranking, including all-equal rows and tie groups straddling the cut."""
    T, layout = _layout([362, 41, 9])
    pick = torch.cat((torch.arange(0, T, 5), torch.tensor([3, 4, 361, 362, 363, T - 1])))  # all 7 kinds
    logits = _special_scores(T, T // P, seed=3)[pick]
    _check_select(kt, logits, tuple(r[pick] for r in layout[1:]), 40, tail)


def test_select_long_rows_reread(kt, monkeypatch):
    """Rows longer than the largest resident block (shrunk to 64 pools) re-read the rest on every
    pass; ties straddling the cut there too."""
    ksel = importlib.import_module("inductor_ext.kernels.kpool.select")
    monkeypatch.setattr(ksel, "MAX_BLOCK", 64)
    T, layout = _layout([803, 130])
    logits = _special_scores(T, T // P, seed=4)
    pick = torch.arange(T - 1, 0, -11)[:50]  # q_n 32 .. 2, then 200 .. 98; all 7 kinds
    rows = tuple(r[pick] for r in layout[1:])
    _check_select(kt, logits[pick], rows, 48, "compact")
    long = slice(12, 24)  # q_n 200 .. 172, nsel 70 > block
    _check_select(kt, logits[pick[long]], tuple(r[long] for r in rows), 4 * 70, "fixed")


@pytest.mark.cuda
@pytest.mark.parametrize("pools,topk", [(5000, 2048), (5000, 8192), (33000, 2048)], ids=["warps4", "kp2048", "reread"])
def test_cuda_select_wide_rows_exact(pools, topk):
    """Compiled paths the small cases miss: rows past one warp's 4096 resident pools (several warps),
    2048 selected pools, rows past the largest resident block. Exact lower-index-first output on
    sampled rows of one long document, special scores included."""
    from inductor_ext import ops

    T, layout = _layout([P * pools + 3])
    pick = torch.cat((torch.arange(T - 1, T - 8, -1), torch.arange(0, T, T // 41)))
    rows = tuple(r[pick] for r in layout[1:])
    logits = _special_scores(len(pick), pools, seed=9)
    got = ops.kpool_select(logits.cuda(), *(r.cuda() for r in rows), topk=topk, pool_size=P, tail="compact").cpu()
    want = _lower_first_ids(logits, *rows, topk, "compact")
    bad = (got != want).any(1).nonzero().flatten()
    assert bad.numel() == 0, f"rows {bad.tolist()[:8]} differ (q_n {rows[1][bad[:8]].tolist()})"
