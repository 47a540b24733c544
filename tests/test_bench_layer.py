"""``inductor_ext.bench_layer`` on CPU: the CUDA-only entry point refuses in one ValueError, the
comparison helper counts what it says, the markdown table renders, and the whole code path runs
end to end on the tiny preset through ``aot_eager`` (the same steps as on the H200 but for the
capture itself), including the fall-back from a failing reduce-overhead run to a manual capture."""

import pytest
import torch

from inductor_ext import bench_layer as bl


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU error")
def test_needs_cuda():
    with pytest.raises(ValueError, match="bench layer needs a CUDA device"):
        bl.bench_layer(tokens=64)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU error")
def test_command_line_fails_in_one_line(capsys):
    assert bl.main(["--tokens", "64"]) == 2
    assert capsys.readouterr().err.strip() == "error: bench layer needs a CUDA device"


@pytest.mark.parametrize("kw, match", [({"tokens": 4}, "tokens"), ({"kinds": ("mla",)}, "kinds"),
                                       ({"samples": 0}, "samples"), ({"precision": "fp8"}, "precision")])
def test_bad_arguments(kw, match):
    args = {"tokens": 64, "kinds": ("kda",), "samples": 1, "precision": "serving_aligned"} | kw
    setup = bl._Setup(device="cpu", preset="tiny", backend="aot_eager", mode=None)
    with pytest.raises(ValueError, match=match):
        bl._check_args(args["tokens"], args["kinds"], args["samples"], setup, args["precision"])


def test_compare_counts_elements_tokens_and_close():
    expected = torch.ones(4, 2, 8)
    actual = expected.clone()
    actual[1, 0, 3] += 0.5  # one element of token 1 beyond atol 2e-2 + rtol 2e-2
    actual[2] += 1e-3  # within the bound
    stats = bl.compare(actual.bfloat16(), expected)
    assert stats["mismatched"] == 1 and stats["tokens_mismatched"] == 1 and stats["elements"] == 64
    assert not stats["close"] and stats["max_abs"] == pytest.approx(0.5)
    assert stats["max_rel"] == pytest.approx(0.5) and stats["rel_l2"] == pytest.approx(0.5 / 8, rel=1e-2)
    assert bl.compare(expected, expected)["close"]
    assert not bl._within(stats, "kda")  # KDA: 1e-4 of the elements, rel L2 1e-2
    assert bl._within(stats, "dsa")  # DSA: 1/64 of the elements and rel L2 0.0625 (≤ 5 %, ≤ 0.1)
    assert bl._within(bl.compare(expected, expected), "kda")


def test_nudge_ulp_moves_elements_by_at_most_one_ulp():
    from lowerings._rounding import ulp_distance

    x = torch.randn(64, 256).bfloat16()
    x[0, :4] = torch.tensor([0.0, -0.0, float("inf"), float("-inf")])
    y = bl.nudge_ulp(x)
    dist = ulp_distance(y, x)
    assert int(dist.max()) == 1 and torch.equal(y[0, :4].view(torch.int16), x[0, :4].view(torch.int16))
    assert 0.6 < dist.float().mean().item() < 0.73  # two thirds moved
    assert torch.equal(bl.nudge_ulp(x), y)  # seeded
    with pytest.raises(ValueError, match="bfloat16"):
        bl.nudge_ulp(x.float())


def test_sensitivity_criterion():
    """Beyond the fixed bound, a difference within 2x the eager layer's own one-ulp sensitivity
    still equals eager; 3x it does not."""
    e = torch.randn(256, 64)
    sens = bl.compare(e + 0.1 * torch.randn(256, 64), e)
    near = bl.compare(e + 0.15 * torch.randn(256, 64, generator=torch.Generator().manual_seed(1)), e)
    far = bl.compare(e + 0.3 * torch.randn(256, 64, generator=torch.Generator().manual_seed(2)), e)
    assert not bl._within(near, "dsa") and not bl._within(far, "dsa")
    assert bl._within_sensitivity(near, sens) and not bl._within_sensitivity(far, sens)
    assert not bl._within_sensitivity(near, None)
    row = {"eager_sensitivity": sens}
    out = e + 0.15 * torch.randn(256, 64, generator=torch.Generator().manual_seed(1))
    bl._check(row, {"first": {"out": out, "ids": None}, "res_x": {"out": out, "ids": None}, "res_check": (out, None)},
              {"out": e, "ids": None}, "fwd", "dsa", [])
    assert row["equals_eager"] is True and row["equals_eager_by"] == "sensitivity"
    bl._check(row, {"first": {"out": out, "ids": None}, "res_x": {"out": out, "ids": None},
                    "res_check": (e + 0.3 * torch.randn(256, 64), None)}, {"out": e, "ids": None}, "fwd", "dsa", [])
    assert row["equals_eager"] is False and row["equals_eager_by"] is None


