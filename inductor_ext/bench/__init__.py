"""The benchmarks of ``python -m inductor_ext bench``: CUDA-graph replay timing of each op and whole layer.

:data:`BENCHES` maps a name to its :class:`Benchmark`, in the order ``bench all`` (and ``report``
on CUDA) runs them. A benchmark is a module of this package with a function
``run(*, tokens, samples, progress, **options)`` returning a JSON-able result (a dict, or a list
of row dicts; ``tokens`` is passed only when the command line gives ``--tokens``, ``progress`` is a
message callable or None) and, optionally, ``format(result) -> str`` (markdown; default
:func:`format_rows`). One entry in :data:`BENCHES` (its module in the import line) makes it
``bench NAME``, part of ``bench all`` and of the report.

Modules: :mod:`~inductor_ext.bench.timing` (CUDA events, graph replays),
:mod:`~inductor_ext.bench.inputs` (the seeded inputs), :mod:`~inductor_ext.bench.progress`
(messages and a tqdm bar), one module per benchmark, :mod:`~inductor_ext.bench.compare` (the layer
benchmark's comparison with eager).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Sequence

from inductor_ext import validation as v
from inductor_ext.bench import attn, invariance, kda, kpool, layer, moe
from inductor_ext.bench.kda import DEFAULT_TOKENS

__all__ = ["Benchmark", "BENCHES", "DEFAULT_SAMPLES", "DEFAULT_TOKENS", "run_benches", "format_benches",
           "format_rows"]

DEFAULT_SAMPLES = 50


def format_rows(result: dict | list) -> str:
    """A markdown table of ``result["rows"]`` or of ``result`` itself when it is a list (flat dicts;
    columns: the first row's keys)."""
    rows = (result if isinstance(result, list) else result.get("rows")) or []
    if not rows:
        return "(no rows)"
    cols = list(rows[0])
    cell = lambda v: f"{v:.4g}" if isinstance(v, float) else str(v).replace("|", "/")  # noqa: E731
    return "\n".join(["| " + " | ".join(cols) + " |", "|" + " --- |" * len(cols)] +
                     ["| " + " | ".join(cell(r.get(c, "–")) for c in cols) + " |" for r in rows])


@dataclasses.dataclass(frozen=True)
class Benchmark:
    """One registered benchmark: its section ``title``, ``run`` and ``format`` functions (see the
    module docstring); ``token_list``: ``run`` takes every ``--tokens`` entry (else the first);
    ``samples``: the replays per timing when none are asked for."""

    title: str
    run: Callable[..., dict]
    format: Callable[[dict], str] = format_rows
    token_list: bool = False
    samples: int = DEFAULT_SAMPLES

    def __post_init__(self) -> None:
        v.check_fields(self, "Benchmark.", {"title": v.text(), "run": v.callable_(), "format": v.callable_(),
                                            "token_list": v.boolean(), "samples": v.integer(1)})


BENCHES: dict[str, Benchmark] = {  # name -> benchmark, in the order of `bench all`
    "kda": Benchmark("KDA op", kda.bench_kda, kda.format_kda, token_list=True),
    "kpool": Benchmark("KPool indexer, per stage", kpool.bench_kpool, kpool.format_kpool),
    "moe": Benchmark("MoE activation (SwiGLU + FP8 QDQ)", moe.bench_moe_act, moe.format_moe_act),
    "layer": Benchmark("Whole layers", layer.bench_layer, layer.format_layer, samples=20),
    "attn": Benchmark("Sparse attention (absorbed MLA) beside dense causal SDPA", attn.bench_attn, token_list=True,
                      samples=20),
    "invariance": Benchmark("Price of batch invariance (layers, decode step)", invariance.bench_invariance,
                            invariance.format_invariance, samples=20),
}


def run_benches(what: Iterable[str] = tuple(BENCHES), tokens: Sequence[int] | None = None, samples: int | None = None,
                progress=None, on_result=None, options: dict[str, dict] | None = None) -> dict:
    """Run the named benchmarks (names of :data:`BENCHES`, in its order) on CUDA.

    ``tokens``: the token counts (default: each benchmark's own); a ``token_list`` benchmark (KDA)
    takes all of them, the others the first. ``samples``: replays per timing (default: each
    benchmark's own, 50; the layers 20). ``options``: name -> further keyword arguments of that
    benchmark's ``run``. ``on_result(name, result)`` is called after each."""
    what = tuple(what)
    unknown = [name for name in what if name not in BENCHES]
    if unknown:
        raise ValueError(f"run_benches: unknown benchmark(s) {unknown}; choose from {tuple(BENCHES)}")
    results = {}
    for name, bench in BENCHES.items():
        if name not in what:
            continue
        kw = {"samples": bench.samples if samples is None else samples, "progress": progress}
        if tokens:
            kw["tokens"] = tuple(tokens) if bench.token_list else tokens[0]
        kw.update((options or {}).get(name, {}))
        results[name] = bench.run(**kw)
        if on_result:
            on_result(name, results[name])
    return results


def format_benches(results: dict) -> str:
    """The markdown tables of :func:`run_benches`' results, one section each."""
    return "\n\n".join(f"### {BENCHES[n].title}\n\n{BENCHES[n].format(r)}" for n, r in results.items())
