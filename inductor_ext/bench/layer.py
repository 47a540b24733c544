"""``python -m inductor_ext bench layer``: whole GLM-5.3 decoder layers under ``torch.compile`` and CUDA graphs.

For each layer kind (``kda``, ``dsa``) of the ``h200`` preset, BF16 (FP32 router, conv, gates and
mHC parameters, as transformers loads them; the DSA layer's sparse attention through FlexAttention,
``attn_impl="flex"``), two packed documents (5/8 and 3/8 of the tokens; layer and inputs from
:mod:`inductor_ext.bench.inputs`), under
``PrecisionConfig.serving_aligned()`` (or ``reference()``), and for each variant:

- ``fwd``: ``layer(x, cu_seqlens)`` under ``torch.no_grad()``;
- ``fwd_bwd``: ``loss = layer(x, cu)[0].float().square().flatten(1).mean(1).mean()`` (per token,
  then over the tokens: a batch-invariant graph keeps every reduction unsplit, and one mean over
  every element would run in a single program) then ``torch.autograd.grad`` of x and every
  parameter (the indexer's are unused: it returns integer ids);

compiled with ``backend="inductor", mode="reduce-overhead", fullgraph=True`` and
``triton.cudagraph_or_error`` (a cudagraph skip raises instead of silently running uncaptured),
the row reports: cudagraph skips, graph breaks, cold compile seconds (the first call: tracing,
Inductor, autotuning and the cudagraph-trees warm-up run), warm compile seconds (the same after
``torch._dynamo.reset()``, served by the FX-graph and AOTAutograd caches), peak memory, the
replay time p50 / max (CUDA events around each call; every timed call is a graph replay — it
includes cudagraph trees' copy of x into its static input and, for ``fwd_bwd``, the autograd
engine's dispatch of the backward graph), and whether the replayed outputs equal the eager layer's.
If reduce-overhead fails for a variant, the compiled callable (``mode=None``) is captured by
:func:`inductor_ext.bench.timing.capture` instead and the row says ``"capture": "manual"``.

Comparison with eager: :mod:`inductor_ext.bench.compare` (the last replay runs on a second input
``x_check`` and is compared with the eager layer on it; ``equals_eager``, ``equals_eager_by``,
``eager_sensitivity``, ``replay_vs_first``).

Memory (GiB, ``torch.cuda`` allocator statistics): ``peak_step_gib`` is
``max_memory_allocated`` around one replayed step after ``reset_peak_memory_stats`` (a replay
allocates nothing: it is the resident set — parameters, inputs, live cudagraph outputs);
``peak_first_gib`` the same around the first call (compile + uncaptured run: the step's real
activation peak); ``reserved_gib`` the allocator's reserved memory after timing (includes the
cudagraph pools); ``eager_peak_gib`` the eager layer's peak for the same step.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import sys
import time
import traceback
from collections.abc import Callable

import torch
from torch._dynamo.utils import counters

import inductor_ext
from graphs.config import ATTN_IMPLS, GLM53Config
from inductor_ext import PrecisionConfig, backends
from inductor_ext import validation as v
from inductor_ext.bench import timing
from inductor_ext.bench.compare import (
    ATOL_RMS,
    MAX_OFF,
    MAX_REL_L2,
    RTOL,
    SENSITIVITY_FACTOR,
    check_row,
    compare,
    nudge_ulp,
)
from inductor_ext.bench.inputs import decoder_layer, layer_inputs
from inductor_ext.bench.progress import Progress
from lowerings._compat import cudagraph_trees_recorded, inductor_config, reset_cudagraph_trees

__all__ = ["bench_layer", "format_layer", "KINDS", "VARIANTS", "PRECISIONS"]

KINDS = ("kda", "dsa")
# preset name -> PrecisionConfig ("batch_invariant": serving_aligned with batch_invariant=True)
CONFIGS = {"serving_aligned": PrecisionConfig.serving_aligned(), "reference": PrecisionConfig.reference(),
           "batch_invariant": PrecisionConfig.serving_aligned().replace(batch_invariant=True)}
PRECISIONS = tuple(CONFIGS)
VARIANTS = ("fwd", "fwd_bwd")
_GIB = 2**30
_HAS_OR_ERROR = hasattr(inductor_config.triton, "cudagraph_or_error")  # torch >= 2.6


@dataclasses.dataclass(frozen=True)
class _Setup:
    """Where and how to run; the public entry point fixes the CUDA / h200 / inductor values, the
    CPU dry run (tests) uses ``device="cpu", preset="tiny", backend="aot_eager", mode=None``."""

    device: str = "cuda"
    preset: str = "h200"
    backend: str = "inductor"
    mode: str | None = "reduce-overhead"
    attn_impl: str = "flex"
    eager_attn: str | None = None  # the DSA eager reference's sparse attention (None: the layer's own)
    warmup: int = 3
    captures: tuple[str, ...] | None = None  # capture methods tried in order (None: by device and mode)
    catch: bool = True  # record a failing variant's error in its row and go on (False: raise)
    timing_only: bool = False  # no eager reference, no sensitivity, no warm compile (a price, not a check)

    def __post_init__(self) -> None:
        v.check_fields(self, "bench layer: ", {
            "device": v.one_of(("cuda", "cpu")), "preset": v.one_of(("h200", "tiny")), "backend": v.text(),
            "mode": v.optional(v.text()), "attn_impl": v.one_of(ATTN_IMPLS), "eager_attn": v.optional(v.one_of(
                ATTN_IMPLS)), "warmup": v.integer(0), "catch": v.boolean(), "timing_only": v.boolean(),
            "captures": v.optional(v.sequence(v.one_of(("reduce-overhead", "manual", "none")), min_len=1))})


def bench_layer(tokens: int = 8192, kinds=KINDS, samples: int = 20, progress=None, *,
                attn_impl: str = "flex", precision: str = "serving_aligned",
                on_partial: Callable[[dict], object] | None = None, timing_only: bool = False) -> dict:
    """Compile, capture, time and check the ``h200`` KDA and DSA decoder layers (see the module
    docstring). ``progress``: a callable taking one message per step (and a tqdm bar on stderr
    when tqdm is installed). ``attn_impl``: the DSA layer's sparse attention, ``"flex"``
    (FlexAttention; the CUDA path) or ``"eager"`` (dense masked math, O(H·T²) memory).
    ``precision``: the :class:`PrecisionConfig` preset, ``"serving_aligned"``, ``"reference"`` or
    ``"batch_invariant"`` (serving_aligned with ``batch_invariant=True``; :data:`CONFIGS`).
    ``on_partial``: called with the result so far after each kind (a run cut short keeps what
    finished). ``timing_only``: compile, capture and time only (no eager reference, sensitivity or
    warm compile: ``equals_eager`` and ``warm_compile_s`` are None), for a price in less time.

    Returns ``{"device", "torch", "triton", "fla", "tokens", "samples", "precision", "method",
    "rows": [...]}``, one row per (kind, variant). Raises ``ValueError`` without CUDA or on bad
    arguments; a variant that fails on the GPU reports its error in its row instead.
    """
    if not torch.cuda.is_available():
        raise ValueError("bench layer needs a CUDA device")
    return _bench(tokens, tuple(kinds), samples, progress, _Setup(attn_impl=attn_impl, timing_only=timing_only),
                  precision, on_partial)


def _check_args(tokens, kinds, samples, setup: _Setup, precision: str) -> None:
    if not isinstance(tokens, int) or tokens < 8:
        raise ValueError(f"bench layer: tokens must be an int >= 8 (two packed documents), got {tokens!r}")
    bad = [k for k in kinds if k not in KINDS]
    if bad or not kinds:
        raise ValueError(f"bench layer: kinds must be a non-empty subset of {KINDS}, got {tuple(kinds)}")
    if not isinstance(samples, int) or samples < 1:
        raise ValueError(f"bench layer: samples must be an int >= 1, got {samples!r}")
    if precision not in PRECISIONS:
        raise ValueError(f"bench layer: precision must be one of {PRECISIONS}, got {precision!r}")


# --------------------------------------------------------------------------------------------
# device helpers (the CPU dry run goes through the same code with these as no-ops)


def _sync(setup: _Setup) -> None:
    if setup.device == "cuda":
        torch.cuda.synchronize()


def _reset(setup: _Setup) -> None:
    """Forget every compiled graph (Dynamo's caches, cudagraph trees' graphs and pools)."""
    torch._dynamo.reset()
    if setup.device == "cuda":
        reset_cudagraph_trees()


def _free(setup: _Setup) -> None:
    _reset(setup)
    gc.collect()
    if setup.device == "cuda":
        torch.cuda.empty_cache()


def _reset_peak(setup: _Setup) -> None:
    if setup.device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()


def _peak_gib(setup: _Setup) -> float | None:
    if setup.device != "cuda":
        return None
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() / _GIB


# --------------------------------------------------------------------------------------------
# the layer, its inputs and the eager reference


def _build(kind: str, tokens: int, setup: _Setup):
    """(layer, x for the timed steps, x_check for the comparison with eager, cu_seqlens)."""
    cfg = getattr(GLM53Config, setup.preset)(attn_impl=setup.attn_impl)
    layer = decoder_layer(cfg, kind, setup.device)
    (x, x_check), cu = layer_inputs(cfg, tokens, setup.device, count=2)
    return layer, x, x_check, cu


def _loss(layer, x, cu):
    return layer(x, cu)[0].float().square().flatten(1).mean(1).mean()


def _eager(layer, x, cu, params, variant, setup) -> dict:
    """The eager layer's outputs (``fwd``) or loss and gradients (``fwd_bwd``) and its peak memory;
    a DSA layer's sparse attention through ``setup.eager_attn`` when set (default: its own)."""
    attn = layer.self_attn
    own = getattr(attn, "impl", None)
    if own is not None and setup.eager_attn is not None:
        attn.impl = setup.eager_attn
    try:
        _reset_peak(setup)
        if variant == "fwd":
            with torch.no_grad():
                out, ids = layer(x, cu)
            return {"out": out, "ids": ids, "peak_gib": _peak_gib(setup)}
        leaf = x.detach().requires_grad_(True)
        loss = _loss(layer, leaf, cu)
        grads = torch.autograd.grad(loss, [leaf, *params], allow_unused=True)
        return {"loss": loss.detach(), "dx": grads[0], "dparams": list(grads[1:]), "peak_gib": _peak_gib(setup)}
    finally:
        if own is not None:
            attn.impl = own


