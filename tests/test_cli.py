"""The command line: report writes its three artifacts, doctor answers, bad use exits 2."""

import json
import subprocess
import sys

import pytest
import torch

from inductor_ext.__main__ import main


def test_doctor_lists_backends_and_kernels(capsys):
    assert main(["doctor"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert {"triton", "fla", "tilelang", "deep_gemm", "lmdeploy"} <= info.keys()
    assert "kda_chunk[fp32]" in info["kernels"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU error")
@pytest.mark.parametrize("argv", [["bench", "kda"], ["report", "--device", "cuda"]])
def test_cuda_only_commands_fail_in_one_line(argv, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: no CUDA device")


def test_bad_flag_exits_2():
    result = subprocess.run([sys.executable, "-m", "inductor_ext", "bench", "everything"], capture_output=True, text=True)
    assert result.returncode == 2 and "invalid choice" in result.stderr


def test_run_benches_rejects_unknown_names():
    from inductor_ext.bench import run_benches

    with pytest.raises(ValueError, match="unknown benchmark"):
        run_benches(("kda", "attention"))


def test_report_writes_json_markdown_png(tmp_path):
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
