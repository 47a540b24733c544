"""``bench invariance`` on the CPU: its ratios and table from a made-up result, and its errors."""

import pytest

from inductor_ext.bench import invariance
from inductor_ext.bench.layer import CONFIGS


def _rows(scale):
    return {"rows": [{"kind": "kda", "variant": "fwd", "p50_us": 100.0 * scale},
                     {"kind": "dsa", "variant": "fwd_bwd", "error": "boom"}]}


def test_ratios_and_table():
    layers = {"serving_aligned": _rows(1.0), "batch_invariant": _rows(1.1)}
    decode = {"serving_aligned": {"p50_us": 200.0}, "batch_invariant": {"p50_us": 300.0}}
    ratios = invariance._ratios(layers, decode)
    assert [(r["what"], round(r["ratio"], 6)) for r in ratios] == [("kda fwd", 1.1), ("decode step", 1.5)]
    table = invariance.format_invariance({"ratios": ratios})
    assert "| kda fwd | 100.0 | 110.0 | 1.100 |" in table and "| decode step | 200.0 | 300.0 | 1.500 |" in table


def test_configs_and_errors():
    assert CONFIGS["batch_invariant"] == CONFIGS["serving_aligned"].replace(batch_invariant=True)
    assert set(invariance.CONFIG_NAMES) <= set(CONFIGS)
    with pytest.raises(ValueError, match="CUDA"):
        invariance.bench_invariance(decode_seqs=4)
