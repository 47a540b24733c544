"""The command line: report writes its three artifacts, doctor answers, bench runs the registry
with ``bench layer``'s own flags, bad use exits 2."""

import json
import subprocess
import sys

import pytest
import torch

from inductor_ext.__main__ import main
from inductor_ext.bench import BENCHES, Benchmark, run_benches
from inductor_ext.bench.layer import format_layer
from tests.support.bench import layer_result


def test_doctor_lists_backends_and_kernels(capsys):
    assert main(["doctor"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert {"triton", "fla", "tilelang", "lmdeploy"} <= info.keys()
    assert "kda_chunk[fp32]" in info["kernels"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU error")
@pytest.mark.parametrize("argv", [["bench", "kda"], ["report", "--device", "cuda"],
                                  ["bench", "layer", "--tokens", "64", "--kinds", "kda"]])
def test_cuda_only_commands_fail_in_one_line(argv, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: no CUDA device")


def test_bad_flag_exits_2():
    result = subprocess.run([sys.executable, "-m", "inductor_ext", "bench", "everything"], capture_output=True,
                            text=True)
    assert result.returncode == 2 and "invalid choice" in result.stderr


def test_bench_help_lists_every_benchmark_and_the_layer_flags(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["bench", "--help"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    assert "{" + ",".join((*BENCHES, "all")) + "}" in out and "{kda,kpool,moe,layer," in out
    for flag in ("--out", "--tokens", "--samples", "--kinds", "--attn-impl", "--precision", "--timing-only"):
        assert flag in out, flag


@pytest.mark.parametrize("argv", [["bench", "layer", "--kinds", "mla"], ["bench", "layer", "--precision", "fp8"],
                                  ["bench", "layer", "--attn-impl", "sdpa"]])
def test_bad_layer_flag_exits_2(argv, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2 and "invalid choice" in capsys.readouterr().err


def test_layer_flags_on_another_benchmark_fail_in_one_line(capsys):
    assert main(["bench", "kda", "--kinds", "kda"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "options of `bench layer`, not `bench kda`" in err[0]


def test_bench_layer_passes_its_flags_and_writes_after_each_kind(tmp_path, monkeypatch, capsys):
    """``bench layer`` with a stand-in layer benchmark (no GPU): the flags reach it, bench.json and
    bench.md are written after the partial result and again after the whole one."""
    calls, partial_files = [], []
    full = layer_result()

    def run(**kw):
        calls.append(kw)
        kw["on_partial"]({**full, "rows": full["rows"][:1]})
        partial_files.append(json.loads((tmp_path / "bench.json").read_text()))
        return full

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setitem(BENCHES, "layer", Benchmark("Whole layers", run, format_layer, samples=20))
    argv = ["bench", "layer", "--out", str(tmp_path), "--tokens", "64", "--kinds", "kda", "--attn-impl", "eager",
            "--precision", "reference", "--timing-only"]
    assert main(argv) == 0
    (kw,) = calls
    assert {k: v for k, v in kw.items() if k not in ("progress", "on_partial")} == {
        "samples": 20, "tokens": 64, "kinds": ["kda"], "attn_impl": "eager", "precision": "reference",
        "timing_only": True}
    assert partial_files == [{"layer": {**full, "rows": full["rows"][:1]}}]
    assert json.loads((tmp_path / "bench.json").read_text()) == {"layer": full}
    md = (tmp_path / "bench.md").read_text()
    assert md.startswith("### Whole layers\n") and "| dsa (flex) | fwd_bwd |" in md
    out = capsys.readouterr().out
    assert "| kda | fwd | reduce-overhead |" in out and f"wrote {tmp_path}/bench.json, bench.md" in out
    calls.clear()
    assert main(["bench", "layer", "--out", str(tmp_path), "--samples", "30"]) == 0
    assert calls[0]["samples"] == 30 and "kinds" not in calls[0] and "tokens" not in calls[0]


def test_run_benches_rejects_unknown_names():
    with pytest.raises(ValueError, match="unknown benchmark"):
        run_benches(("kda", "attention"))


def test_report_writes_json_markdown_png(tmp_path, monkeypatch):
    # the report's mismatch table compiles nine arms with Inductor (its default, minutes on 2 cores);
    # its files are checked here with aot_eager, the Inductor run by tests/report/test_mismatch.py
    from inductor_ext.report import MismatchSettings
    from inductor_ext.report import report as report_module

    run = report_module.run_mismatch
    monkeypatch.setattr(report_module, "run_mismatch",
                        lambda settings=None, **kw: run(settings or MismatchSettings(compile="aot_eager"), **kw))
    assert main(["report", "--device", "cpu", "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "report.json").read_text())
    assert (tmp_path / "report.md").read_text().startswith("# glm53-inductor report")
    assert (tmp_path / "report.png").read_bytes()[:4] == b"\x89PNG"
    rows = {(r["inputs"], r["precision"]): r for r in report["kda_accuracy"]}
    assert rows[("fp32", "fp32")]["o"] < 1e-5 and rows[("fp32", "bf16")]["o"] > 1e-3
    assert all(r["graph_breaks"] == 0 and not r["recompiled_on_repeat"] for r in report["kda_compile"])
    layers = report["layers_compile"]
    assert {(r["kind"], r["precision"]) for r in layers} == {
        (k, p) for k in ("kda", "dsa") for p in ("reference", "serving_aligned")}
    assert all(r["graph_breaks"] == 0 and not r["recompiled_on_repeat"] for r in layers)
    assert [r["frames_total"] for r in layers] == [1, 2, 1, 2], "one compile per config"
