"""``python -m inductor_ext report``: KDA accuracy against FP64, compile behaviour of the op and of
each GLM-5.3 layer kind, the mismatch table (CPU) and, on CUDA, the CUDA-graph replay timing of each
op and whole layer (``bench all``), as ``report.json``, ``report.md`` and ``report.png`` under ``--out``;
and the files of ``python -m inductor_ext mismatch`` (:func:`write_mismatch`: ``mismatch.json``,
``mismatch.md``, ``mismatch.png``)."""

from __future__ import annotations

import json
import pathlib
import sys
import time

import torch
from torch._dynamo.testing import CompileCounterWithBackend
from torch._dynamo.utils import counters

import inductor_ext
from graphs import GLM53Config
from inductor_ext import PrecisionConfig, ops
from inductor_ext.bench import format_benches, run_benches
from inductor_ext.bench.inputs import KDA_ARGS, decoder_layer, kda_inputs, layer_inputs
from inductor_ext.ops.kda_reference import kda_recurrent_reference
from inductor_ext.report.mismatch import format_markdown, format_table, format_title, run_mismatch, write_json

__all__ = ["kda_accuracy", "kda_compile", "layers_compile", "run_report", "mismatch_chart", "write_mismatch"]


def _rel(a, b) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def kda_accuracy(lengths, heads, dim, device, grad_lengths=None) -> list[dict]:
    """Relative L2 of ``kda_chunk`` per precision against the FP64 recurrence: FP32 inputs
    (o, final state, the five input gradients vs the FP64 VJP) and BF16 inputs (o vs the FP64
    result rounded to BF16)."""
    rows = []
    scale = dim ** -0.5
    for io, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        x, cu = kda_inputs(lengths, heads, dim, dtype=dtype, device=device)
        o_ref, s_ref = kda_recurrent_reference(*x.values(), scale, None, cu, compute_dtype=torch.float64)
        for prec in ("bf16", "fp32"):
            o, s = ops.kda_chunk(*x.values(), cu_seqlens=cu, precision=prec)
            target = o_ref.to(torch.bfloat16) if io == "bf16" else o_ref
            row = {"device": device, "inputs": io, "precision": prec, "tokens": sum(lengths), "heads": heads,
                   "dim": dim, "o": _rel(o, target), "final_state": _rel(s, s_ref)}
            if io == "fp32":
                row.update(_grad_errors(grad_lengths or lengths, heads, dim, device, prec))
            rows.append(row)
    return rows


def _grad_errors(lengths, heads, dim, device, prec) -> dict:
    x, cu = kda_inputs(lengths, heads, dim, dtype=torch.float32, device=device, seed=1)
    leaves = {n: t.clone().requires_grad_(True) for n, t in x.items()}
    o, s = ops.kda_chunk(*leaves.values(), cu_seqlens=cu, precision=prec)
    gen = torch.Generator(device=device).manual_seed(2)
    do, dht = (torch.randn(t.shape, generator=gen, device=device).to(t.dtype) for t in (o, s))
    torch.autograd.backward((o, s), (do, dht))
    ref = {n: t.detach().double().requires_grad_(True) for n, t in x.items()}
    o64, s64 = kda_recurrent_reference(*ref.values(), dim ** -0.5, None, cu, compute_dtype=torch.float64)
    torch.autograd.backward((o64, s64), (do.double(), dht.double()))
    return {f"d{n}": _rel(leaves[n].grad, ref[n].grad) for n in KDA_ARGS} | {"grad_tokens": sum(lengths)}


