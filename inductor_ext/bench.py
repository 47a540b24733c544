"""``python -m inductor_ext bench kda``: CUDA-graph replay timing of the KDA chunk op.

Peers timed in the same process at B=1, H=64, K=V=128: flash-linear-attention's public
``chunk_kda`` (L2 norm in kernel) on BF16 inputs, on FP32 inputs promoted before timing
(``fla_chunk_kda_fp32``: the kernels alone) and promoted inside the timed call with the output cast
back to BF16 (``fla_chunk_kda_fp32_promoting``: what a training stack pays to run KDA in FP32), ours
``bf16`` and ours ``fp32`` (BF16 inputs, which its kernels read as they are). Forward: p50 / max of single
graph replays; forward+backward: the same for a graph that holds the forward and ``torch.autograd.grad`` of all five inputs.
"""

from __future__ import annotations

import torch

from inductor_ext import backends, timing
from inductor_ext.ops import kda_chunk

__all__ = ["bench_kda", "format_kda", "run_benches", "format_benches", "BENCHES", "DEFAULT_TOKENS"]

DEFAULT_TOKENS = (129, 2048, 16384)
BENCHES = ("kda", "kpool", "moe", "layer")  # what ``bench all`` (and ``report`` on CUDA) runs, in order


def _inputs(T, H, K, V, device="cuda"):
    gen = torch.Generator(device=device).manual_seed(0)
    rnd = lambda *s: torch.randn(*s, device=device, generator=gen)  # noqa: E731
    leaves = {
        "q": rnd(1, T, H, K).bfloat16(), "k": rnd(1, T, H, K).bfloat16(), "v": rnd(1, T, H, V).bfloat16(),
        "g": -5.0 * torch.sigmoid(rnd(1, T, H, K) - 3.0), "beta": torch.sigmoid(rnd(1, T, H)).bfloat16(),
    }
    return {n: x.requires_grad_(True) for n, x in leaves.items()}


def _peers():
    """name → (fn(inputs), dtype of q/k/v/beta the peer is fed: promoted before timing, not inside it)."""
    peers = {
        "ours_bf16": (lambda x: kda_chunk(*x.values(), precision="bf16"), torch.bfloat16),
        "ours_fp32": (lambda x: kda_chunk(*x.values(), precision="fp32"), torch.bfloat16),
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
    for T in tokens:
        inputs = _inputs(T, heads, dim, dim)
        do = torch.randn(1, T, heads, dim, device="cuda").bfloat16()
        for name, (fn, dtype) in peers.items():
            if progress:
                progress(f"kda T={T} {name}")
            x = _promoted(inputs, dtype)

            def fwd():
                with torch.no_grad():
                    fn(x)

            def fwd_bwd():
                o, _ = fn(x)
                torch.autograd.grad(o, list(x.values()), do.to(o.dtype))

            row = {"tokens": T, "heads": heads, "dim": dim, "peer": name}
            for label, step in (("fwd", fwd), ("fwd_bwd", fwd_bwd)):
                stats = timing.replay_stats(step, samples, warmup)
                row.update({f"{label}_{k}": v for k, v in stats.items() if k != "samples"})
            row["samples"] = samples
            rows.append(row)
            if progress:  # each row as soon as it is measured: a run cut short still reports it
                progress(f"kda T={T} {name}: fwd {row['fwd_p50_us']:.1f} / {row['fwd_max_us']:.1f} us, "
                         f"fwd+bwd {row['fwd_bwd_p50_us']:.1f} / {row['fwd_bwd_max_us']:.1f} us (p50 / max)")
        torch.cuda.empty_cache()
    return {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
            "fla": backends.version("fla"), "method": "CUDA-graph replay, CUDA events", "rows": rows}


def format_kda(result: dict) -> str:
    """A markdown table of :func:`bench_kda`'s rows."""
    lines = ["| T | peer | fwd p50 / max (us) | fwd+bwd p50 / max (us) |", "| --- | --- | --- | --- |"]
    for r in result["rows"]:
        lines.append(f"| {r['tokens']} | {r['peer']} | {r['fwd_p50_us']:.1f} / {r['fwd_max_us']:.1f} | "
                     f"{r['fwd_bwd_p50_us']:.1f} / {r['fwd_bwd_max_us']:.1f} |")
    return "\n".join(lines)


def run_benches(what=BENCHES, tokens=None, samples: int = 50, progress=None, on_result=None) -> dict:
    """Run the named benchmarks (subset of :data:`BENCHES`, in that order) on CUDA; ``tokens``: the
    KDA token counts (default :data:`DEFAULT_TOKENS`), its first entry also the token count of the
    others (default: each benchmark's own). ``on_result(name, result)`` is called after each."""
    from inductor_ext.bench_kpool import bench_kpool
    from inductor_ext.bench_layer import bench_layer
    from inductor_ext.bench_moe import bench_moe_act

    unknown = [name for name in what if name not in BENCHES]
    if unknown:
        raise ValueError(f"run_benches: unknown benchmark(s) {unknown}; choose from {BENCHES}")
    kw = {"tokens": tokens[0]} if tokens else {}
    run = {
        "kda": lambda: bench_kda(tokens=tokens or DEFAULT_TOKENS, samples=samples, progress=progress),
        "kpool": lambda: bench_kpool(samples=samples, progress=progress, **kw),
        "moe": lambda: bench_moe_act(samples=samples, progress=progress, **kw),
        "layer": lambda: bench_layer(samples=min(samples, 20), progress=progress, **kw),
    }
    results = {}
    for name in BENCHES:
        if name in what:
            results[name] = run[name]()
            if on_result:
                on_result(name, results[name])
    return results


def format_benches(results: dict) -> str:
    """The markdown tables of :func:`run_benches`' results, one section each."""
    from inductor_ext.bench_kpool import format_kpool
    from inductor_ext.bench_layer import format_layer
    from inductor_ext.bench_moe import format_moe_act

    fmt = {"kda": ("KDA op", format_kda), "kpool": ("KPool indexer, per stage", format_kpool),
           "moe": ("MoE activation (SwiGLU + FP8 QDQ)", format_moe_act), "layer": ("Whole layers", format_layer)}
    return "\n\n".join(f"### {fmt[n][0]}\n\n{fmt[n][1](r)}" for n, r in results.items())
