"""inductor_ext.bench_moe on CPU: the no-GPU error and the markdown rendering (timing runs on the H200)."""

import pytest
import torch

from inductor_ext.bench_moe import bench_moe_act, format_moe_act


def test_needs_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match="bench moe needs a CUDA device"):
        bench_moe_act(tokens=256, hidden=128, inter=128, samples=2)


def _row(name, group, us, nbytes, kernels, vs_plain, pct_copy):
    """A row whose back-to-back figures are 0.8x the time (1.25x the bandwidth) of the single-call ones."""
    b2b = us * 0.8
    return {"name": name, "group": group, "what": f"{name} what", "kernels": kernels, "bytes": nbytes,
            "p50_us": us, "max_us": us * 1.1, "samples": 50, "gbps": nbytes / (us * 1e-6) / 1e9,
            "vs_plain": vs_plain, "pct_copy": pct_copy, "b2b_p50_us": b2b, "b2b_max_us": b2b * 1.1,
            "b2b_gbps": nbytes / (b2b * 1e-6) / 1e9, "b2b_vs_plain": vs_plain, "b2b_pct_copy": pct_copy * 1.7}


def _targets(vs_plain, pct_copy, judged=True):
    return {"judged": judged, "fused_vs_plain": vs_plain, "fused_vs_plain_ok": vs_plain <= 1.1,
            "fused_pct_copy": pct_copy, "fused_pct_copy_ok": pct_copy >= 80, "b2b_fused_vs_plain": vs_plain,
            "b2b_fused_vs_plain_ok": vs_plain <= 1.1, "b2b_fused_pct_copy": pct_copy * 1.7,
            "b2b_fused_pct_copy_ok": pct_copy * 1.7 >= 80}


def test_format_renders_a_result():
    act = 8192 * 2048 * 2
    result = {
        "tokens": 8192, "hidden": 4096, "inter": 2048, "samples": 50, "limit": 10.0, "device": "fake H200",
        "torch": "2.x", "lmdeploy_peer": False, "copy_gbps": 4000.0,
        "rows": [_row("copy", "activation", 33.5, 4 * act, 1, 0.7, 100.0),
                 _row("plain_bf16", "activation", 48.0, 3 * act, 1, 1.0, 52.0),
                 _row("aligned_fused", "activation", 50.0, 3 * act, None, 1.04, 50.3),
                 _row("expert_input_fp8_qdq", "expert_input", 40.0, 2 * 8192 * 4096 * 2, 1, None, 84.0)],
        "targets": _targets(1.04, 50.3),
        "bytes_note": "counted at kernel boundaries",
    }
    text = format_moe_act(result)
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
        "rows": [_row("copy", "activation", 27.0, 4 * act, 1, 1.0, 100.0),
                 _row("aligned_fused", "activation", 20.0, 3 * act, 1, 0.75, 99.0)],
        "targets": _targets(0.75, 99.0, judged=False),
        "bytes_note": "counted at kernel boundaries",
    }
    text = format_moe_act(result)
    assert "met" not in text.replace("not judged", ""), text
    assert "0.75× (not judged)" in text and "stated at 8192 tokens; at 2048" in text, text


def test_capture_rejects_zero_calls():
    from inductor_ext import timing

    with pytest.raises(ValueError, match="calls must be >= 1"):
        timing.capture(lambda: None, calls=0)