def kda_compile(device, heads: int = 2, dim: int = 32) -> list[dict]:
    """Compile a KDA forward+backward step (two packed documents, 37 + 28 tokens) per backend and
    precision with ``fullgraph=True``: compile time, frames, graph breaks and whether a repeated
    call recompiles. (On CUDA the report passes the accuracy table's heads and dim: fla autotunes
    per head geometry, minutes per new one.)"""
    inductor_ext.enable()
    x, cu = kda_inputs((37, 28), heads, dim, dtype=torch.bfloat16, device=device)
    leaves = [t.clone().requires_grad_(True) for t in x.values()]

    def step(*a):
        o, s = ops.kda_chunk(*a, cu_seqlens=cu)
        return o.float().square().mean() + s.square().mean()

    rows = []
    for backend in ("aot_eager", "inductor"):
        torch._dynamo.reset()
        counters.clear()
        counter = CompileCounterWithBackend(backend)
        compiled = torch.compile(step, backend=counter, fullgraph=True)
        for prec in ("bf16", "fp32"):
            with inductor_ext.precision(PrecisionConfig(kda=prec)):
                start = time.perf_counter()
                torch.autograd.grad(compiled(*leaves), leaves)
                seconds = time.perf_counter() - start
                frames_before = counter.frame_count
                with torch.compiler.set_stance("fail_on_recompile"):
                    torch.autograd.grad(compiled(*leaves), leaves)
            rows.append({"device": device, "backend": backend, "precision": prec, "compile_s": seconds,
                         "frames_total": counter.frame_count,
                         "recompiled_on_repeat": counter.frame_count != frames_before,
                         "graph_breaks": sum(counters["graph_break"].values())})
    torch._dynamo.reset()
    return rows


def layers_compile(device, backend: str, tokens: int = 64) -> list[dict]:
    """Compile each GLM-5.3 layer kind of the preset (``tiny`` on CPU, ``h200`` on CUDA) forward +
    backward with ``fullgraph=True`` under ``reference()`` then ``serving_aligned()``: compile time,
    graph breaks, frames (one per config) and whether a repeated call recompiles. Layers and
    inputs: :mod:`inductor_ext.bench.inputs` (two packed documents)."""
    inductor_ext.enable()
    cfg = GLM53Config.h200() if device == "cuda" else GLM53Config.tiny()
    rows = []
    for kind in ("kda", "dsa"):
        torch._dynamo.reset()
        counters.clear()
        layer = decoder_layer(cfg, kind, device)
        (x,), cu = layer_inputs(cfg, tokens, device)
        x.requires_grad_(True)
        counter = CompileCounterWithBackend(backend)
        compiled = torch.compile(_mean_square_loss(layer), backend=counter, fullgraph=True)
        for name in ("reference", "serving_aligned"):
            with inductor_ext.precision(getattr(PrecisionConfig, name)()):
                start = time.perf_counter()
                compiled(x, cu).backward()
                seconds = time.perf_counter() - start
                frames = counter.frame_count
                with torch.compiler.set_stance("fail_on_recompile"):
                    compiled(x, cu).backward()
            rows.append({"device": device, "kind": kind, "preset": "h200" if device == "cuda" else "tiny",
                         "backend": backend, "precision": name, "tokens": tokens, "compile_s": seconds,
                         "frames_total": frames, "recompiled_on_repeat": counter.frame_count != frames,
                         "graph_breaks": sum(counters["graph_break"].values())})
    torch._dynamo.reset()
    return rows