# --------------------------------------------------------------------------------------------
# one compiled variant


def _compile(layer, variant: str, setup: _Setup, capture: str):
    """A fresh ``torch.compile`` of the variant (fullgraph; ``mode`` only for reduce-overhead)."""
    if variant == "fwd":
        def fn(x, cu):
            return layer(x, cu)
    else:
        def fn(x, cu):
            return _loss(layer, x, cu)
    mode = setup.mode if capture == "reduce-overhead" else None
    return torch.compile(fn, backend=setup.backend, mode=mode, fullgraph=True)


def _step_fn(compiled, cu, params, variant: str, graphed: bool):
    """``step(x)``: one forward under no_grad, or forward + ``autograd.grad`` of x and the
    parameters -> ``(loss, dx, *dparams)``. ``graphed``: mark a new cudagraph-trees step first."""
    def step(x):
        if graphed:
            torch.compiler.cudagraph_mark_step_begin()
        if variant == "fwd":
            with torch.no_grad():
                return compiled(x, cu)
        leaf = x.detach().requires_grad_(True)  # shares x's storage (a manual capture reads it)
        loss = compiled(leaf, cu)
        return (loss, *torch.autograd.grad(loss, [leaf, *params], allow_unused=True))
    return step


def _snapshot(res, variant: str) -> dict:
    """Clones of what the comparisons read (cudagraph outputs are overwritten by the next replay)."""
    if variant == "fwd":
        return {"out": res[0].detach().clone(), "ids": None if res[1] is None else res[1].clone()}
    return {"loss": res[0].detach().clone(), "dx": res[1].detach().clone()}


