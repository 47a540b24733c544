"""Recorded graph signatures (expecttest style): for each layer kind and preset, the op sequence
of the compiled forward and backward graphs under ``PrecisionConfig.reference()`` must equal the
file kept in ``tests/graphs/signatures/``. A change that breaks a graph or swaps a precision path shows
up as a diff. Accept an intended change with ``EXPECTTEST_ACCEPT=1 pytest tests/graphs/test_signatures.py``.
The signatures are recorded with the torch version named in each file's first line."""

import difflib
import os
from pathlib import Path

import pytest
import torch

from tests.support.compile_cases import compile_case

SIGNATURES = Path(__file__).resolve().parent / "signatures"
CASES = [("tiny", "kda"), ("tiny", "dsa"), ("tiny", "model"), ("h200", "kda"), ("h200", "dsa")]


def _version_line() -> str:
    return f"# torch {torch.__version__.split('+')[0]}, PrecisionConfig.reference()\n"


@pytest.mark.parametrize("preset,kind", CASES, ids=[f"{k}_{p}" for p, k in CASES])
def test_graph_signature_matches_recorded(preset, kind):
    actual = _version_line() + compile_case(preset, kind, "reference")["signature"]
    path = SIGNATURES / f"{kind}_{preset}.txt"
    if os.environ.get("EXPECTTEST_ACCEPT") == "1":
        path.write_text(actual)
        return
    assert path.exists(), f"{path} missing: record it with EXPECTTEST_ACCEPT=1"
    expected = path.read_text()
    if expected.splitlines()[0] != actual.splitlines()[0]:
        pytest.skip(f"signatures recorded with {expected.splitlines()[0]!r}, running {actual.splitlines()[0]!r}")
    diff = "".join(difflib.unified_diff(expected.splitlines(True), actual.splitlines(True), str(path), "actual", n=2))
    assert not diff, f"graph signature of {kind}/{preset} changed:\n{diff[:6000]}"


def test_serving_config_changes_the_recorded_signature():
    """The tiny model's reference signature names the reference precision literals."""
    text = (SIGNATURES / "model_tiny.txt").read_text()
    for literal in ("glm53.kda_chunk.default(", "'bf16'", "'native'", "'bf16_reference'", "'compact'"):
        assert literal in text, literal
    assert "glm53.fp8_qdq" not in text and "kpool_quant_query" not in text