def _fake_result():
    base = {"capture": "reduce-overhead", "cudagraph_skips": 0, "graph_breaks": 0, "cold_compile_s": 61.2,
            "warm_compile_s": 4.3, "peak_step_gib": 20.5, "peak_first_gib": 31.0, "eager_peak_gib": 40.2,
            "p50_us": 12340.0, "max_us": 13000.0, "samples": 20, "equals_eager": True, "cudagraph_or_error": True,
            "cudagraphs_recorded": 1}
    dx = {"max_abs": 1e-7, "max_rel": 0.5, "tokens_mismatched": 3, "tokens": 8192}
    return {"device": "NVIDIA H200", "torch": "2.11.0", "tokens": 8192, "samples": 20, "precision": "serving_aligned",
            "preset": "h200", "method": "reduce-overhead", "rows": [
                {**base, "kind": "kda", "variant": "fwd", "attn_impl": None,
                 "vs_eager": {"out": {**dx, "max_abs": 0.01, "tokens_mismatched": 0}}},
                {**base, "kind": "dsa", "variant": "fwd_bwd", "attn_impl": "flex", "capture": "manual",
                 "equals_eager": None, "eager_error": "OutOfMemoryError: CUDA out of memory", "vs_eager": None,
                 "reduce_overhead_error": "[reduce-overhead] RuntimeError: skipping cudagraphs due to cpu device"},
                {"kind": "dsa", "variant": "fwd", "attn_impl": "flex", "error": "[manual] RuntimeError: boom | x"},
            ]}


def test_format_layer_renders_rows_errors_and_fallbacks():
    table = bl.format_layer(_fake_result())
    lines = table.splitlines()
    assert lines[2].startswith("| layer | variant | capture |")
    kda = next(line for line in lines if line.startswith("| kda |"))
    assert "| 61.2 | 4.3 | 20.5 / 31.0 / 40.2 | 12.34 / 13.00 | yes | 1.00e-02 / 5.00e-01 / 0/8192 |" in kda
    fallback = next(line for line in lines if line.startswith("| dsa (flex) | fwd_bwd |"))
    assert "| manual |" in fallback and "n/a (eager: OutOfMemoryError" in fallback
    assert "reduce-overhead failed: [reduce-overhead] RuntimeError: skipping cudagraphs" in fallback
    failed = next(line for line in lines if line.startswith("| dsa (flex) | fwd |"))
    assert "failed" in failed and "boom / x" in failed  # a '|' in an error must not break the table
    assert all(line.count("|") == 13 for line in lines if line.startswith("| "))


@pytest.mark.slow
def test_dry_run_tiny_aot_eager_both_kinds():
    messages = []
    result = bl._bench(32, ("kda", "dsa"), 2, messages.append,
                       bl._Setup(device="cpu", preset="tiny", backend="aot_eager", mode=None, attn_impl="eager",
                                 catch=False))
    assert [(r["kind"], r["variant"]) for r in result["rows"]] == [(k, v) for k in bl.KINDS for v in bl.VARIANTS]
    for r in result["rows"]:
        assert r["error"] is None and r["capture"] == "none"
        assert r["graph_breaks"] == 0 and r["cudagraph_skips"] == 0
        assert r["graphs_compiled"] == {"cold": 1, "warm": 1}
        assert r["equals_eager"] is True and r["equals_eager_by"] == "bound"  # aot_eager: the eager kernels
        assert r["eager_sensitivity"]["rel_l2"] > 0  # the one-ulp nudge reaches the output
        assert r["samples"] == 2 and r["p50_us"] > 0
    bwd = result["rows"][1]["vs_eager"]
    assert bwd["dx"]["max_abs"] == 0.0 and bwd["dparams"]["used"] > 10
    assert result["rows"][2]["vs_eager"]["ids_rows_differ"] == 0
    assert any("cold compile" in m for m in messages) and any("timed steps" in m for m in messages)
    assert "| dsa (eager) | fwd_bwd | none | 0 | 0 |" in bl.format_layer(result)


@pytest.mark.slow
def test_dry_run_falls_back_to_manual_capture(monkeypatch):
    """A reduce-overhead failure (here: raised where cudagraph trees would start a step) is kept in
    the row and the compiled callable is captured manually (a stand-in graph on CPU)."""

    def failing_step_begin():
        raise RuntimeError("skipping cudagraphs due to mutated inputs (simulated)")

    class Graph:
        def __init__(self, fn):
            self.fn = fn

        def replay(self):
            self.fn()

    def capture(fn, warmup=3):
        for _ in range(warmup + 1):
            fn()
        return Graph(fn)

    monkeypatch.setattr(torch.compiler, "cudagraph_mark_step_begin", failing_step_begin)
    monkeypatch.setattr(bl.timing, "capture", capture)
    setup = bl._Setup(device="cpu", preset="tiny", backend="aot_eager", mode=None, attn_impl="eager",
                      captures=("reduce-overhead", "manual"))
    rows = bl._bench(32, ("kda",), 2, lambda m: None, setup)["rows"]
    for r in rows:
        assert r["capture"] == "manual" and r["error"] is None, r
        assert "mutated inputs (simulated)" in r["reduce_overhead_error"]
        assert r["equals_eager"] is True and r["replay_vs_first"]