def _counts() -> dict:
    return {
        "graph_breaks": sum(counters["graph_break"].values()),
        "cudagraph_skips": counters["inductor"]["cudagraph_skips"],
        "graphs": counters["stats"]["unique_graphs"],
        "fxgraph_cache_hit": counters["inductor"]["fxgraph_cache_hit"],
        "fxgraph_cache_miss": counters["inductor"]["fxgraph_cache_miss"],
        "fxgraph_cache_bypass": counters["inductor"]["fxgraph_cache_bypass"],
        "aot_autograd_cache_hit": counters["aot_autograd"]["autograd_cache_hit"],
        "aot_autograd_cache_miss": counters["aot_autograd"]["autograd_cache_miss"],
    }


def _first_call(layer, x, cu, params, variant, setup, capture):
    """Reset Dynamo, compile and run one step: (seconds, counters, step, snapshot of the result).
    Under reduce-overhead this call is cudagraph trees' uncaptured warm-up run."""
    _reset(setup)
    counters.clear()
    step = _step_fn(_compile(layer, variant, setup, capture), cu, params, variant, capture == "reduce-overhead")
    _sync(setup)
    start = time.perf_counter()
    res = step(x)
    _sync(setup)
    seconds = time.perf_counter() - start
    return seconds, _counts(), step, _snapshot(res, variant)


