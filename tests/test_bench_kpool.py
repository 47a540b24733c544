"""inductor_ext.bench_kpool on CPU: the no-GPU error, issue 3's target verdicts and the markdown
rendering (timing runs on the H200)."""

import pytest
import torch

from inductor_ext.bench_kpool import bench_kpool, format_kpool, kpool_targets


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only error")
def test_needs_cuda():
    with pytest.raises(ValueError, match="needs a CUDA device"):
        bench_kpool(tokens=64)


def _row(heads, precision, score_us, select_us, fraction):
    stage = lambda us: {"p50_us": us, "max_us": us + 1}  # noqa: E731
    row = {"tokens": 16384, "heads": heads, "precision": precision, "score": stage(score_us),
           "select": stage(select_us), "total": stage(score_us + select_us), "score_tflops": 1400 * fraction,
           "score_fraction_of_scaled_mm": fraction, "select_over_score": select_us / score_us}
    for name in ("project", "layout", "compress"):
        row[name] = stage(10.0)
    return row


def test_targets_and_table():
    result = {"scaled_mm_tflops": 1400.0,
              "rows": [_row(32, "bf16", 920.0, 400.0, 0.42), _row(32, "fp8", 560.0, 139.0, 0.50),
                       _row(64, "fp8", 1000.0, 251.0, 0.49)]}
    verdicts = [(t["heads"], t["precision"], t["target"][:6], t["met"]) for t in kpool_targets(result)]
    assert verdicts == [(32, "bf16", "select", False), (32, "fp8", "score ", True), (32, "fp8", "select", True),
                        (64, "fp8", "score ", False), (64, "fp8", "select", False)]
    text = format_kpool(result)
    assert "| 32 | fp8 | 10 / 11 | 10 / 11 | 10 / 11 | – | 560 / 561 | 139 / 140 |" in text
    assert "Target score >= 0.50 of scaled_mm, H=32 fp8: 0.50 (met)" in text
    assert "Target select <= 0.25 of score, H=64 fp8: 0.25 (NOT met)" in text
