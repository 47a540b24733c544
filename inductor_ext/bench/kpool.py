"""``python -m inductor_ext bench kpool``: per-stage CUDA-graph replay timing of the KPool indexer.

At T tokens (default 16384, one document), for 32, 64 and 128 indexer heads and both precisions
(``bf16`` = BF16 pooling reference semantics, ``fp8`` = serving pipeline): p50 / max of single
graph replays of each stage (project, layout, compress, FP8 query, scorer, selection + expansion)
and of the whole composite. The scorer's rate counts the dense T × S × H × 128 multiply-adds
(2 FLOP each), next to an FP8 ``torch._scaled_mm`` (8192³) timed in the same process.
Inputs and weights: :mod:`inductor_ext.bench.inputs` (one CUDA generator, seed 0).
"""

from __future__ import annotations

import torch

from inductor_ext.bench import timing
from inductor_ext.bench.inputs import kpool_inputs, kpool_weights
from inductor_ext.bench.progress import Progress
from inductor_ext.ops import kpool as kp
from inductor_ext.ops.kpool_pipeline import kpool_indexer

__all__ = ["bench_kpool", "scaled_mm_tflops", "format_kpool", "kpool_targets"]

HIDDEN, Q_RANK, DIM, POOL = 4096, 1536, 128, 4


def scaled_mm_tflops(n: int = 8192, samples: int = 50) -> float:
    """FP8 e4m3 matrix-multiply rate (TFLOP/s, p50) of ``torch._scaled_mm`` on n × n × n."""
    a = torch.randn(n, n, device="cuda").to(torch.float8_e4m3fn)
    b = torch.randn(n, n, device="cuda").to(torch.float8_e4m3fn).t()
    one = torch.ones((), device="cuda")
    stats = timing.replay_stats(lambda: torch._scaled_mm(a, b, scale_a=one, scale_b=one, out_dtype=torch.bfloat16),
                                samples)
    return 2 * n**3 / (stats["p50_us"] * 1e-6) / 1e12


def bench_kpool(tokens=16384, heads=(32, 64, 128), topk=2048, samples=50, warmup=3, progress=None) -> dict:
    """Per-stage and total replay timing; returns ``{"rows": [...], "scaled_mm_tflops": ...,
    "targets": kpool_targets(...)}``."""
    if not torch.cuda.is_available():
        raise ValueError("bench kpool needs a CUDA device")
    gen = torch.Generator(device="cuda").manual_seed(0)
    x, q_resid, cu = kpool_inputs((tokens,), HIDDEN, Q_RANK, device="cuda", generator=gen)
    peak = scaled_mm_tflops(samples=samples)
    rows = []
    with Progress(progress, total=2 * len(heads), desc="bench kpool") as prog:
        for H in heads:
            wt = kpool_weights(H, HIDDEN, Q_RANK, DIM, POOL, gen)
            for prec in ("bf16", "fp8"):
                prog.step(f"kpool T={tokens} H={H} {prec}")
                rows.append(_row(x, q_resid, cu, wt, tokens, H, prec, topk, samples, warmup, peak, prog))
                torch.cuda.empty_cache()
    result = {"scaled_mm_tflops": peak, "rows": rows}
    result["targets"] = kpool_targets(result)
    return result


