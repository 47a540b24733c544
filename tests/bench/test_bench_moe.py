"""inductor_ext.bench.moe on CPU: the no-GPU error and the markdown rendering (timing runs on the H200)."""

import pytest
import torch

from inductor_ext.bench.moe import bench_moe_act, format_moe_act
from tests.support.bench import moe_result, moe_row, moe_targets


def test_needs_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match="bench moe needs a CUDA device"):
        bench_moe_act(tokens=256, hidden=128, inter=128, samples=2)


def test_format_renders_a_result():
    text = format_moe_act(moe_result())
    lines = text.splitlines()
    table = [line for line in lines if line.startswith("| ")]
    assert len(table) == 2 + 4, text  # header, separator, one row per variant
    assert table[0].startswith("| variant | what | kernels | MB moved")
    fused = next(line for line in table if line.startswith("| aligned_fused "))
    assert "| ? |" in fused and "| 1.04 |" in fused and "50.0 / 55.0" in fused and "| 40.0 |" in fused, fused
    assert "| 86 % |" in fused, fused  # back to back: 1.7 x 50.3 %
    expert = next(line for line in table if line.startswith("| expert_input_fp8_qdq "))
    assert "| – |" in expert and "| 84 % |" in expert, expert
    assert "(one call per replay): aligned_fused ≤ 1.1× plain BF16 SwiGLU: 1.04× (met)" in text, text
    assert "50 % (NOT met)" in text and "(10 calls back to back)" in text and "86 % (met)" in text, text
    assert "LMDeploy peers skipped" in text


def test_format_judges_targets_only_at_8192_tokens():
    act = 2048 * 2048 * 2
    result = {
        "tokens": 2048, "hidden": 4096, "inter": 2048, "samples": 50, "limit": 10.0, "lmdeploy_peer": True,
        "copy_gbps": 1200.0,
        "rows": [moe_row("copy", "activation", 27.0, 4 * act, 1, 1.0, 100.0),
                 moe_row("aligned_fused", "activation", 20.0, 3 * act, 1, 0.75, 99.0)],
        "targets": moe_targets(0.75, 99.0, judged=False),
        "bytes_note": "counted at kernel boundaries",
    }
    text = format_moe_act(result)
    assert "met" not in text.replace("not judged", ""), text
    assert "0.75× (not judged)" in text and "stated at 8192 tokens; at 2048" in text, text
