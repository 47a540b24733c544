"""inductor_ext.bench.kpool on CPU: the no-GPU error, the speed-target verdicts and the markdown
rendering (timing runs on the H200)."""

import pytest
import torch

from inductor_ext.bench.kpool import bench_kpool, format_kpool, kpool_targets
from tests.support.bench import kpool_result


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only error")
def test_needs_cuda():
    with pytest.raises(ValueError, match="needs a CUDA device"):
        bench_kpool(tokens=64)


def test_targets_and_table():
    result = kpool_result()
    verdicts = [(t["heads"], t["precision"], t["target"][:6], t["met"]) for t in kpool_targets(result)]
    assert verdicts == [(32, "bf16", "select", False), (32, "fp8", "score ", True), (32, "fp8", "select", True),
                        (64, "fp8", "score ", False), (64, "fp8", "select", False)]
    text = format_kpool(result)
    assert "| 32 | fp8 | 10 / 11 | 10 / 11 | 10 / 11 | – | 560 / 561 | 139 / 140 |" in text
    assert "Target score >= 0.50 of scaled_mm, H=32 fp8: 0.50 (met)" in text
    assert "Target select <= 0.25 of score, H=64 fp8: 0.25 (NOT met)" in text
