"""MoE expert activation at the ``h200`` shapes: what the aligned SwiGLU + FP8 QDQ path costs.

Timed (one process, CUDA-graph replay, ``samples`` replays, p50 / max; the method of
:mod:`inductor_ext.bench.timing`) twice: a replay of one call, and a replay of ``BACK_TO_BACK`` calls
divided by that count (without the graph launch and the ramp-up and tail of a lone kernel, which
add 5-10 µs to these 30-40 µs kernels on the H200), on the expert's gate/up projection output
``gate_up [tokens, 2·inter]`` BF16 split into gate | up (:func:`inductor_ext.bench.inputs.moe_inputs`),
limit 10:

- ``plain_bf16``: ``F.silu(gate) * up`` compiled by Inductor (the BF16 SwiGLU baseline).
- ``aligned_fused``: ``fp8_qdq(swiglu(gate, up, mode="serving"), "ue8m0")`` compiled by Inductor
  with ``inductor_ext.enable()``: the lowerings fuse both ops into one kernel; its output is the
  BF16 â that the down projection reads (the scales are not materialized).
- ``unfused_compiled``: the same two ops compiled separately (each op one Inductor kernel, the
  BF16 activation written and read back in between): what the ops cost as opaque kernels.
- ``unfused_eager``: the two eager custom-op calls (their plain-torch reference kernels, several
  ATen launches each): what the model runs without Inductor.
- ``copy``: ``dst.copy_(gate_up)``, device-to-device, the bandwidth peer.
- ``lmdeploy_v4_swiglu_quant`` (only when LMDeploy's kernel module is importable: ``python
  scripts/fetch_lmdeploy_kernels.py``, ``PYTHONPATH=.lmdeploy``): the serving engine's fused
  SwiGLU + e4m3 quantization, writing e4m3 values and FP32 scales.
- expert input (``[tokens, hidden]`` BF16): ``fp8_qdq(x, "ue8m0")`` compiled, and LMDeploy's
  ``quant_fp8`` when importable.

Bytes moved are counted at the kernels' boundaries, each tensor once, no cache effects: SwiGLU
variants read gate + up (2 · tokens · inter · 2 B) and write the BF16 output (tokens · inter · 2 B);
the unfused variants add the intermediate activation's write and read; the copy reads and writes
gate_up; e4m3 outputs count 1 B per value plus 4 B per 128-group scale. Achieved bandwidth is
bytes / p50 time; "% of copy" divides it by the copy's achieved bandwidth in the same run.
Kernel counts come from one profiled call (CUDA kernels and copies; None where the profiler is
unavailable).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

import inductor_ext
from inductor_ext import ops
from inductor_ext.bench import timing
from inductor_ext.bench.inputs import moe_inputs
from inductor_ext.bench.progress import Progress

__all__ = ["bench_moe_act", "format_moe_act"]

LIMIT = 10.0
GROUP = 128
TARGET_TOKENS = 8192  # the targets are stated at the h200 MoE shape; smaller runs are launch-bound
BF16 = 2  # bytes per BF16 element
BACK_TO_BACK = 10


def _kernel_count(fn) -> int | None:
    """CUDA kernels and copies launched by one call of ``fn`` (after warm-up), or None."""
    try:
        fn()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            fn()
            torch.cuda.synchronize()
        return sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)
    except Exception:  # noqa: BLE001  (no CUPTI: the count is informative only)
        return None


def _lmdeploy():
    """LMDeploy's Triton modules (quant_fp8, v4 SwiGLU + quant), or None when not importable."""
    try:
        from lmdeploy.pytorch.kernels.cuda import blocked_gemm_fp8
        from lmdeploy.pytorch.kernels.cuda.moe import v4_swiglu_quant
    except Exception:  # noqa: BLE001
        return None
    return blocked_gemm_fp8, v4_swiglu_quant


