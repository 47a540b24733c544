"""``inductor_ext.bench.layer`` on CPU: the CUDA-only entry point refuses in one ValueError, bad
arguments are refused, the markdown table renders, and the whole code path runs end to end on the
tiny preset through ``aot_eager`` (the same steps as on the H200 but for the capture itself),
including the fall-back from a failing reduce-overhead run to a manual capture and the partial
results after each kind."""

import pytest
import torch

from inductor_ext.bench import layer as bl
from tests.support.bench import layer_result


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU error")
def test_needs_cuda():
    with pytest.raises(ValueError, match="bench layer needs a CUDA device"):
        bl.bench_layer(tokens=64)


@pytest.mark.parametrize("kw, match", [({"tokens": 4}, "tokens"), ({"kinds": ("mla",)}, "kinds"),
                                       ({"samples": 0}, "samples"), ({"precision": "fp8"}, "precision")])
def test_bad_arguments(kw, match):
    args = {"tokens": 64, "kinds": ("kda",), "samples": 1, "precision": "serving_aligned"} | kw
    setup = bl._Setup(device="cpu", preset="tiny", backend="aot_eager", mode=None)
    with pytest.raises(ValueError, match=match):
        bl._check_args(args["tokens"], args["kinds"], args["samples"], setup, args["precision"])


def test_format_layer_renders_rows_errors_and_fallbacks():
    table = bl.format_layer(layer_result())
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
    messages, partials = [], []
    result = bl._bench(32, ("kda", "dsa"), 2, messages.append,
                       bl._Setup(device="cpu", preset="tiny", backend="aot_eager", mode=None, attn_impl="eager",
                                 catch=False), on_partial=partials.append)
    assert [[(r["kind"], r["variant"]) for r in p["rows"]] for p in partials] == [
        [("kda", v) for v in bl.VARIANTS], [(k, v) for k in bl.KINDS for v in bl.VARIANTS]]
    assert partials[-1] == result  # after each kind: the result so far
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
def test_dry_run_timing_only_skips_the_checks():
    messages = []
    result = bl._bench(32, ("kda",), 2, messages.append,
                       bl._Setup(device="cpu", preset="tiny", backend="aot_eager", mode=None, catch=False,
                                 timing_only=True))
    for r in result["rows"]:
        assert r["error"] is None and r["p50_us"] > 0 and r["samples"] == 2
        assert r["warm_compile_s"] is None and r["equals_eager"] is None and "eager_sensitivity" not in r
        assert r["graphs_compiled"]["cold"] == 1 and r["replay_vs_first"]
    assert not any("eager" in m or "warm compile" in m for m in messages), messages
    table = bl.format_layer(result)
    assert "| kda | fwd | none | 0 | 0 |" in table and "| – |" in table and "not checked (timing only)" in table


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