def _compiled_variant(layer, x, x_check, cu, params, variant, setup, samples, capture, prog, label):
    """Cold + warm compile, warm-up, peak memory, timing, then one replay on x (against the first
    call) and one on x_check (against eager), for one capture method: ``"reduce-overhead"``,
    ``"manual"`` (:func:`timing.capture` of the compiled callable) or ``"none"`` (CPU dry run).
    Returns (row fields, {"first", "res_x", "res_check"}) — the comparisons run on these."""
    if capture == "manual":
        x = x.clone()  # the captured graph's static input
    prog.step(f"{label}: cold compile")
    _reset_peak(setup)
    cold_s, cold, cold_step, first = _first_call(layer, x, cu, params, variant, setup, capture)
    peak_first = _peak_gib(setup)
    if setup.timing_only:
        warm_s, warm, step = None, dict.fromkeys(cold, 0), cold_step
    else:
        prog.step(f"{label}: warm compile")
        warm_s, warm, step, _ = _first_call(layer, x, cu, params, variant, setup, capture)
    row = {"capture": capture, "cold_compile_s": cold_s, "warm_compile_s": warm_s,
           "graph_breaks": cold["graph_breaks"] + warm["graph_breaks"],
           "cudagraph_skips": cold["cudagraph_skips"] + warm["cudagraph_skips"],
           "graphs_compiled": {"cold": cold["graphs"], "warm": warm["graphs"]},
           "cache": {"cold": {k: v for k, v in cold.items() if "cache" in k},
                     "warm": {k: v for k, v in warm.items() if "cache" in k}},
           "peak_first_gib": peak_first}
    prog.step(f"{label}: warm-up, peak memory, {samples} timed steps")
    with torch.compiler.set_stance("fail_on_recompile"):  # a recompile here is an error, not a figure
        if capture == "manual":
            static: dict = {}
            graph = timing.capture(lambda: static.update(res=step(x)), warmup=setup.warmup)

            def replay(inp):
                if inp is not x:
                    x.copy_(inp)
                graph.replay()
                return static["res"]
        else:
            for _ in range(setup.warmup):  # reduce-overhead: the first records, the others replay
                step(x)
            replay = step
        _reset_peak(setup)
        replay(x)
        row["peak_step_gib"] = _peak_gib(setup)
        times = [timing.timed(lambda: replay(x), setup.device)[1] for _ in range(samples)]
        row.update(timing.summarize(times))
        res_x = _snapshot(replay(x), variant)
        res_check = replay(x_check)
        _sync(setup)
    if capture == "reduce-overhead" and setup.device == "cuda":
        row["cudagraphs_recorded"] = cudagraph_trees_recorded(torch.cuda.current_device())
    row["reserved_gib"] = torch.cuda.memory_reserved() / _GIB if setup.device == "cuda" else None
    return row, {"first": first, "res_x": res_x, "res_check": res_check}


def _error(exc: Exception, setup: _Setup) -> str:
    """One line for the row (the traceback goes to stderr); re-raises when ``setup.catch`` is off."""
    if not setup.catch:
        raise exc
    traceback.print_exc(file=sys.stderr)
    return f"{type(exc).__name__}: {str(exc).strip()[:600]}"