def _row(x, q_resid, cu, wt, tokens, H, prec, topk, samples, warmup, peak, prog) -> dict:
    """Every stage's replay statistics at ``H`` heads and precision ``prec``."""
    head_proj = "fp32" if prec == "fp8" else "model"
    k, gate, w = kp.kpool_project(x, wt["wk"], wt["k_norm_weight"], wt["k_norm_bias"], wt["weights_proj"],
                                  wt["compress_gate"], head_proj=head_proj)
    q = torch.nn.functional.linear(q_resid, wt["wq_b"]).view(tokens, H, DIM)
    layout = kp.kpool_layout(cu, tokens, POOL)
    mode = "fp8_ue8m0" if prec == "fp8" else "bf16_reference"
    pool, scale = kp.kpool_compress(k, gate, wt["compress_ape"], layout[0], mode=mode)
    if prec == "fp8":
        q_s, w_s = kp.kpool_quant_query(q, w)
    else:
        q_s, w_s = q, w
    logits = kp.kpool_logits(q_s, w_s, pool, scale, precision=prec)
    stages = {
        "project": lambda: kp.kpool_project(x, wt["wk"], wt["k_norm_weight"], wt["k_norm_bias"],
                                            wt["weights_proj"], wt["compress_gate"], head_proj=head_proj),
        "layout": lambda: kp.kpool_layout(cu, tokens, POOL),
        "compress": lambda: kp.kpool_compress(k, gate, wt["compress_ape"], layout[0], mode=mode),
        "score": lambda: kp.kpool_logits(q_s, w_s, pool, scale, precision=prec),
        "select": lambda: kp.kpool_select(logits, *layout[1:], topk=topk, pool_size=POOL),
        "total": lambda: kpool_indexer(x, q_resid, *wt.values(), cu, topk=topk, kpool=prec,
                                          kpool_pooling="reference", head_proj=head_proj,
                                          logits_budget_mb=1024),
    }
    if prec == "fp8":
        stages["quant_query"] = lambda: kp.kpool_quant_query(q, w)
    row = {"tokens": tokens, "heads": H, "precision": prec}
    for name, fn in stages.items():
        row[name] = timing.replay_stats(fn, samples, warmup)
    flops = 2 * tokens * (tokens // POOL) * H * DIM
    row["score_tflops"] = flops / (row["score"]["p50_us"] * 1e-6) / 1e12
    row["score_fraction_of_scaled_mm"] = row["score_tflops"] / peak
    row["select_over_score"] = row["select"]["p50_us"] / row["score"]["p50_us"]
    prog.note(f"kpool H={H} {prec}: " + ", ".join(
        f"{n} {row[n]['p50_us']:.0f}" for n in stages) + f" us p50; score {row['score_tflops']:.0f} TFLOP/s")
    return row


SCORER_FRACTION_TARGET = 0.50  # speed target: the FP8 scorer at >= 50 % of the FP8 matmul rate
SELECT_OVER_SCORE_TARGET = 0.25  # speed target: selection + expansion <= 25 % of scoring time


def kpool_targets(result: dict) -> list[dict]:
    """The indexer's speed targets per row of :func:`bench_kpool`: ``{"heads", "precision", "target",
    "value", "met"}`` for the scorer rate (FP8 rows only) and the selection share (every row)."""
    out = []
    for r in result["rows"]:
        if r["precision"] == "fp8":
            value = r["score_fraction_of_scaled_mm"]
            out.append({"heads": r["heads"], "precision": "fp8",
                        "target": f"score >= {SCORER_FRACTION_TARGET:.2f} of scaled_mm",
                        "value": value, "met": value >= SCORER_FRACTION_TARGET})
        value = r["select_over_score"]
        out.append({"heads": r["heads"], "precision": r["precision"],
                    "target": f"select <= {SELECT_OVER_SCORE_TARGET:.2f} of score",
                    "value": value, "met": value <= SELECT_OVER_SCORE_TARGET})
    return out


def format_kpool(result: dict) -> str:
    """A markdown table of :func:`bench_kpool`'s rows (p50 / max in microseconds)."""
    stages = ("project", "layout", "compress", "quant_query", "score", "select", "total")
    lines = ["| H | precision | " + " | ".join(stages) + " | score TFLOP/s (of scaled_mm) | select/score |",
             "| --- | --- | " + " | ".join("---" for _ in stages) + " | --- | --- |"]
    for r in result["rows"]:
        cells = [f"{r[s]['p50_us']:.0f} / {r[s]['max_us']:.0f}" if s in r else "–" for s in stages]
        lines.append(f"| {r['heads']} | {r['precision']} | " + " | ".join(cells) +
                     f" | {r['score_tflops']:.0f} ({100 * r['score_fraction_of_scaled_mm']:.0f} %) | "
                     f"{r['select_over_score']:.2f} |")
    lines.append(f"\nFP8 torch._scaled_mm 8192³: {result['scaled_mm_tflops']:.0f} TFLOP/s")
    for t in kpool_targets(result):
        lines.append(f"Target {t['target']}, H={t['heads']} {t['precision']}: {t['value']:.2f} "
                     f"({'met' if t['met'] else 'NOT met'})")
    return "\n".join(lines)