def bench_moe_act(tokens=8192, hidden=4096, inter=2048, samples=50, progress=None) -> dict:
    """Replay timing of the MoE activation variants (module docstring); returns the result dict."""
    if not torch.cuda.is_available():
        raise ValueError("bench moe needs a CUDA device")
    inductor_ext.enable()
    gate_up, x_in = moe_inputs(tokens, hidden, inter, device="cuda", draw_on_device=True)
    dst = torch.empty_like(gate_up)
    compile_ = lambda fn: torch.compile(fn, backend="inductor", fullgraph=True, dynamic=False)  # noqa: E731

    def split(gu):
        return gu.chunk(2, dim=-1)

    def plain(gu):
        gate, up = split(gu)
        return F.silu(gate) * up

    def act(gu):
        gate, up = split(gu)
        return ops.swiglu(gate, up, limit=LIMIT, mode="serving")

    def qdq(a):
        return ops.fp8_qdq(a, scale_fmt="ue8m0")

    def aligned(gu):
        return qdq(act(gu))

    plain_c, aligned_c, act_c, qdq_c = compile_(plain), compile_(aligned), compile_(act), compile_(qdq)
    act_bytes = tokens * inter * BF16
    fp8_bytes = lambda n: n + n // GROUP * 4  # noqa: E731  (e4m3 values + FP32 scales)
    variants = [  # name, what, callable, bytes moved
        ("copy", f"dst.copy_(gate_up) [{tokens}, {2 * inter}] bf16", lambda: dst.copy_(gate_up), 4 * act_bytes),
        ("plain_bf16", "F.silu(gate) * up, inductor", lambda: plain_c(gate_up), 3 * act_bytes),
        ("aligned_fused", "fp8_qdq(swiglu serving), inductor + enable()", lambda: aligned_c(gate_up), 3 * act_bytes),
        ("unfused_compiled", "swiglu, then fp8_qdq: two inductor graphs", lambda: qdq_c(act_c(gate_up)),
         5 * act_bytes),
        ("unfused_eager", "swiglu, then fp8_qdq: eager custom ops", lambda: aligned(gate_up), 5 * act_bytes),
    ]
    lmd = _lmdeploy()
    if lmd is not None:
        quant_mod, swiglu_mod = lmd
        variants.append(("lmdeploy_v4_swiglu_quant", "LMDeploy v4_swiglu_and_quant_fp8 (e4m3 + scales)",
                         lambda: swiglu_mod.v4_swiglu_and_quant_fp8(gate_up, swiglu_limit=LIMIT, scale_fmt="ue8m0"),
                         2 * act_bytes + fp8_bytes(tokens * inter)))
    in_bytes = tokens * hidden * BF16
    expert_in = [("expert_input_fp8_qdq", f"fp8_qdq(x [{tokens}, {hidden}]), inductor", lambda: qdq_c(x_in),
                  2 * in_bytes)]
    if lmd is not None:
        expert_in.append(("lmdeploy_quant_fp8", f"LMDeploy quant_fp8(x [{tokens}, {hidden}], 128, ue8m0)",
                          lambda: quant_mod.quant_fp8(x_in, GROUP, scale_fmt="ue8m0"),
                          in_bytes + fp8_bytes(tokens * hidden)))

    rows = []
    timing.spin(lambda: dst.copy_(gate_up))
    with Progress(progress, total=len(variants) + len(expert_in), desc="bench moe") as prog:
        for group, items in (("activation", variants), ("expert_input", expert_in)):
            for name, what, fn, nbytes in items:
                prog.step(f"bench moe: {name}")
                fn()  # compile / autotune outside the timing
                kernels = _kernel_count(fn)
                stats = timing.replay_stats(fn, samples)
                b2b = timing.replay_stats(fn, samples, calls=BACK_TO_BACK)
                rows.append({"name": name, "group": group, "what": what, "kernels": kernels, "bytes": nbytes,
                             **stats, "gbps": nbytes / (stats["p50_us"] * 1e-6) / 1e9,
                             "b2b_p50_us": b2b["p50_us"], "b2b_max_us": b2b["max_us"],
                             "b2b_gbps": nbytes / (b2b["p50_us"] * 1e-6) / 1e9})
    by = {r["name"]: r for r in rows}
    copy, plain = by["copy"], by["plain_bf16"]
    for r in rows:
        for pre in ("", "b2b_"):
            r[pre + "pct_copy"] = 100 * r[pre + "gbps"] / copy[pre + "gbps"]
            r[pre + "vs_plain"] = r[pre + "p50_us"] / plain[pre + "p50_us"] if r["group"] == "activation" else None
    fused = by["aligned_fused"]
    targets = {"judged": tokens == TARGET_TOKENS}
    for pre in ("", "b2b_"):  # one call per replay, then back to back
        targets[pre + "fused_vs_plain"] = fused[pre + "vs_plain"]
        targets[pre + "fused_vs_plain_ok"] = fused[pre + "vs_plain"] <= 1.1
        targets[pre + "fused_pct_copy"] = fused[pre + "pct_copy"]
        targets[pre + "fused_pct_copy_ok"] = fused[pre + "pct_copy"] >= 80.0
    return {
        "tokens": tokens, "hidden": hidden, "inter": inter, "samples": samples, "limit": LIMIT,
        "device": torch.cuda.get_device_name(), "torch": torch.__version__,
        "lmdeploy_peer": lmd is not None, "copy_gbps": copy["gbps"], "back_to_back": BACK_TO_BACK, "rows": rows,
        "targets": targets,
        "bytes_note": "bytes counted at kernel boundaries, each tensor once: SwiGLU reads gate+up bf16 and writes "
                      "the bf16 output; unfused adds the intermediate's write+read; copy reads+writes gate_up; "
                      "e4m3 outputs 1 B/value + 4 B per 128-group scale",
    }