def _variant(kind, variant, layer, x, x_check, cu, params, names, setup, samples, prog, precision) -> dict:
    label = f"{kind} {variant}"
    row = {"kind": kind, "variant": variant, "tokens": x.shape[0], "preset": setup.preset, "backend": setup.backend,
           "attn_impl": setup.attn_impl if kind == "dsa" else None, "precision": precision,
           "eager_attn_impl": (setup.eager_attn or setup.attn_impl) if kind == "dsa" else None,
           "cudagraph_or_error": _HAS_OR_ERROR, "timing_only": setup.timing_only, "error": None}
    ref = None
    if not setup.timing_only:
        prog.step(f"{label}: eager reference")
        try:
            ref = _eager(layer, x_check, cu, params, variant, setup)
            row["eager_peak_gib"] = ref.pop("peak_gib")
        except Exception as exc:  # noqa: BLE001  (e.g. out of memory: the compiled figures still count)
            row["eager_error"] = _error(exc, setup)
        _free(setup)  # outside the handlers: a live traceback would keep the failed step's tensors
    if ref is not None:
        prog.step(f"{label}: eager sensitivity (one-ulp input nudge)")
        key = "out" if variant == "fwd" else "dx"
        try:
            row["eager_sensitivity"] = compare(_eager(layer, nudge_ulp(x_check), cu, params, variant, setup)[key],
                                               ref[key])
        except Exception as exc:  # noqa: BLE001  (the fixed bound still decides)
            row["sensitivity_error"] = _error(exc, setup)
        _free(setup)
    captures = setup.captures or (("reduce-overhead", "manual") if setup.device == "cuda" and setup.mode else ("none",))
    for capture in captures:
        got = None
        try:
            with _or_error_patch():
                stats, got = _compiled_variant(layer, x, x_check, cu, params, variant, setup, samples, capture,
                                               prog, label)
        except Exception as exc:  # noqa: BLE001  (a failing variant is a result; setup.catch=False raises)
            row["error"] = f"[{capture}] {_error(exc, setup)}"
            if capture == "reduce-overhead":
                row["reduce_overhead_error"] = row["error"]
        if got is None:
            _free(setup)
            continue
        row.update(stats, error=None)
        try:
            check_row(row, got, ref, variant, kind, names)
        except Exception as exc:  # noqa: BLE001
            row["check_error"] = _error(exc, setup)
        break
    got = ref = None  # drop the cudagraph outputs before the pools go
    _free(setup)
    return row


def _or_error_patch():
    """``triton.cudagraph_or_error = True`` (a cudagraph skip raises) where this torch has it."""
    if not _HAS_OR_ERROR:
        return contextlib.nullcontext()
    return inductor_config.patch({"triton.cudagraph_or_error": True})


def _bench(tokens, kinds, samples, progress, setup: _Setup, precision: str = "serving_aligned",
           on_partial: Callable[[dict], object] | None = None) -> dict:
    _check_args(tokens, kinds, samples, setup, precision)
    inductor_ext.enable()
    rows = []
    steps = len(kinds) * (1 + (2 if setup.timing_only else 5) * len(VARIANTS))
    with Progress(progress, total=steps, desc="bench layer") as prog, \
            inductor_ext.precision(CONFIGS[precision]):
        for kind in kinds:
            prog.step(f"{kind}: build the {setup.preset} layer")
            layer, x, x_check, cu = _build(kind, tokens, setup)
            named = [(n, p) for n, p in layer.named_parameters() if p.requires_grad]
            names, params = [n for n, _ in named], [p for _, p in named]
            for variant in VARIANTS:
                rows.append(_variant(kind, variant, layer, x, x_check, cu, params, names, setup, samples, prog,
                                     precision))
            del layer, x, x_check, cu, params, named
            _free(setup)
            if on_partial is not None:
                on_partial(_result(tokens, samples, setup, precision, rows))
    return _result(tokens, samples, setup, precision, rows)


def _result(tokens, samples, setup: _Setup, precision: str, rows: list[dict]) -> dict:
    cuda = setup.device == "cuda"
    return {"device": torch.cuda.get_device_name() if cuda else "cpu", "torch": torch.__version__,
            "triton": backends.version("triton"), "fla": backends.version("fla"), "tokens": tokens, "samples": samples,
            "precision": precision, "preset": setup.preset,
            "method": (f"torch.compile(backend={setup.backend!r}, mode={setup.mode!r}, fullgraph=True), "
                       f"cudagraph_or_error; CUDA events around each replayed step" if cuda
                       else f"CPU dry run: backend {setup.backend!r}, wall clock"),
            "rows": list(rows)}


# --------------------------------------------------------------------------------------------
# output


