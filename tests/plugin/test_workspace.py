"""inductor_ext.workspace: the MQA logits workspace planner (DESIGN §4, DeepGEMM layouts)."""

import itertools

import pytest
import torch

from inductor_ext import workspace


def test_design_example_legacy_1mib():
    # 4096 tokens, 1024 pools, 32 heads, legacy layout, 1 MiB
    assert workspace.mqa_logits_stride(1024, "legacy") == 1280
    assert workspace.mqa_logits_bytes(256, 1024, 32, "legacy") == 1_310_720
    rows = workspace.score_chunk_rows(4096, 1024, 32, "legacy", 2**20)
    assert rows == 204, f"chunk rows: {rows}"
    assert workspace.mqa_logits_bytes(rows, 1024, 32, "legacy") == 1_044_480 <= 2**20


@pytest.mark.parametrize("pools,compact,legacy", [(0, 0, 256), (1, 256, 320), (255, 256, 512),
                                                  (256, 256, 512), (1000, 1024, 1280), (1025, 1280, 1344)])
def test_strides(pools, compact, legacy):
    assert workspace.mqa_logits_stride(pools, "compact") == compact, "compact = align(N, 256)"
    assert workspace.mqa_logits_stride(pools, "legacy") == legacy, "legacy = align(N + 256, 64)"


@pytest.mark.parametrize("heads,bq", [(32, 4), (64, 2), (128, 1)])
def test_rows_padded_to_bq(heads, bq):
    stride = workspace.mqa_logits_stride(100, "compact")
    for m in range(0, 9):
        expected = -(-m // bq) * bq * stride * 4
        assert workspace.mqa_logits_bytes(m, 100, heads, "compact") == expected, f"M={m}"


def test_chunk_is_largest_fit_and_multiple_of_bq():
    budgets = [4096, 60_000, 2**20, 3 * 2**20 + 17]
    for heads, layout, pools, budget in itertools.product((32, 64, 128), workspace.LAYOUTS,
                                                          (1, 255, 1024, 3001), budgets):
        bq = 128 // heads
        row_bytes = workspace.mqa_logits_stride(pools, layout) * 4
        if row_bytes * bq > budget:
            with pytest.raises(ValueError, match="budget_bytes"):
                workspace.score_chunk_rows(10_000, pools, heads, layout, budget)
            continue
        m = workspace.score_chunk_rows(10_000, pools, heads, layout, budget)
        case = f"H={heads} {layout} N={pools} budget={budget}: M={m}"
        assert m % bq == 0, case
        assert workspace.mqa_logits_bytes(m, pools, heads, layout) <= budget, case
        assert workspace.mqa_logits_bytes(m + 1, pools, heads, layout) > budget, case
        # fewer rows than fit: one chunk of all rows, even if not a multiple of bq
        few = max(m - 1, 1) if m > 1 else 1
        assert workspace.score_chunk_rows(few, pools, heads, layout, budget) == few, case
    assert workspace.score_chunk_rows(0, 64, 32, "compact", 2**20) == 0


def test_plan_allocates_padded_storage_and_strided_view():
    plan = workspace.LogitsPlan(4096, 1024, 32, "legacy", 2**20)
    assert plan.chunk_rows == 204 and plan.chunk_bytes == 1_044_480
    assert plan.chunks[0] == (0, 204) and plan.chunks[-1] == (4080, 4096) and len(plan.chunks) == 21
    for rows in (204, 16, 7):  # 7 rows: padded to 8 (bq = 4)
        view = plan.allocate(rows)
        assert view.shape == (rows, 1024) and view.stride() == (1280, 1) and view.dtype == torch.float32
        nbytes = view.untyped_storage().nbytes()
        assert nbytes == workspace.mqa_logits_bytes(rows, 1024, 32, "legacy"), f"rows={rows}: {nbytes}"


@pytest.mark.parametrize("call,match", [
    (lambda: workspace.mqa_row_block(16), "heads must be one of"),
    (lambda: workspace.mqa_logits_bytes(4, 10, 48, "compact"), "heads must be one of"),
    (lambda: workspace.mqa_logits_stride(10, "paged"), "layout must be one of"),
    (lambda: workspace.mqa_logits_bytes(-1, 10, 32, "compact"), "rows must be >= 0"),
    (lambda: workspace.score_chunk_rows(8, 10, 32, "compact", 0), "budget_bytes must be >= 1"),
    (lambda: workspace.score_chunk_rows(8, 10, 32, "compact", 100), "below one block"),
    (lambda: workspace.score_chunk_rows(8.0, 10, 32, "compact", 2**20), "rows must be an int"),
])
def test_bad_input_raises(call, match):
    with pytest.raises(ValueError, match=match):
        call()