def _vs(row: dict, pre: str) -> str:
    """The row's time relative to plain BF16 (``pre``: "" or "b2b_"), "–" where not compared."""
    return "–" if row.get(pre + "vs_plain") is None else f"{row[pre + 'vs_plain']:.2f}"


def format_moe_act(result: dict) -> str:
    """Markdown table of :func:`bench_moe_act`'s rows, the activation's speed targets under it."""
    b2b = result.get("back_to_back", BACK_TO_BACK)
    lines = [f"MoE activation, {result['tokens']} tokens, moe_intermediate {result['inter']}, hidden "
             f"{result['hidden']} ({result.get('device', '?')}, torch {result.get('torch', '?')}, "
             f"{result['samples']} CUDA-graph replays)", "",
             "| variant | what | kernels | MB moved | p50 / max µs | GB/s | × plain BF16 | % of copy "
             f"| {b2b} back to back: µs per call | GB/s | × plain | % of copy |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in result["rows"]:
        kernels = "?" if r.get("kernels") is None else str(r["kernels"])
        lines.append(f"| {r['name']} | {r['what']} | {kernels} | {r['bytes'] / 1e6:.1f} | "
                     f"{r['p50_us']:.1f} / {r['max_us']:.1f} | {r['gbps']:.0f} | {_vs(r, '')} | "
                     f"{r['pct_copy']:.0f} % | {r['b2b_p50_us']:.1f} | {r['b2b_gbps']:.0f} | {_vs(r, 'b2b_')} | "
                     f"{r['b2b_pct_copy']:.0f} % |")
    t = result["targets"]
    judged = t.get("judged", True)
    ok = lambda b: ("met" if b else "NOT met") if judged else "not judged"  # noqa: E731
    lines.append("")
    for pre, how in (("", "one call per replay"), ("b2b_", f"{b2b} calls back to back")):
        lines.append(f"Targets ({how}): aligned_fused ≤ 1.1× plain BF16 SwiGLU: {t[pre + 'fused_vs_plain']:.2f}× "
                     f"({ok(t[pre + 'fused_vs_plain_ok'])}); ≥ 80 % of copy bandwidth: "
                     f"{t[pre + 'fused_pct_copy']:.0f} % ({ok(t[pre + 'fused_pct_copy_ok'])}).")
    if not judged:
        lines.append(f"The targets are stated at {TARGET_TOKENS} tokens; at {result['tokens']} the kernels are "
                     "launch-bound and the ratios say little.")
    lines.append(f"Bytes: {result['bytes_note']}.")
    if not result.get("lmdeploy_peer"):
        lines.append("LMDeploy peers skipped (not importable: scripts/fetch_lmdeploy_kernels.py; PYTHONPATH=.lmdeploy)")
    return "\n".join(lines)

