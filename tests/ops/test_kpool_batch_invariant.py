"""The KPool indexer under ``PrecisionConfig.batch_invariant`` (CPU; the invariance tests on CUDA
too): the batch-invariant scorer and projections give each row bitwise the same whatever the other
rows of the call (and the scorer whatever the number of pools), stay within FP32 / BF16 rounding of
the plain ops, and a document's ids alone equal its ids inside a pack. A planted scorer whose head sum follows the row count fails
the same check.
"""

import pytest
import torch

from inductor_ext import ops
from inductor_ext.ops import kpool, kpool_pipeline
from inductor_ext.ops import kpool_reference as ref
from inductor_ext.ops.ordered import ordered_sum
from tests.support.batch_invariant import DEVICES, assert_bitwise, check_batch_invariance, rel_l2
from tests.support.kpool import HEADS, D, P, kp_indexer, kp_inputs, kp_params, kp_run

SIZES = range(1, 17)  # rows alone vs inside calls of 1..16 rows, and one shuffled call
BIG = 300


def _scorer_inputs(M=BIG, S=37, precision="bf16", seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(M, HEADS, D, generator=g)
    pool = torch.randn(S, D, generator=g)
    w = torch.randn(M, HEADS, generator=g)
    scale = torch.rand(S, generator=g) + 0.5
    if precision == "bf16":
        return q.bfloat16(), w, pool.bfloat16(), torch.ones(S)
    return (q * 40).to(torch.float8_e4m3fn), w, (pool * 40).to(torch.float8_e4m3fn), scale


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("precision", ["bf16", "fp8"])
def test_scorer_rows_and_columns_are_invariant(precision, device):
    q, w, pool, scale = (t.to(device) for t in _scorer_inputs(precision=precision))

    def score(qr, wr):
        return kpool.kpool_logits_batch_invariant(qr, wr, pool, scale, precision=precision)

    assert check_batch_invariance(score, (q, w), sizes=SIZES, big=BIG) == []
    fewer = kpool.kpool_logits_batch_invariant(q, w, pool[:20], scale[:20], precision=precision)
    assert_bitwise(f"{precision} S=20 of 37", fewer, score(q, w)[:, :20])


@pytest.mark.parametrize("precision", ["bf16", "fp8"])
def test_scorer_matches_the_reference(precision):
    q, w, pool, scale = _scorer_inputs(M=64, precision=precision)
    got = kpool.kpool_logits_batch_invariant(q, w, pool, scale, precision=precision)
    want = ref.logits_reference(q, w, pool, scale, precision, "compact")
    assert got.shape == want.shape and got.is_contiguous()
    assert rel_l2(got, want) <= 1e-6, rel_l2(got, want)
    empty = kpool.kpool_logits_batch_invariant(q, w, pool[:0], scale[:0], precision=precision)
    assert empty.shape == (64, 0)


def _planted_score(q, w, pool):
    """PLANTED: the head sum runs backwards above 8 rows (a row-count-dependent order)."""
    s = torch.relu(ops.bi_linear(q.reshape(-1, D), pool, out_dtype=torch.float32).view(q.shape[0], HEADS, -1)
                   * D**-0.5)
    prods = w[:, :, None] * s
    return ordered_sum(prods if q.shape[0] <= 8 else prods.flip(1), dim=1)


def test_the_check_rejects_a_planted_scorer():
    q, w, pool, _ = _scorer_inputs()

    def check(fn):
        return check_batch_invariance(lambda qr, wr: fn(qr.bfloat16(), wr), (q.float(), w), sizes=SIZES, big=BIG)

    assert check(lambda qr, wr: kpool.kpool_logits_batch_invariant(qr, wr, pool, torch.ones(pool.shape[0]),
                                                                    precision="bf16")) == []
    failures = check(lambda qr, wr: _planted_score(qr, wr, pool))
    assert failures and failures[0].startswith("M=9"), failures


@pytest.mark.parametrize("head_proj", ["model", "fp32"])
def test_projections_are_invariant_and_close_to_kpool_project(head_proj):
    m = kp_indexer(topk=8)
    x, _, _ = kp_inputs([BIG])
    params = kp_params(m)[1:6]

    def project(xr):
        return torch.cat([t.float() for t in kpool.kpool_project_batch_invariant(xr, *params, head_proj=head_proj)], 1)

    assert check_batch_invariance(project, x, sizes=SIZES, big=BIG) == []
    plain = ops.kpool_project(x, *params, head_proj=head_proj)
    for name, a, b in zip(("k", "gate", "w"), kpool.kpool_project_batch_invariant(x, *params, head_proj=head_proj),
                          plain):
        assert a.dtype == b.dtype and a.shape == b.shape
        assert rel_l2(a, b) <= (2e-6 if a.dtype == torch.float32 and head_proj == "fp32" else 1e-2), name


@pytest.mark.parametrize("device", DEVICES)
def test_a_document_alone_selects_the_ids_it_selects_in_a_pack(device):
    m = kp_indexer(topk=8).to(device)
    lengths = [29, 7, 40, 3, 17]
    x, qr, cu = (t.to(device) for t in kp_inputs(lengths))
    packed = kp_run(m, x, qr, cu, batch_invariant=True)
    plain = kp_run(m, x, qr, cu)
    assert packed.shape == plain.shape and (packed == plain).float().mean() > 0.95  # same picks but near-ties
    for d, (bos, eos) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        one = torch.tensor([0, eos - bos], dtype=torch.int64, device=device)
        alone = kp_run(m, x[bos:eos], qr[bos:eos], one, batch_invariant=True)
        assert torch.equal(torch.where(alone >= 0, alone + bos, alone), packed[bos:eos]), f"document {d}"


def test_batch_invariant_scores_in_budget_chunks():
    """1 MiB of [rows, 32 heads, 2048 pools] FP32 products: 4 rows per chunk, 10 chunks for 40 rows,
    the same ids as one chunk."""
    S, M = 2048, 40
    q, w, pool, scale = _scorer_inputs(M=M, S=S)
    layout = [t[-M:] for t in ops.kpool_layout(torch.tensor([0, P * S]), P * S, P)[1:]]

    def select(budget_mb):
        opts = kpool_pipeline.IndexerOptions.resolve(topk=64, pool_size=P, tail="compact", kpool="bf16",
                                                     mqa_layout="compact", logits_budget_mb=budget_mb,
                                                     batch_invariant=True)
        return kpool_pipeline.indexer_score_select(q, w, pool, scale, *layout, opts)

    chunked, whole = select(1), select(64)
    assert torch.equal(chunked, whole) and (whole >= 0).sum() > 0
