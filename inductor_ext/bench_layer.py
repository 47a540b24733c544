"""``bench layer``: whole GLM-5.3 decoder layers under ``torch.compile`` and CUDA graphs.

For each layer kind (``kda``, ``dsa``) of the ``h200`` preset, BF16 (FP32 router, conv, gates and
mHC parameters, as transformers loads them; the DSA layer's sparse attention through FlexAttention,
``attn_impl="flex"``), two packed documents (5/8 and 3/8 of the tokens), under
``PrecisionConfig.serving_aligned()`` (or ``reference()``), and for each variant:

- ``fwd``: ``layer(x, cu_seqlens)`` under ``torch.no_grad()``;
- ``fwd_bwd``: ``loss = layer(x, cu)[0].float().square().mean()`` then ``torch.autograd.grad`` of
  x and every parameter (the indexer's are unused: it returns integer ids);

compiled with ``backend="inductor", mode="reduce-overhead", fullgraph=True`` and
``triton.cudagraph_or_error`` (a cudagraph skip raises instead of silently running uncaptured),
the row reports: cudagraph skips, graph breaks, cold compile seconds (the first call: tracing,
Inductor, autotuning and the cudagraph-trees warm-up run), warm compile seconds (the same after
``torch._dynamo.reset()``, served by the FX-graph and AOTAutograd caches), peak memory, the
replay time p50 / max (CUDA events around each call; every timed call is a graph replay — it
includes cudagraph trees' copy of x into its static input and, for ``fwd_bwd``, the autograd
engine's dispatch of the backward graph), and whether the replayed outputs equal the eager layer's.
If reduce-overhead fails for a variant, the compiled callable (``mode=None``) is captured by
:func:`inductor_ext.timing.capture` instead and the row says ``"capture": "manual"``.

Comparison with eager (:func:`compare`): the last replay runs on a second input ``x_check`` (so
cudagraph trees must copy it into the recorded graph: a stale-input bug shows) and is compared
with the eager layer on it, with ``torch.testing.assert_close``'s bound
``|a - e| <= atol + rtol·|e|``, ``rtol = 2e-2``, ``atol = 2e-2 · rms(e)``. Why: both sides are
BF16; Inductor computes a fused chain of BF16 pointwise ops in FP32 and rounds once (eager rounds
after every op) and may reduce in another order, so elements differ by a few BF16 ulps (one ulp is
2^-8 ≈ 3.9e-3 relative): 2e-2 is ~5 ulps; the absolute term scales with the tensor (x gradients of
a mean-square loss are ~1e-8). Gradient elements that are sums with cancellation sit far below
their summands and can exceed that bound (tiny preset, Inductor on CPU, 256 tokens: 2 of 131 072
elements of dx at 4× atol, relative L2 5.1e-3; outputs had none), so ``equals_eager`` allows a
fraction ``MAX_OFF`` of the elements outside the bound and needs the relative L2 within
``MAX_REL_L2``: KDA 1e-4 and 1e-2. The DSA layer picks top-k (the MoE router, top 8 of 288 experts;
the KPool indexer): a pick within rounding distance of a tie can flip between eager and compiled and
moves that token's output by about one expert's output (estimated ~0.3 against stream values of
RMS ~1 at the h200 preset's random initialisation), so the DSA layer is allowed
5 % of the elements and a relative L2 of 0.1; ``tokens_mismatched`` and ``ids_rows_differ`` (rows
whose selected token-id sets differ) show how many tokens that was. ``close`` is plain
``assert_close``; ``replay_vs_first`` compares a replay on x with the first (uncaptured) compiled
call on x: it isolates capture errors from compile numerics. The DSA layer's eager reference runs
the layer's own sparse attention: FlexAttention's fused kernel, which ``graphs.sparse_attention``
also runs eagerly on CUDA. (The dense masked path, ``eager_attn="eager"``, rounds its scores to
BF16 as transformers does: with it the eager reference differed from the compiled layer by the
attention kernel itself, 6e-2 relative L2 at 8192 tokens on the H200.) FP8 MoE activations
(``serving_aligned``) widen the rest: a BF16 ulp of difference in an expert's input moves an e4m3
value by a whole e4m3 step (2^-3 relative) when it crosses a rounding boundary, about 1 in 16
times (CPU tiny preset: the MoE output's relative L2 grows from 1.7e-3 at its input to 2.1e-2).
So the row also measures the eager layer's own sensitivity to rounding (``eager_sensitivity``:
the eager layer on ``x_check`` with two thirds of its elements moved one BF16 ulp, :func:`nudge_ulp`,
against the eager layer on ``x_check``), and a replay that misses the fixed bound still equals eager
when it is within ``SENSITIVITY_FACTOR`` times that (relative L2 and elements outside the bound):
its difference is no larger than what one ulp of rounding does to the eager layer itself, while
a real defect (a stale input, a wrong document boundary) is orders of magnitude larger.
``equals_eager_by`` says which criterion held (``"bound"`` or ``"sensitivity"``).

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
import json
import pathlib
import sys
import time
import traceback

import torch

import inductor_ext
from inductor_ext import PrecisionConfig, backends, timing
from lowerings._compat import cudagraph_trees_recorded, inductor_config, reset_cudagraph_trees

__all__ = ["bench_layer", "format_layer", "compare", "equal_by", "nudge_ulp", "KINDS", "VARIANTS", "PRECISIONS", "RTOL",
           "ATOL_RMS", "MAX_OFF", "MAX_REL_L2", "SENSITIVITY_FACTOR"]

KINDS = ("kda", "dsa")
PRECISIONS = ("serving_aligned", "reference")  # PrecisionConfig presets
VARIANTS = ("fwd", "fwd_bwd")
RTOL = 2e-2  # ~5 BF16 ulps (see the module docstring)
ATOL_RMS = 2e-2  # absolute tolerance as a fraction of the expected tensor's RMS
# equals_eager: at most this fraction of the elements outside the elementwise bound, and this
# relative L2 (see the module docstring for the measured CPU figures behind them)
MAX_OFF = {"kda": 1e-4, "dsa": 5e-2}
MAX_REL_L2 = {"kda": 1e-2, "dsa": 1e-1}
# or: within this multiple of the eager layer's own change under a one-ulp input nudge
SENSITIVITY_FACTOR = 2.0
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


def bench_layer(tokens: int = 8192, kinds=KINDS, samples: int = 20, progress=None, *,
                attn_impl: str = "flex", precision: str = "serving_aligned") -> dict:
    """Compile, capture, time and check the ``h200`` KDA and DSA decoder layers (see the module
    docstring). ``progress``: a callable taking one message per step (default: a tqdm bar when
    tqdm is installed). ``attn_impl``: the DSA layer's sparse attention, ``"flex"`` (FlexAttention;
    the CUDA path) or ``"eager"`` (dense masked math, O(H·T²) memory). ``precision``: the
    :class:`PrecisionConfig` preset, ``"serving_aligned"`` or ``"reference"``.

    Returns ``{"device", "torch", "triton", "fla", "tokens", "samples", "precision", "method",
    "rows": [...]}``, one row per (kind, variant). Raises ``ValueError`` without CUDA or on bad
    arguments; a variant that fails on the GPU reports its error in its row instead.
    """
    if not torch.cuda.is_available():
        raise ValueError("bench layer needs a CUDA device")
    return _bench(tokens, tuple(kinds), samples, progress, _Setup(attn_impl=attn_impl), precision)


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
    if setup.attn_impl not in ("flex", "eager"):
        raise ValueError(f"bench layer: attn_impl must be 'flex' or 'eager', got {setup.attn_impl!r}")


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


def _timed(fn, setup: _Setup):
    """(result, microseconds): CUDA events on CUDA, the wall clock on CPU."""
    if setup.device != "cuda":
        start = time.perf_counter()
        out = fn()
        return out, (time.perf_counter() - start) * 1e6
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    out = fn()
    end.record()
    end.synchronize()
    return out, start.elapsed_time(end) * 1e3


class _Progress:
    """One message per step to ``callback``, else a tqdm bar (if installed), else silence."""

    def __init__(self, callback, total: int):
        self.callback, self.bar = callback, None
        if callback is None:
            try:
                from tqdm import tqdm

                self.bar = tqdm(total=total, desc="bench layer", file=sys.stderr, leave=False)
            except ImportError:
                pass

    def __call__(self, msg: str) -> None:
        if self.callback is not None:
            self.callback(msg)
        if self.bar is not None:
            self.bar.set_description_str(msg)
            self.bar.update(1)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


# --------------------------------------------------------------------------------------------
# comparison


def compare(actual: torch.Tensor, expected: torch.Tensor, *, rtol: float = RTOL, atol_rms: float = ATOL_RMS) -> dict:
    """Elementwise ``torch.testing.assert_close(actual, expected, rtol=rtol, atol=atol_rms·rms)``
    over FP32 copies, as numbers: ``max_abs``, ``max_rel`` (over elements with
    ``|e| >= atol``: relative error is meaningless at zero), ``rel_l2``, ``mismatched`` of ``elements``,
    ``tokens_mismatched`` (rows of dim 0 with any mismatched element) and ``close`` (assert_close
    passed)."""
    if actual.shape != expected.shape:
        raise ValueError(f"compare: shapes differ, {tuple(actual.shape)} vs {tuple(expected.shape)}")
    a, e = actual.detach().float(), expected.detach().float()
    diff = (a - e).abs()
    atol = atol_rms * e.square().mean().sqrt().item()
    bad = diff > atol + rtol * e.abs()
    big = e.abs() >= max(atol, torch.finfo(torch.float32).tiny)
    rows = bad.reshape(bad.shape[0], -1).any(1) if bad.dim() else bad.reshape(1)
    try:
        torch.testing.assert_close(a, e, rtol=rtol, atol=atol)
        close = True
    except AssertionError:
        close = False
    return {
        "max_abs": diff.max().item() if diff.numel() else 0.0,
        "max_rel": (diff[big] / e.abs()[big]).max().item() if big.any() else 0.0,
        "rel_l2": ((a - e).norm() / e.norm().clamp_min(torch.finfo(torch.float32).tiny)).item(),
        "atol": atol, "rtol": rtol, "mismatched": int(bad.sum()), "elements": bad.numel(),
        "tokens_mismatched": int(rows.sum()),
        "tokens": int(rows.numel()), "close": close,
    }


def _within(stats: dict, kind: str) -> bool:
    return stats["mismatched"] <= MAX_OFF[kind] * stats["elements"] and stats["rel_l2"] <= MAX_REL_L2[kind]


def nudge_ulp(x: torch.Tensor, seed: int = 3) -> torch.Tensor:
    """BF16 ``x`` with each nonzero finite element moved by -1, 0 or +1 ulp (uniform, seeded):
    an input perturbation the size of one rounding."""
    if x.dtype != torch.bfloat16:
        raise ValueError(f"nudge_ulp: needs a bfloat16 tensor, got {x.dtype}")
    gen = torch.Generator(device=x.device).manual_seed(seed)
    step = torch.randint(-1, 2, x.shape, generator=gen, device=x.device, dtype=torch.int16)
    bits = x.contiguous().view(torch.int16)
    movable = (x != 0) & x.isfinite()  # ±0 and ±inf would wrap to NaN or the other sign
    return torch.where(movable, bits + step, bits).view(torch.bfloat16)


def _within_sensitivity(stats: dict, sens: dict | None) -> bool:
    if sens is None:
        return False
    return (stats["rel_l2"] <= SENSITIVITY_FACTOR * sens["rel_l2"]
            and stats["mismatched"] <= SENSITIVITY_FACTOR * sens["mismatched"])


def equal_by(stats: dict, kind: str, sensitivity: dict | None) -> str | None:
    """Which criterion makes :func:`compare`'s ``stats`` (compiled vs eager) an equality for a
    layer of ``kind``: ``"bound"`` (the fixed allowances), ``"sensitivity"`` (within
    ``SENSITIVITY_FACTOR`` × the eager layer's one-ulp ``sensitivity``, itself a :func:`compare`
    result), or None."""
    if _within(stats, kind):
        return "bound"
    return "sensitivity" if _within_sensitivity(stats, sensitivity) else None


def _param_grads(actual, expected, names) -> dict:
    """Worst relative L2 over the parameter gradients (both None = unused, e.g. the indexer)."""
    worst, worst_name, used = 0.0, None, 0
    for name, a, e in zip(names, actual, expected):
        if (a is None) != (e is None):
            return {"rel_l2_max": float("inf"), "param": name, "used": used, "note": "grad None on one side"}
        if a is None:
            continue
        used += 1
        err = ((a.float() - e.float()).norm() / e.float().norm().clamp_min(1e-30)).item()
        if err >= worst:
            worst, worst_name = err, name
    return {"rel_l2_max": worst, "param": worst_name, "used": used}


# --------------------------------------------------------------------------------------------
# the layer, its inputs and the eager reference


def _build(kind: str, tokens: int, setup: _Setup):
    """(layer, x for the timed steps, x_check for the comparison with eager, cu_seqlens)."""
    from graphs import DecoderLayer, GLM53Config
    from graphs.modules import cast_model

    cfg = getattr(GLM53Config, setup.preset)(attn_impl=setup.attn_impl)
    torch.manual_seed(0)
    with torch.device(setup.device):  # initialise on the device: the h200 DSA layer has 7.3 B parameters
        layer = DecoderLayer(cfg, cfg.first_layer(kind))
    cast_model(layer, torch.bfloat16)
    if setup.device == "cuda":
        torch.cuda.empty_cache()  # the FP32 initial values (~29 GB for the DSA layer) are gone
    gen = torch.Generator(device=setup.device).manual_seed(1)
    x, x_check = (torch.randn(tokens, cfg.hc_mult, cfg.hidden_size, device=setup.device, generator=gen)
                  .to(torch.bfloat16) for _ in range(2))
    cu = torch.tensor([0, tokens * 5 // 8, tokens], dtype=torch.int64, device=setup.device)
    return layer, x, x_check, cu


def _loss(layer, x, cu):
    return layer(x, cu)[0].float().square().mean()


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
    from torch._dynamo.utils import counters

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
    from torch._dynamo.utils import counters

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
    prog(f"{label}: cold compile")
    _reset_peak(setup)
    cold_s, cold, _, first = _first_call(layer, x, cu, params, variant, setup, capture)
    peak_first = _peak_gib(setup)
    prog(f"{label}: warm compile")
    warm_s, warm, step, _ = _first_call(layer, x, cu, params, variant, setup, capture)
    row = {"capture": capture, "cold_compile_s": cold_s, "warm_compile_s": warm_s,
           "graph_breaks": cold["graph_breaks"] + warm["graph_breaks"],
           "cudagraph_skips": cold["cudagraph_skips"] + warm["cudagraph_skips"],
           "graphs_compiled": {"cold": cold["graphs"], "warm": warm["graphs"]},
           "cache": {"cold": {k: v for k, v in cold.items() if "cache" in k},
                     "warm": {k: v for k, v in warm.items() if "cache" in k}},
           "peak_first_gib": peak_first}
    prog(f"{label}: warm-up, peak memory, {samples} timed steps")
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
        times = [_timed(lambda: replay(x), setup)[1] for _ in range(samples)]
        row.update(timing.summarize(times))
        res_x = _snapshot(replay(x), variant)
        res_check = replay(x_check)
        _sync(setup)
    if capture == "reduce-overhead" and setup.device == "cuda":
        row["cudagraphs_recorded"] = cudagraph_trees_recorded(torch.cuda.current_device())
    row["reserved_gib"] = torch.cuda.memory_reserved() / _GIB if setup.device == "cuda" else None
    return row, {"first": first, "res_x": res_x, "res_check": res_check}


def _check(row: dict, got: dict, ref: dict | None, variant: str, kind: str, names) -> None:
    """The row's comparisons: replay on x_check vs eager (``vs_eager``, ``equals_eager``; None
    when the eager reference failed) and replay on x vs the first compiled call (``replay_vs_first``)."""
    first, res_x, res = got["first"], got["res_x"], got["res_check"]
    if variant == "fwd":
        rvf = {"out_max_abs": (res_x["out"].float() - first["out"].float()).abs().max().item()}
        if first["ids"] is not None:
            rvf["ids_equal"] = bool(torch.equal(res_x["ids"], first["ids"]))
    else:
        rvf = {"loss_abs": abs(res_x["loss"].item() - first["loss"].item()),
               "dx_max_abs": (res_x["dx"].float() - first["dx"].float()).abs().max().item()}
    row["replay_vs_first"] = rvf
    if ref is None:
        row["vs_eager"], row["equals_eager"] = None, None
        return
    if variant == "fwd":
        out, ids = res
        cmp = {"out": compare(out, ref["out"])}
        if ids is not None:  # rows whose selected token-id sets differ (order inside a row is free)
            cmp["ids_rows_differ"] = int((ids.sort(1).values != ref["ids"].sort(1).values).any(1).sum())
        main, loss_ok = cmp["out"], True
    else:
        loss, dx, *dparams = res
        cmp = {"loss": compare(loss.reshape(1), ref["loss"].reshape(1)), "dx": compare(dx, ref["dx"]),
               "dparams": _param_grads(dparams, ref["dparams"], names)}
        main, loss_ok = cmp["dx"], cmp["loss"]["close"]
    by = equal_by(main, kind, row.get("eager_sensitivity"))
    row["vs_eager"], row["equals_eager"], row["equals_eager_by"] = cmp, loss_ok and by is not None, by


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
           "cudagraph_or_error": _HAS_OR_ERROR, "error": None}
    prog(f"{label}: eager reference")
    ref = None
    try:
        ref = _eager(layer, x_check, cu, params, variant, setup)
        row["eager_peak_gib"] = ref.pop("peak_gib")
    except Exception as exc:  # noqa: BLE001  (e.g. out of memory: the compiled figures still count)
        row["eager_error"] = _error(exc, setup)
    _free(setup)  # outside the handlers: a live traceback would keep the failed step's tensors
    if ref is not None:
        prog(f"{label}: eager sensitivity (one-ulp input nudge)")
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
            _check(row, got, ref, variant, kind, names)
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


def _bench(tokens, kinds, samples, progress, setup: _Setup, precision: str = "serving_aligned") -> dict:
    _check_args(tokens, kinds, samples, setup, precision)
    inductor_ext.enable()
    prog = _Progress(progress, total=len(kinds) * (1 + 5 * len(VARIANTS)))
    rows = []
    try:
        with inductor_ext.precision(getattr(PrecisionConfig, precision)()):
            for kind in kinds:
                prog(f"{kind}: build the {setup.preset} layer")
                layer, x, x_check, cu = _build(kind, tokens, setup)
                named = [(n, p) for n, p in layer.named_parameters() if p.requires_grad]
                names, params = [n for n, _ in named], [p for _, p in named]
                for variant in VARIANTS:
                    rows.append(_variant(kind, variant, layer, x, x_check, cu, params, names, setup, samples, prog,
                                         precision))
                del layer, x, x_check, cu, params, named
                _free(setup)
    finally:
        prog.close()
    cuda = setup.device == "cuda"
    return {"device": torch.cuda.get_device_name() if cuda else "cpu", "torch": torch.__version__,
            "triton": backends.version("triton"), "fla": backends.version("fla"), "tokens": tokens, "samples": samples,
            "precision": precision, "preset": setup.preset,
            "method": (f"torch.compile(backend={setup.backend!r}, mode={setup.mode!r}, fullgraph=True), "
                       f"cudagraph_or_error; CUDA events around each replayed step" if cuda
                       else f"CPU dry run: backend {setup.backend!r}, wall clock"),
            "rows": rows}


# --------------------------------------------------------------------------------------------
# output


def _equals(r: dict) -> str:
    if r.get("eager_error"):
        return f"n/a (eager: {r['eager_error'][:80]})"
    if r.get("equals_eager") is None:
        return "n/a (comparison failed)"
    if not r["equals_eager"]:
        return "NO"
    return "yes (sensitivity)" if r.get("equals_eager_by") == "sensitivity" else "yes"


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
        peaks = " / ".join("–" if r.get(k) is None else f"{r[k]:.1f}"
                           for k in ("peak_step_gib", "peak_first_gib", "eager_peak_gib"))
        note = "; ".join(notes).replace("|", "/")
        lines.append(
            f"| {kind} | {r['variant']} | {r['capture']} | {r['cudagraph_skips']} | {r['graph_breaks']} | "
            f"{r['cold_compile_s']:.1f} | {r['warm_compile_s']:.1f} | {peaks} | "
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


def main(argv=None) -> int:
    """``python -m inductor_ext.bench_layer [--tokens N] [--samples S] [--kinds kda dsa] [--out DIR]``:
    one kind at a time, rewriting ``bench_layer.json`` / ``.md`` after each (a run cut short keeps
    what finished)."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m inductor_ext.bench_layer", description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--samples", type=int, default=20)
    parser.add_argument("--kinds", nargs="+", default=list(KINDS), choices=KINDS)
    parser.add_argument("--attn-impl", default="flex", choices=("flex", "eager"))
    parser.add_argument("--precision", default="serving_aligned", choices=PRECISIONS)
    parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path("bench_out"))
    args = parser.parse_args(argv)
    result = None
    try:
        for kind in args.kinds:
            part = bench_layer(args.tokens, (kind,), args.samples,
                               progress=lambda m: print(f"... {m}", file=sys.stderr, flush=True),
                               attn_impl=args.attn_impl, precision=args.precision)
            result = part if result is None else {**result, "rows": result["rows"] + part["rows"]}
            args.out.mkdir(parents=True, exist_ok=True)
            (args.out / "bench_layer.json").write_text(json.dumps(result, indent=2))
            (args.out / "bench_layer.md").write_text(format_layer(result) + "\n")
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(format_layer(result))
    print(f"wrote {args.out}/bench_layer.json, bench_layer.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
