"""Attributes the train/serve mismatch that Inductor adds to the eager training model (without
batch invariance) to families of Inductor's own kernels, by sending one family at a time to ATen's
kernels (``lowerings._compat.fallback_to_aten``; a fresh process per variant, since that is
process-wide), or by leaving Inductor's GEMM rewrites installed
(``lowerings._compat.install_eager_gemms`` skipped), and re-running
``python -m inductor_ext mismatch --compile inductor`` on the same rollout.

    python docs/experiments/inductor_attribution.py --out attribution_out [--arms reference serving_aligned]

Writes ``attribution.json`` and prints a Markdown table: per variant and arm, k3 and the number of
tokens with r != 0. ``eager`` is the training model uncompiled (the target), ``inductor`` the plugin
as users run it.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import subprocess
import sys

VARIANTS = {
    "eager": None,
    "inductor": [],
    "Inductor's GEMM rewrites kept (mm + add -> addmm)": "gemm rewrites",
    "norms (mean, layer_norm)": ["aten.mean.dim", "aten.native_layer_norm.default"],
    "sums": ["aten.sum.dim_IntList"],
    "softmax": ["aten._softmax.default", "aten._log_softmax.default"],
    "router (topk, sort)": ["aten.topk.default", "aten.sort.stable", "aten.sort.default"],
    "transcendentals": ["aten.exp.default", "aten.sigmoid.default", "aten.rsqrt.default", "aten.silu.default",
                        "aten.log.default", "aten.log1p.default", "aten.softplus.default"],
    "grouped GEMM (MoE experts)": ["aten._grouped_mm.default"],
}


def _overload(name: str):
    import torch

    namespace, op, overload = name.split(".")
    return getattr(getattr(getattr(torch.ops, namespace), op), overload)


def run_variant(name: str, arms: list[str]) -> dict:
    """In this process: the mismatch run of ``arms`` with variant ``name``'s families sent to ATen."""
    import torch

    import inductor_ext
    from inductor_ext.report import MismatchSettings, default_arms, run_mismatch
    from lowerings._compat import fallback_to_aten, inductor_config

    families = VARIANTS[name]
    if families == "gemm rewrites":  # Inductor's post-grad GEMM rewrites stay installed
        import lowerings._compat

        lowerings._compat.install_eager_gemms = lambda: 0
        families = []
    inductor_ext.enable()
    # a fallback is not part of Inductor's cache key: compile afresh, never reuse an artifact
    inductor_config.fx_graph_cache = False
    torch._functorch.config.enable_autograd_cache = False
    aten = [_overload(n) for n in families or ()]
    if aten:
        fallback_to_aten(aten)
    settings = MismatchSettings(num_seqs=8, compile="none" if families is None else "inductor")  # the CLI defaults
    result = run_mismatch(settings, arms={a: default_arms()[a] for a in arms})
    return {a: {"k3": result["arms"][a]["k3"], "num_nonzero_logratio": result["arms"][a]["num_nonzero_logratio"],
                "num_response_tokens": result["num_response_tokens"]} for a in arms}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path("attribution_out"))
    parser.add_argument("--arms", nargs="+", default=["reference", "serving_aligned"])
    parser.add_argument("--variant", help=argparse.SUPPRESS)  # internal: run one variant, print JSON
    args = parser.parse_args()
    if args.variant:
        print("RESULT " + json.dumps(run_variant(args.variant, args.arms)))
        return
    args.out.mkdir(parents=True, exist_ok=True)
    rows = {}
    for name in VARIANTS:
        proc = subprocess.run([sys.executable, __file__, "--variant", name, "--arms", *args.arms],
                              capture_output=True, text=True)
        if proc.returncode:
            sys.exit(f"variant {name!r} failed:\n{proc.stderr[-3000:]}")
        rows[name] = json.loads(next(line for line in proc.stdout.splitlines() if line.startswith("RESULT "))[7:])
        print(f"... {name}: {rows[name]}", file=sys.stderr, flush=True)
        (args.out / "attribution.json").write_text(json.dumps(rows, indent=2))
    print("| sent to ATen | " + " | ".join(f"{a} k3 | {a} r != 0" for a in args.arms) + " |")
    print("| --- |" + " --- | --- |" * len(args.arms))
    for name, row in rows.items():
        cells = [f"{row[a]['k3']:.3g} | {row[a]['num_nonzero_logratio']} / {row[a]['num_response_tokens']}"
                 for a in args.arms]
        print(f"| {name} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
