"""What the plugin's eager numerics (``lowerings.own_numerics`` switches them off: the settings of
``lowerings._compat.EAGER_NUMERICS``, the GEMM rewrites, the CUDA sigmoid / silu) cost on a GPU: the
h200 KDA and DSA layers (``bench layer``, timing only: forward and forward + backward, CUDA-graph
replay p50) compiled under Inductor's own numerics and under the plugin's, one after the other in one
process, for the serving-aligned config and its batch-invariant form (``bench invariance``'s pair);
and, for code without a ``glm53`` op, a plain BF16 RMSNorm + SwiGLU MLP block ([T, 4096] -> 12288
-> 4096) forward + backward, CUDA-graph replay p50 under both.

    python docs/experiments/eager_numerics_price.py --tokens 8192 --samples 20 --out price.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import pathlib
import sys

import torch

import inductor_ext
from inductor_ext.bench import layer as layer_bench
from inductor_ext.bench import timing
import lowerings


def plain_block(tokens: int, samples: int) -> dict:
    """p50 / max us of a compiled BF16 RMSNorm + SwiGLU MLP forward + backward (no glm53 op) under
    Inductor's numerics and the plugin's, one after the other."""
    torch.manual_seed(0)
    D, inter = 4096, 12288
    w = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16, requires_grad=True) * 0.02
         for n, k in ((inter, D), (inter, D), (D, inter))]
    w = [t.detach().requires_grad_(True) for t in w]
    norm = torch.ones(D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    x = torch.randn(tokens, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)

    def block(x):
        xf = x.float()
        h = (xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + 1e-6)).to(x.dtype) * norm
        return (torch.nn.functional.silu(h @ w[0].t()) * (h @ w[1].t())) @ w[2].t()

    out = {}
    for numerics, numerics_block in (("inductor", lowerings.own_numerics), ("plugin", contextlib.nullcontext)):
        torch._dynamo.reset()
        with numerics_block():
            compiled = torch.compile(block, backend="inductor", fullgraph=True)

            def step(compiled=compiled):
                compiled(x).float().square().mean().backward()

            out[numerics] = timing.replay_stats(step, samples=samples)
    out["ratio"] = out["plugin"]["p50_us"] / out["inductor"]["p50_us"]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--samples", type=int, default=20)
    parser.add_argument("--precisions", nargs="+", default=["serving_aligned", "batch_invariant"])
    parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path("eager_numerics_price.json"))
    args = parser.parse_args()
    inductor_ext.enable()
    block = plain_block(args.tokens, args.samples)
    print("plain BF16 block:", json.dumps(block), file=sys.stderr, flush=True)
    runs, ratios = {}, []
    for precision in args.precisions:
        for numerics, numerics_block in (("inductor", lowerings.own_numerics), ("plugin", contextlib.nullcontext)):
            with numerics_block():
                result = layer_bench.bench_layer(args.tokens, kinds=layer_bench.KINDS, samples=args.samples,
                                                 precision=precision, timing_only=True)
            runs[f"{precision}/{numerics}"] = result
            torch._dynamo.reset()
            torch.cuda.empty_cache()
        plain, plugin = (runs[f"{precision}/{n}"]["rows"] for n in ("inductor", "plugin"))
        for a, b in zip(plain, plugin):
            ratio = b["p50_us"] / a["p50_us"] if a.get("p50_us") and b.get("p50_us") else None
            ratios.append({"precision": precision, "kind": a["kind"], "variant": a["variant"],
                           "inductor_p50_us": a.get("p50_us"), "plugin_p50_us": b.get("p50_us"),
                           "inductor_max_us": a.get("max_us"), "plugin_max_us": b.get("max_us"), "ratio": ratio})
            print(json.dumps(ratios[-1]), file=sys.stderr, flush=True)
        args.out.write_text(json.dumps({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                                        "tokens": args.tokens, "samples": args.samples, "ratios": ratios,
                                        "plain_block": block,
                                        "runs": runs}, indent=2, default=str))
    print("| precision | layer | step | Inductor p50 us | plugin p50 us | ratio |")
    print("| --- | --- | --- | --- | --- | --- |")
    for r in ratios:
        print(f"| {r['precision']} | {r['kind']} | {r['variant']} | {r['inductor_p50_us']} | {r['plugin_p50_us']} | "
              f"{r['ratio'] and round(r['ratio'], 3)} |")


if __name__ == "__main__":
    main()
