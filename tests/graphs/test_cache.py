"""Cross-process Inductor cache: compile the tiny KDA layer (inductor, forward; forward + backward
in-graph is covered by the aot_eager matrix) under config A in one process, then under config B in
a fresh process sharing TORCHINDUCTOR_CACHE_DIR. B must produce B's results, not A's cached graph's.
Two cold Inductor compiles on a 2-core CPU: the slowest test of the set (~40-100 s)."""

import os
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = r"""
import sys, torch
import inductor_ext
from graphs import DecoderLayer, GLM53Config
from graphs.modules import cast_model
from inductor_ext import PrecisionConfig

inductor_ext.enable()
prec = PrecisionConfig.reference() if sys.argv[1] == "A" else PrecisionConfig.serving_aligned()
torch.manual_seed(0)
cfg = GLM53Config.tiny()
layer = cast_model(DecoderLayer(cfg, 0, precision=prec), torch.bfloat16)
x = torch.randn(64, cfg.hc_mult, cfg.hidden_size, dtype=torch.bfloat16)
cu = torch.tensor([0, 40, 64])
with torch.no_grad():
    eager = layer(x, cu)[0]
    compiled = torch.compile(layer, backend="inductor", fullgraph=True)(x, cu)[0]
torch.save({"eager": eager, "compiled": compiled}, sys.argv[2])
"""


def _run(tag, cache_dir, out):
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(cache_dir), PYTHONPATH=str(ROOT))
    env.pop("TORCHINDUCTOR_FORCE_DISABLE_CACHES", None)
    proc = subprocess.run([sys.executable, "-c", SCRIPT, tag, str(out)], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"process {tag} failed:\n{proc.stderr[-4000:]}"
    return torch.load(out)


def test_config_b_in_a_fresh_process_gets_b_results(tmp_path):
    cache = tmp_path / "inductor_cache"
    a = _run("A", cache, tmp_path / "a.pt")
    assert any(cache.rglob("*")), "process A populated the Inductor cache"
    b = _run("B", cache, tmp_path / "b.pt")
    # Inductor fuses BF16 pointwise chains in FP32 (fewer roundings): compare at BF16 tolerance
    torch.testing.assert_close(a["compiled"], a["eager"], rtol=2e-2, atol=2e-2, msg=lambda m: f"A: {m}")
    torch.testing.assert_close(b["compiled"], b["eager"], rtol=2e-2, atol=2e-2, msg=lambda m: f"B: {m}")
    assert not torch.equal(a["eager"], b["eager"]), "A and B configs must give different results"
    err_to_b = (b["compiled"].float() - b["eager"].float()).norm()
    err_to_a = (b["compiled"].float() - a["eager"].float()).norm()
    assert err_to_b < err_to_a, f"B's compiled output is closer to A ({err_to_a:.4g}) than to B ({err_to_b:.4g})"