def _mean_square_loss(layer):
    """``(x, cu) -> mean(layer(x, cu)[0]²)`` in FP32: the layers' compiled training step."""
    return lambda x, cu: layer(x, cu)[0].float().square().mean()


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    return (["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
            + ["| " + " | ".join(r) + " |" for r in rows])


def _markdown(report: dict) -> str:
    grads = ("dq", "dk", "dv", "dg", "dbeta")
    lines = [f"# glm53-inductor report ({report['device']}, torch {report['torch']})", "",
             "## KDA accuracy (relative L2 vs FP64 recurrence; BF16 inputs vs FP64 rounded to BF16)", ""]
    lines += _table(["inputs", "precision", "T", "H×D", "o", "final state", *grads], [
        [r["inputs"], r["precision"], str(r["tokens"]), f"{r['heads']}×{r['dim']}", f"{r['o']:.2e}",
         f"{r['final_state']:.2e}", *(f"{r[k]:.2e}" if k in r else "–" for k in grads)]
        for r in report["kda_accuracy"]])
    compile_cols = ["compile s", "frames so far", "graph breaks", "recompiled on repeat"]

    def compile_cells(r):
        return [f"{r['compile_s']:.2f}", str(r["frames_total"]), str(r["graph_breaks"]), str(r["recompiled_on_repeat"])]

    lines += ["", "## KDA op compile (forward + backward, fullgraph=True)", ""]
    lines += _table(["backend", "precision", *compile_cols],
                    [[r["backend"], r["precision"], *compile_cells(r)] for r in report["kda_compile"]])
    lines += ["", "## GLM-5.3 layers (forward + backward, fullgraph=True)", ""]
    lines += _table(["layer", "preset", "backend", "precision", *compile_cols],
                    [[r["kind"], r["preset"], r["backend"], r["precision"], *compile_cells(r)]
                     for r in report["layers_compile"]])
    if report.get("mismatch"):
        lines += ["", "## Fixed-token train/serve mismatch (tiny preset)", "", format_table(report["mismatch"])]
    if report.get("bench"):
        lines += ["", "## CUDA-graph replay timing (`bench all`)", "", format_benches(report["bench"])]
    return "\n".join(lines) + "\n"


def _chart(report: dict, path: pathlib.Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in report["kda_accuracy"] if r["inputs"] == "fp32"]
    keys = ["o", "final_state", "dq", "dk", "dv", "dg", "dbeta"]
    fig, ax = plt.subplots(figsize=(7, 3.5))
    width = 0.4
    for i, r in enumerate(rows):
        ax.bar([j + i * width for j in range(len(keys))], [r[k] for k in keys], width,
               label=f"precision {r['precision']}")
    ax.set_xticks([j + width / 2 for j in range(len(keys))], keys)
    ax.set_yscale("log")
    ax.set_ylabel("relative L2 vs FP64")
    ax.set_title(f"kda_chunk, FP32 inputs ({report['device']})")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


_PLOT_KEYS = (("k3", "k3"), ("mean_abs_logratio", "mean |r|"), ("median_abs_logratio", "median |r|"),
              ("p99_abs_logratio", "p99 |r|"))


def mismatch_chart(result: dict, path: pathlib.Path) -> None:
    """The mismatch plot (``mismatch.png``) at ``path``: per arm a bar each of k3 and the mean,
    median and p99 of |r| (log scale; a zero is no bar, an arm all 0 says so), the floor's value of
    each as a dashed line of its colour; each arm's label carries its fraction of |r| > ln 2 and its
    r != 0 count. Needs matplotlib (the ``report`` extra): ``ImportError`` without it."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D

    names, arms, floor = list(result["arms"]), result["arms"], result.get("serving_reforward")
    n = result["num_response_tokens"]
    fig, ax = plt.subplots(figsize=(max(7.0, 1.1 * len(names) + 2.5), 4.5))
    width = 0.8 / len(_PLOT_KEYS)
    positive = []
    for j, (key, label) in enumerate(_PLOT_KEYS):
        vals = [arms[a][key] for a in names]
        xs = [i + (j - (len(_PLOT_KEYS) - 1) / 2) * width for i in range(len(names))]
        ax.bar(xs, [v if v > 0 else float("nan") for v in vals], width, label=label, color=f"C{j}")
        positive += [v for v in vals if v > 0]
        if floor is not None and floor[key] > 0:
            ax.axhline(floor[key], color=f"C{j}", linestyle="--", linewidth=1)
            positive.append(floor[key])
    ax.set_yscale("log")
    lo, hi = (min(positive) / 3, max(positive) * 3) if positive else (1e-12, 1.0)
    ax.set_ylim(lo, hi)
    ax.set_xlim(-0.6, len(names) - 0.4)
    for i, a in enumerate(names):
        if all(arms[a][key] == 0 for key, _ in _PLOT_KEYS):
            ax.text(i, lo * 1.5, "all 0\n(exact)", ha="center", va="bottom", fontsize=8)
    ax.set_xticks(range(len(names)), [f"{a}\n>ln2 {arms[a]['frac_abs_logratio_gt_ln2']:.1%}\n"
                                      f"r!=0 {arms[a]['num_nonzero_logratio']}/{n}" for a in names],
                  fontsize=7, rotation=30, ha="right")
    handles, labels = ax.get_legend_handles_labels()
    if floor is not None:
        zero = all(floor[k] == 0 for k, _ in _PLOT_KEYS)
        handles.append(Line2D([], [], color="gray", linestyle="--"))
        labels.append("floor (serving re-forward): all 0" if zero else "floor (serving re-forward)")
    ax.legend(handles, labels, fontsize=7)
    ax.set_ylabel("k3, |r| (nats)")
    ax.set_title(format_title(result), fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_mismatch(result: dict, out: pathlib.Path) -> list[pathlib.Path]:
    """``mismatch.json``, ``mismatch.png`` (left out, with a note on stderr, without matplotlib) and
    ``mismatch.md`` (:func:`~inductor_ext.report.mismatch.format_markdown`, showing the plot) under
    ``out``; returns the paths written."""
    out = pathlib.Path(out)
    written = [write_json(result, out)]
    try:
        mismatch_chart(result, out / "mismatch.png")
        written.append(out / "mismatch.png")
    except ImportError:
        print("note: no mismatch.png (matplotlib missing: pip install 'glm53-inductor[report]')", file=sys.stderr)
    md = out / "mismatch.md"
    md.write_text(format_markdown(result, "mismatch.png" if len(written) == 2 else None))
    return [*written, md]


def _write(report: dict, out: pathlib.Path) -> None:
    (out / "report.json").write_text(json.dumps(report, indent=2))
    (out / "report.md").write_text(_markdown(report))


def run_report(out: pathlib.Path, device: str, bench_tokens=None, progress=print) -> dict:
    """Build the report on ``device`` and write ``report.json``, ``report.md`` (rewritten after each
    section, so a run cut short keeps what finished) and ``report.png``. On CUDA: the ``h200``
    geometry, and the ``bench all`` timing (``bench_tokens``: its token counts)."""
    out.mkdir(parents=True, exist_ok=True)
    cuda = device == "cuda"
    report = {"device": torch.cuda.get_device_name() if cuda else "cpu", "torch": torch.__version__,
              "version": inductor_ext.__version__, "kda_accuracy": [], "kda_compile": [], "layers_compile": []}
    progress("KDA accuracy vs FP64")
    if cuda:
        report["kda_accuracy"] = kda_accuracy((1024, 1024), 64, 128, device, grad_lengths=(100, 92))
    else:
        report["kda_accuracy"] = kda_accuracy((70, 59), 4, 64, device)
    _chart(report, out / "report.png")
    _write(report, out)
    progress("KDA compile (aot_eager, inductor)")
    report["kda_compile"] = kda_compile(device, *((64, 128) if cuda else ()))
    _write(report, out)
    # CPU: aot_eager keeps the report within a few minutes (inductor takes ~30-50 s per layer here)
    layer_backend = "inductor" if cuda else "aot_eager"
    progress(f"GLM-5.3 layer compile ({layer_backend})")
    report["layers_compile"] = layers_compile(device, layer_backend)
    _write(report, out)
    if not cuda:  # the ablation's CPU table; its h200-geometry run is `python -m inductor_ext mismatch`
        progress("train/serve mismatch ablation")
        report["mismatch"] = run_mismatch(progress=progress)
    if cuda:
        progress("CUDA-graph replay timing (bench all)")
        report["bench"] = {}
        run_benches(tokens=bench_tokens, progress=progress,
                    on_result=lambda name, r: (report["bench"].update({name: r}), _write(report, out)))
    _write(report, out)
    return report
