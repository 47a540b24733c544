"""The benchmark registry (``inductor_ext.bench.BENCHES``): what ``bench all`` runs and in which
order, the arguments each benchmark gets, the sections ``format_benches`` writes; and the progress
messages and bar (``inductor_ext.bench.progress``)."""

import re
import sys

import pytest

import inductor_ext.bench as bench
from inductor_ext.bench import BENCHES, Benchmark, format_benches, format_rows, run_benches
from inductor_ext.bench.progress import Progress
from tests.support.bench import kpool_result, layer_result, moe_result


def test_registry_order_and_defaults():
    """The four original benchmarks lead, in this order (a later one is appended)."""
    assert list(BENCHES)[:4] == ["kda", "kpool", "moe", "layer"]
    assert [b.token_list for b in BENCHES.values()][:4] == [True, False, False, False]
    assert [b.samples for b in BENCHES.values()][:4] == [50, 50, 50, 20]
    assert bench.DEFAULT_TOKENS == (129, 2048, 16384)


@pytest.fixture
def fakes(monkeypatch):
    """Every registered benchmark replaced by one that records its keyword arguments."""
    calls = []
    for name, b in list(BENCHES.items()):
        def run(_name=name, **kw):
            calls.append((_name, kw))
            return {"rows": [{"name": _name}]}
        monkeypatch.setitem(BENCHES, name, Benchmark(b.title, run, token_list=b.token_list, samples=b.samples))
    return calls


def test_run_benches_order_tokens_samples_and_options(fakes):
    seen = []
    results = run_benches(("layer", "kda"), tokens=[64, 128], progress=print, on_result=lambda n, r: seen.append(n),
                          options={"layer": {"kinds": ("kda",)}, "moe": {"ignored": 1}})
    assert list(results) == seen == ["kda", "layer"]  # the registry's order, not the argument's
    assert fakes == [("kda", {"samples": 50, "progress": print, "tokens": (64, 128)}),
                     ("layer", {"samples": 20, "progress": print, "tokens": 64, "kinds": ("kda",)})]
    fakes.clear()
    run_benches(samples=7)
    assert [(n, kw["samples"], "tokens" in kw) for n, kw in fakes] == [(n, 7, False) for n in BENCHES]


def test_run_benches_rejects_unknown_names_before_running(fakes):
    message = f"unknown benchmark(s) ['attention']; choose from {tuple(BENCHES)}"
    assert str(tuple(BENCHES)).startswith("('kda', 'kpool', 'moe', 'layer'")
    with pytest.raises(ValueError, match=re.escape(message)):
        run_benches(("kda", "attention"))
    assert fakes == []


def test_format_benches_sections():
    text = format_benches({"kpool": kpool_result(), "moe": moe_result(), "layer": layer_result()})
    sections = [line for line in text.splitlines() if line.startswith("### ")]
    assert sections == ["### KPool indexer, per stage", "### MoE activation (SwiGLU + FP8 QDQ)", "### Whole layers"]
    assert "| 32 | fp8 | 10 / 11 |" in text and "| aligned_fused |" in text and "| dsa (flex) | fwd_bwd |" in text


def test_format_rows_is_the_default_format():
    assert Benchmark("x", lambda **kw: {}).format is format_rows
    table = format_rows({"rows": [{"T": 64, "p50_us": 12.3456, "note": "a|b"}, {"T": 128, "p50_us": 3.0}]})
    assert table.splitlines() == ["| T | p50_us | note |", "| --- | --- | --- |", "| 64 | 12.35 | a/b |",
                                  "| 128 | 3 | – |"]
    assert format_rows({"rows": []}) == "(no rows)" == format_rows([])
    assert format_rows([{"T": 64}]).splitlines()[2] == "| 64 |"  # a benchmark that returns its rows


def test_progress_steps_notes_and_bar(capsys):
    messages = []
    with Progress(messages.append, total=2, desc="test") as prog:
        prog.step("one")
        prog.note("one: done")
        prog("two")
        assert prog.bar is not None and prog.bar.n == 2
    assert messages == ["one", "one: done", "two"] and prog.bar is None


def test_progress_without_tqdm(monkeypatch):
    monkeypatch.setitem(sys.modules, "tqdm", None)  # import fails
    messages = []
    with Progress(messages.append, total=1, desc="test") as prog:
        prog.step("one")
    assert prog.bar is None and messages == ["one"]
    Progress(None, total=1, desc="silent").step("nothing to show")
