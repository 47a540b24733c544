"""``python -m inductor_ext bench kda``: CUDA-graph replay timing of the KDA chunk op.

Peers timed in the same process at B=1, H=64, K=V=128: flash-linear-attention's public
``chunk_kda`` (L2 norm in kernel) on BF16 inputs, on FP32 inputs promoted before timing
(``fla_chunk_kda_fp32``: the kernels alone) and promoted inside the timed call with the output cast
back to BF16 (``fla_chunk_kda_fp32_promoting``: what a training stack pays to run KDA in FP32), ours
``bf16``, ours ``fp32`` (BF16 inputs, which its kernels read as they are) and ours ``fp32_causal``
(the row-causal chunk path that batch-invariant layers run). Forward: p50 / max of
single graph replays; forward+backward: the same for a graph that holds the forward and
``torch.autograd.grad`` of all five inputs.
Inputs: :func:`inductor_ext.bench.inputs.kda_inputs` (one document, seed 0, drawn on the GPU).
"""

from __future__ import annotations

import torch

from inductor_ext import backends
from inductor_ext.bench import timing
from inductor_ext.bench.inputs import kda_inputs
from inductor_ext.bench.progress import Progress
from inductor_ext.ops import kda_chunk

__all__ = ["bench_kda", "format_kda", "DEFAULT_TOKENS"]

DEFAULT_TOKENS = (129, 2048, 16384)


def _peers():
    """name → (fn(inputs), dtype of q/k/v/beta the peer is fed: promoted before timing, not inside it)."""
    peers = {
        "ours_bf16": (lambda x: kda_chunk(*x.values(), precision="bf16"), torch.bfloat16),
        "ours_fp32": (lambda x: kda_chunk(*x.values(), precision="fp32"), torch.bfloat16),
        "ours_fp32_causal": (lambda x: kda_chunk(*x.values(), precision="fp32_causal"), torch.bfloat16),
    }
    if backends.available("fla"):
        from fla.ops.kda import chunk_kda

        def fla(x):
            return chunk_kda(*x.values(), use_qk_l2norm_in_kernel=True, output_final_state=True)

        def fla_promoting(x):
            o, state = fla({n: t.float() for n, t in x.items()})
            return o.bfloat16(), state

        peers = {"fla_chunk_kda_bf16": (fla, torch.bfloat16), "fla_chunk_kda_fp32": (fla, torch.float32),
                 "fla_chunk_kda_fp32_promoting": (fla_promoting, torch.bfloat16), **peers}
    return peers


def _promoted(inputs: dict, dtype: torch.dtype) -> dict:
    return {n: (x if n == "g" else x.detach().to(dtype).requires_grad_(True)) for n, x in inputs.items()}


def bench_kda(tokens=DEFAULT_TOKENS, heads=64, dim=128, samples=50, warmup=3, progress=None) -> dict:
    """Time every peer at every token count; returns the table (``rows``) with device and versions."""
    if not torch.cuda.is_available():
        raise ValueError("bench kda needs a CUDA device")
    rows = []
    peers = _peers()
    with Progress(progress, total=len(tokens) * len(peers), desc="bench kda") as prog:
        for T in tokens:
            rows += _rows_at(T, heads, dim, peers, samples, warmup, prog)
            torch.cuda.empty_cache()
    return {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
            "fla": backends.version("fla"), "method": "CUDA-graph replay, CUDA events", "rows": rows}


def _rows_at(T, heads, dim, peers, samples, warmup, prog) -> list[dict]:
    """One row per peer at ``T`` tokens."""
    rows = []
    inputs, _ = kda_inputs((T,), heads, dim, device="cuda", draw_on_device=True, requires_grad=True)
    do = torch.randn(1, T, heads, dim, device="cuda").bfloat16()
    for name, (fn, dtype) in peers.items():
        prog.step(f"kda T={T} {name}")
        row = {"tokens": T, "heads": heads, "dim": dim, "peer": name}
        for label, step in _steps(fn, _promoted(inputs, dtype), do).items():
            stats = timing.replay_stats(step, samples, warmup)
            row.update({f"{label}_{k}": v for k, v in stats.items() if k != "samples"})
        row["samples"] = samples
        rows.append(row)
        # each row as soon as it is measured: a run cut short still reports it
        prog.note(f"kda T={T} {name}: fwd {row['fwd_p50_us']:.1f} / {row['fwd_max_us']:.1f} us, "
                  f"fwd+bwd {row['fwd_bwd_p50_us']:.1f} / {row['fwd_bwd_max_us']:.1f} us (p50 / max)")
    return rows


def _steps(fn, x: dict, do: torch.Tensor) -> dict:
    """The timed steps of one peer: ``fwd`` (under no_grad) and ``fwd_bwd`` (forward, then
    ``torch.autograd.grad`` of every input with the output cotangent ``do``)."""

    def fwd():
        with torch.no_grad():
            fn(x)

    def fwd_bwd():
        o, _ = fn(x)
        torch.autograd.grad(o, list(x.values()), do.to(o.dtype))

    return {"fwd": fwd, "fwd_bwd": fwd_bwd}


def format_kda(result: dict) -> str:
    """A markdown table of :func:`bench_kda`'s rows."""
    lines = ["| T | peer | fwd p50 / max (us) | fwd+bwd p50 / max (us) |", "| --- | --- | --- | --- |"]
    for r in result["rows"]:
        lines.append(f"| {r['tokens']} | {r['peer']} | {r['fwd_p50_us']:.1f} / {r['fwd_max_us']:.1f} | "
                     f"{r['fwd_bwd_p50_us']:.1f} / {r['fwd_bwd_max_us']:.1f} |")
    return "\n".join(lines)
