"""Fake benchmark results (the shapes :mod:`inductor_ext.bench`'s functions return) for the
formatting, registry and command-line tests: no GPU needed."""

from __future__ import annotations

__all__ = ["kpool_row", "kpool_result", "moe_row", "moe_targets", "moe_result", "layer_result"]


def kpool_row(heads, precision, score_us, select_us, fraction) -> dict:
    """A :func:`~inductor_ext.bench.kpool.bench_kpool` row: every stage ``p50_us = us``, ``max_us = us + 1``."""
    stage = lambda us: {"p50_us": us, "max_us": us + 1}  # noqa: E731
    row = {"tokens": 16384, "heads": heads, "precision": precision, "score": stage(score_us),
           "select": stage(select_us), "total": stage(score_us + select_us), "score_tflops": 1400 * fraction,
           "score_fraction_of_scaled_mm": fraction, "select_over_score": select_us / score_us}
    for name in ("project", "layout", "compress"):
        row[name] = stage(10.0)
    return row


def kpool_result() -> dict:
    """Three rows: H=32 bf16 and fp8, H=64 fp8 (the fp8 scorers at 0.50 and 0.49 of scaled_mm)."""
    return {"scaled_mm_tflops": 1400.0,
            "rows": [kpool_row(32, "bf16", 920.0, 400.0, 0.42), kpool_row(32, "fp8", 560.0, 139.0, 0.50),
                     kpool_row(64, "fp8", 1000.0, 251.0, 0.49)]}


def moe_row(name, group, us, nbytes, kernels, vs_plain, pct_copy) -> dict:
    """A :func:`~inductor_ext.bench.moe.bench_moe_act` row whose back-to-back figures are 0.8x the
    time (1.25x the bandwidth) of the single-call ones."""
    b2b = us * 0.8
    return {"name": name, "group": group, "what": f"{name} what", "kernels": kernels, "bytes": nbytes,
            "p50_us": us, "max_us": us * 1.1, "samples": 50, "gbps": nbytes / (us * 1e-6) / 1e9,
            "vs_plain": vs_plain, "pct_copy": pct_copy, "b2b_p50_us": b2b, "b2b_max_us": b2b * 1.1,
            "b2b_gbps": nbytes / (b2b * 1e-6) / 1e9, "b2b_vs_plain": vs_plain, "b2b_pct_copy": pct_copy * 1.7}


def moe_targets(vs_plain, pct_copy, judged=True) -> dict:
    """The ``targets`` of a MoE result (back to back: 1.7x the single-call share of copy)."""
    return {"judged": judged, "fused_vs_plain": vs_plain, "fused_vs_plain_ok": vs_plain <= 1.1,
            "fused_pct_copy": pct_copy, "fused_pct_copy_ok": pct_copy >= 80, "b2b_fused_vs_plain": vs_plain,
            "b2b_fused_vs_plain_ok": vs_plain <= 1.1, "b2b_fused_pct_copy": pct_copy * 1.7,
            "b2b_fused_pct_copy_ok": pct_copy * 1.7 >= 80}


def moe_result() -> dict:
    """8192 tokens, no LMDeploy peer: copy, plain_bf16, aligned_fused (kernel count unknown) and the
    expert input's QDQ; aligned_fused at 1.04x plain and 50.3 % of copy."""
    act = 8192 * 2048 * 2
    return {
        "tokens": 8192, "hidden": 4096, "inter": 2048, "samples": 50, "limit": 10.0, "device": "fake H200",
        "torch": "2.x", "lmdeploy_peer": False, "copy_gbps": 4000.0,
        "rows": [moe_row("copy", "activation", 33.5, 4 * act, 1, 0.7, 100.0),
                 moe_row("plain_bf16", "activation", 48.0, 3 * act, 1, 1.0, 52.0),
                 moe_row("aligned_fused", "activation", 50.0, 3 * act, None, 1.04, 50.3),
                 moe_row("expert_input_fp8_qdq", "expert_input", 40.0, 2 * 8192 * 4096 * 2, 1, None, 84.0)],
        "targets": moe_targets(1.04, 50.3),
        "bytes_note": "counted at kernel boundaries",
    }


def layer_result() -> dict:
    """A :func:`~inductor_ext.bench.layer.bench_layer` result: a KDA fwd row, a DSA fwd_bwd row that
    fell back to a manual capture with a failed eager reference, and a failed DSA fwd row."""
    base = {"capture": "reduce-overhead", "cudagraph_skips": 0, "graph_breaks": 0, "cold_compile_s": 61.2,
            "warm_compile_s": 4.3, "peak_step_gib": 20.5, "peak_first_gib": 31.0, "eager_peak_gib": 40.2,
            "p50_us": 12340.0, "max_us": 13000.0, "samples": 20, "equals_eager": True, "cudagraph_or_error": True,
            "cudagraphs_recorded": 1}
    dx = {"max_abs": 1e-7, "max_rel": 0.5, "tokens_mismatched": 3, "tokens": 8192}
    return {"device": "NVIDIA H200", "torch": "2.11.0", "tokens": 8192, "samples": 20, "precision": "serving_aligned",
            "preset": "h200", "method": "reduce-overhead", "rows": [
                {**base, "kind": "kda", "variant": "fwd", "attn_impl": None,
                 "vs_eager": {"out": {**dx, "max_abs": 0.01, "tokens_mismatched": 0}}},
                {**base, "kind": "dsa", "variant": "fwd_bwd", "attn_impl": "flex", "capture": "manual",
                 "equals_eager": None, "eager_error": "OutOfMemoryError: CUDA out of memory", "vs_eager": None,
                 "reduce_overhead_error": "[reduce-overhead] RuntimeError: skipping cudagraphs due to cpu device"},
                {"kind": "dsa", "variant": "fwd", "attn_impl": "flex", "error": "[manual] RuntimeError: boom | x"},
            ]}
