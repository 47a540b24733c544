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


def test_ratios_of_a_partial_result():
    """A run cut short: only the pieces measured under both configs get a ratio."""
    layers = {"serving_aligned": _rows(1.0)}
    assert invariance._ratios(layers, {"serving_aligned": {"p50_us": 1.0}}) == []
    layers["batch_invariant"] = {"rows": []}
    decode = {"serving_aligned": {"p50_us": 200.0}, "batch_invariant": {"p50_us": 300.0}}
    assert [r["what"] for r in invariance._ratios(layers, decode)] == ["decode step"]


def _fake_pieces(monkeypatch):
    """bench_layer and the decode step replaced by fakes that log their calls."""
    calls = []

    def fake_layer(tokens, *, kinds, samples, progress, precision, timing_only):
        assert timing_only
        calls.append(f"{kinds[0]} {precision}")
        return {"rows": [{"kind": kinds[0], "variant": "fwd", "p50_us": 2.0 if precision == "batch_invariant" else 1.0}]}

    def fake_decode(config, seqs, prompt, steps):
        calls.append(f"decode {'bi' if config.batch_invariant else 'plain'}")
        return {"p50_us": 3.0 if config.batch_invariant else 2.0}

    monkeypatch.setattr(invariance.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(invariance.layer_bench, "bench_layer", fake_layer)
    monkeypatch.setattr(invariance, "_decode_step", fake_decode)
    monkeypatch.setattr(invariance.torch.cuda, "empty_cache", lambda: None)
    return calls


def test_pieces_run_decode_first_and_report_each(monkeypatch):
    """Decode steps first (no compile), then each kind under each config, ``on_partial`` after each."""
    calls = _fake_pieces(monkeypatch)
    partial = []
    result = invariance.bench_invariance(8, 2, on_partial=lambda r: partial.append(len(r["ratios"])))
    assert calls == ["decode plain", "decode bi", "kda serving_aligned", "kda batch_invariant",
                     "dsa serving_aligned", "dsa batch_invariant"]
    assert partial == [0, 1, 1, 2, 2, 3]
    assert [(r["what"], r["ratio"]) for r in result["ratios"]] == [("kda fwd", 2.0), ("dsa fwd", 2.0),
                                                                   ("decode step", 1.5)]


def test_parts_run_in_the_given_order(monkeypatch):
    calls = _fake_pieces(monkeypatch)
    result = invariance.bench_invariance(8, 2, parts=("kda", "decode"))
    assert calls == ["kda serving_aligned", "kda batch_invariant", "decode plain", "decode bi"]
    assert [r["what"] for r in result["ratios"]] == ["kda fwd", "decode step"]
    for bad in (("kda", "kda"), ("moe",), ()):
        with pytest.raises(ValueError, match="parts must be distinct names"):
            invariance.bench_invariance(8, 2, parts=bad)


def test_cli_parts_only_for_invariance(capsys):
    from inductor_ext.__main__ import main

    assert main(["bench", "layer", "--parts", "kda"]) != 0
    assert "--parts is an option of `bench invariance`, not `bench layer`" in capsys.readouterr().err