def _equals(r: dict) -> str:
    if r.get("eager_error"):
        return f"n/a (eager: {r['eager_error'][:80]})"
    if r.get("timing_only"):
        return "not checked (timing only)"
    if r.get("equals_eager") is None:
        return "n/a (comparison failed)"
    if not r["equals_eager"]:
        return "NO"
    return "yes (sensitivity)" if r.get("equals_eager_by") == "sensitivity" else "yes"


def _num(value) -> str:
    return "–" if value is None else f"{value:.1f}"


def format_layer(result: dict) -> str:
    """A markdown table of :func:`bench_layer`'s rows (times in ms, memory in GiB)."""
    lines = [f"GLM-5.3 {result.get('preset', 'h200')} layers on {result.get('device')}, torch {result.get('torch')}, "
             f"T={result.get('tokens')} (two packed documents), {result.get('precision')}, "
             f"{result.get('samples')} samples; {result.get('method', '')}", "",
             "| layer | variant | capture | skips | breaks | cold s | warm s | peak GiB step / first / eager | "
             "p50 / max ms | equals eager | out or dx vs eager: max abs / max rel / tokens off | note |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in result["rows"]:
        kind = r["kind"] + (f" ({r['attn_impl']})" if r.get("attn_impl") else "")
        if "p50_us" not in r:
            lines.append(f"| {kind} | {r['variant']} | failed | – | – | – | – | – | – | – | – | "
                         f"{str(r.get('error')).replace('|', '/')[:300]} |")
            continue
        cmp = r.get("vs_eager") or {}
        main = cmp.get("out" if r["variant"] == "fwd" else "dx")
        diff = "–" if main is None else \
            f"{main['max_abs']:.2e} / {main['max_rel']:.2e} / {main['tokens_mismatched']}/{main['tokens']}"
        notes = []
        sens = r.get("eager_sensitivity")
        if main is not None and sens is not None:
            notes.append(f"rel L2 {main['rel_l2']:.1e}, {main['mismatched']} off; eager's one-ulp sensitivity "
                         f"{sens['rel_l2']:.1e}, {sens['mismatched']} off")
        if cmp.get("ids_rows_differ"):
            notes.append(f"indexer id sets differ in {cmp['ids_rows_differ']} rows")
        if cmp.get("dparams"):
            notes.append(f"param grads rel L2 ≤ {cmp['dparams']['rel_l2_max']:.1e} ({cmp['dparams']['param']})")
        if r.get("cudagraphs_recorded") is not None:
            notes.append(f"{r['cudagraphs_recorded']} CUDA graph(s) recorded")
        if r.get("check_error"):
            notes.append(f"comparison failed: {r['check_error'][:200]}")
        if r.get("reduce_overhead_error"):
            notes.append(f"reduce-overhead failed: {r['reduce_overhead_error'][:200]}")
        if not r.get("cudagraph_or_error", True):
            notes.append("cudagraph_or_error unavailable: skips counted only")
        peaks = " / ".join(_num(r.get(k)) for k in ("peak_step_gib", "peak_first_gib", "eager_peak_gib"))
        note = "; ".join(notes).replace("|", "/")
        lines.append(
            f"| {kind} | {r['variant']} | {r['capture']} | {r['cudagraph_skips']} | {r['graph_breaks']} | "
            f"{r['cold_compile_s']:.1f} | {_num(r['warm_compile_s'])} | {peaks} | "
            f"{r['p50_us'] / 1e3:.2f} / {r['max_us'] / 1e3:.2f} | {_equals(r)} | {diff} | {note} |")
    lines += ["", f"equals eager: a replay on a second input vs the eager layer on it; elementwise bound "
              f"|a−e| ≤ {ATOL_RMS:g}·rms(e) + {RTOL:g}·|e| (BF16, ~5 ulps), at most {MAX_OFF['kda']:g} of the "
              f"elements outside it and rel L2 ≤ {MAX_REL_L2['kda']:g} (KDA); DSA {MAX_OFF['dsa']:g} and "
              f"{MAX_REL_L2['dsa']:g} (its top-k picks flip at near-ties); or, \"yes (sensitivity)\", rel L2 and "
              f"elements off within {SENSITIVITY_FACTOR:g}× the eager layer's own change when two thirds of its "
              "input elements move one BF16 ulp. "
              "cold = first compile in this process (Inductor's on-disk caches may be warm: see the JSON's "
              "cache counters); warm = after torch._dynamo.reset()."]
    return "\n".join(lines)
