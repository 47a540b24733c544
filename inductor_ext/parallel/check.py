"""``python -m inductor_ext cp-check``: context parallel against one rank on spawned processes
(``docs/DESIGN.md`` §8).

Spawns ``--ranks`` processes on 127.0.0.1 (NCCL, one GPU each, when CUDA shows at least that many
GPUs; gloo on CPU otherwise), builds the tiny GLM-5.3 model (``graphs.GLM53Config.tiny``: KDA, DSA with its own indexer,
DSA sharing it) in BF16 under the chosen
:class:`~inductor_ext.PrecisionConfig` preset, and runs one packed batch whose documents cross the
shard boundaries twice: on one rank (the reference, every rank computes it) and with
:func:`~inductor_ext.parallel.cp_context`. Compared (max |difference|, relative L2, bitwise):

- the logits (all-gathered into global order);
- the KDA final state of every document of the first KDA layer on a random input
  (:func:`~inductor_ext.parallel.collect_document_states`);
- the KPool indexer's token ids of the first DSA layer's indexer on a random input through
  :func:`~inductor_ext.parallel.kpool_indexer_cp` (must be bitwise);
- every parameter gradient of ``Σ logits·W`` (the CP gradients all-reduced, sum).

Tolerances: logits rel L2 <= 2e-2; KDA states <= 1e-2 (BF16 KDA) / 1e-5 (FP32); ids equal; each
gradient <= max(3e-2, 3·noise), noise = the one-rank BF16 gradient's distance to the same model in
FP32 (ill-conditioned sums such as mHC's 3-element ``scale`` are noise-dominated). Exit status 0
when every row is within tolerance, 1 otherwise.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import pathlib
import socket
import tempfile

import torch

__all__ = ["add_arguments", "run", "format_table", "fp32_copy"]

CONFIGS = ("reference", "serving_aligned")


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The ``cp-check`` options on ``parser`` (for ``inductor_ext.__main__``'s sub-command)."""
    parser.add_argument("--ranks", type=int, default=2, help="processes (default 2)")
    parser.add_argument("--layout", choices=("contiguous", "zigzag"), default="zigzag")
    parser.add_argument("--config", choices=CONFIGS, default="reference", help="PrecisionConfig preset")
    parser.add_argument("--tokens", type=int, default=None,
                        help="global tokens T (default 32·ranks; a multiple of 8·ranks)")
    parser.add_argument("--json", type=pathlib.Path, default=None, help="also write the result as JSON here")
    return parser


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _documents(T: int) -> list[int]:
    # three documents, boundaries off every shard and chunk grid: the middle one spans most shards
    return [0, T * 3 // 16 + 1, T * 11 // 16 + 3, T]


def _row(name: str, got: torch.Tensor, want: torch.Tensor, tol: float | None) -> dict:
    a, b = got.detach().double().cpu(), want.detach().double().cpu()
    diff = (a - b).abs().max().item() if a.numel() else 0.0
    den = b.norm().item()
    rel = (a - b).norm().item() / den if den > 0 else (a - b).norm().item()
    same = got.shape == want.shape and got.dtype == want.dtype and torch.equal(
        got.detach().cpu().contiguous().reshape(-1).view(torch.uint8),
        want.detach().cpu().contiguous().reshape(-1).view(torch.uint8))
    ok = same if tol is None else rel <= tol
    return {"name": name, "max_abs_diff": diff, "rel_l2": rel, "bitwise": bool(same),
            "tolerance": "bitwise" if tol is None else tol, "ok": bool(ok)}


def _worker(rank: int, world: int, port: int, backend: str, layout: str, config: str, T: int, outdir: str):
    import torch.distributed as dist

    if backend == "nccl":
        torch.cuda.set_device(rank)
        device = torch.device("cuda", rank)
    else:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
        device = torch.device("cpu")
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=300))
    try:
        rows, meta = _compare(world, device, layout, config, T)
        if rank == 0:
            torch.save({"rows": rows, "meta": meta}, os.path.join(outdir, "result.pt"))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def fp32_copy(model):
    """``model`` in FP32 (BF16 weights are exact there), for the gradients' BF16 noise: an FP8 indexer
    takes BF16 inputs only, so the copy scores in BF16 with FP32 pooling."""
    import copy

    model32 = copy.deepcopy(model).to(torch.float32)
    if model32.precision is not None and model32.precision.kpool == "fp8":
        model32.precision = model32.precision.replace(kpool="bf16", kpool_pooling="fp32")
    return model32


def _compare(world, device, layout, config, T):

    import torch.distributed as dist

    from graphs import GLM53Config, GLM53Model
    from graphs.kda_layer import document_positions
    from inductor_ext import PrecisionConfig, ops
    from inductor_ext.parallel import collect_document_states, cp_context, halo_exchange, kpool_indexer_cp

    prec = getattr(PrecisionConfig, config)()
    cfg = GLM53Config.tiny()
    torch.manual_seed(0)
    model = GLM53Model(cfg, prec).to_dtype(torch.bfloat16).to(device)
    cu_list = _documents(T)
    cu = torch.tensor(cu_list, dtype=torch.int64, device=device)
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, cfg.vocab_size, (T,), generator=gen).to(device)
    weight = torch.randn(T, cfg.vocab_size, generator=gen).to(device)
    ctx = cp_context(cu, layout=layout)
    rows = []

    def grads_of(m, parallel: bool) -> dict:
        """Gradients of Σ logits·W: one rank (``parallel`` False) or this rank's CP share."""
        loss = (m(ctx.shard(ids), cp=ctx).float() * ctx.shard(weight)).sum() if parallel else \
            (m(ids, cu).float() * weight).sum()
        loss.backward()
        out = {n: p.grad.detach().clone() for n, p in m.named_parameters() if p.grad is not None}
        m.zero_grad(set_to_none=True)
        return out

    with torch.no_grad():
        logits_ref = model(ids, cu)
        logits_cp = ctx.unshard(model(ctx.shard(ids), cp=ctx))
    rows.append(_row("logits", logits_cp, logits_ref, 2e-2))

    # KDA final states of the first KDA layer on a random input
    attn = model.layers[cfg.first_layer("kda")].self_attn
    x = torch.randn(T, cfg.hidden_size, generator=gen).to(device=device, dtype=torch.bfloat16)
    with torch.no_grad():
        qkv = attn.short_conv(attn.qkv_proj(x), document_positions(cu, T, device))
        _, states_ref = attn.mix(x, qkv, cu, prec, False)
        xl = ctx.shard(x)
        raw = attn.qkv_proj(xl)
        qkv_l = attn.short_conv(raw, ctx.doc_positions, halo_exchange(raw, ctx, attn.kernel - 1))
        _, states_local = attn.mix(xl, qkv_l, None, prec, False, cp=ctx)
        states_cp = collect_document_states(states_local, ctx)
    rows.append(_row("kda final states", states_cp, states_ref, 1e-5 if prec.kda == "fp32" else 1e-2))

    # indexer ids
    idx = next(m.self_attn.indexer for m in model.layers if m.kind != "linear_attention" and m.self_attn.indexer)
    params = (idx.wq_b.weight, idx.wk.weight, idx.k_norm.weight, idx.k_norm.bias, idx.weights_proj.weight,
              idx.index_kpool_compress_gate, idx.index_kpool_compress_ape)
    kw = dict(topk=idx.topk, pool_size=idx.pool, kpool=prec.kpool, kpool_pooling=prec.kpool_pooling,
              head_proj=prec.head_proj, mqa_layout=prec.mqa_layout, logits_budget_mb=prec.logits_budget_mb)
    hx = torch.randn(T, cfg.hidden_size, generator=gen).to(device=device, dtype=torch.bfloat16)
    qr = torch.randn(T, cfg.q_lora_rank, generator=gen).to(device=device, dtype=torch.bfloat16)
    want = ops.kpool_indexer(hx, qr, *params, cu, **kw)
    got = ctx.unshard(kpool_indexer_cp(ctx.shard(hx), ctx.shard(qr), *params, ctx, **kw))
    rows.append(_row("indexer ids", got, want, None))

    # parameter gradients; noise: the one-rank BF16 gradient against the same weights in FP32
    grads_ref = grads_of(model, False)
    grads32 = grads_of(fp32_copy(model), False)
    grads_cp = grads_of(model, True)
    for n in grads_ref:
        g = grads_cp.get(n, torch.zeros_like(grads_ref[n]))
        dist.all_reduce(g)
        noise = _row("", grads_ref[n], grads32[n], 1.0)["rel_l2"]
        rows.append(_row(f"grad {n}", g, grads_ref[n], max(3e-2, 3 * noise)))
    meta = {"ranks": world, "backend": "nccl" if device.type == "cuda" else "gloo", "device": device.type,
            "layout": layout, "config": config, "tokens": T, "cu_seqlens": cu_list,
            "model": "tiny", "indexer": "the model's first DSA layer's"}
    return rows, meta


def format_table(result: dict) -> str:
    """The comparison as a Markdown table, headed by the run's settings."""
    m = result["meta"]
    lines = [f"cp-check: {m['ranks']} ranks ({m['backend']}, {m['device']}), layout {m['layout']}, config "
             f"{m['config']}, model {m['model']}, T={m['tokens']}, cu_seqlens {m['cu_seqlens']}",
             "", "| quantity | max abs diff | rel L2 | bitwise | tolerance | ok |", "|---|---|---|---|---|---|"]
    for r in result["rows"]:
        tol = r["tolerance"] if isinstance(r["tolerance"], str) else f"{r['tolerance']:.1e}"
        lines.append(f"| {r['name']} | {r['max_abs_diff']:.3e} | {r['rel_l2']:.3e} | "
                     f"{'yes' if r['bitwise'] else 'no'} | {tol} | {'yes' if r['ok'] else 'NO'} |")
    bad = sum(not r["ok"] for r in result["rows"])
    lines += ["", f"{len(result['rows']) - bad} of {len(result['rows'])} within tolerance"]
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    """Run the check for parsed ``cp-check`` arguments; print the table (and write ``--json``)."""
    import torch.multiprocessing as mp

    W = args.ranks
    if W < 1:
        raise ValueError(f"cp-check: --ranks must be >= 1, got {W}")
    T = 32 * W if args.tokens is None else args.tokens
    if T % (8 * W):
        raise ValueError(f"cp-check: --tokens must be a multiple of 8·ranks = {8 * W}, got {T}")
    backend = "nccl" if torch.cuda.is_available() and torch.cuda.device_count() >= W else "gloo"
    with tempfile.TemporaryDirectory() as outdir:
        mp.start_processes(_worker, args=(W, _free_port(), backend, args.layout, args.config, T, outdir),
                           nprocs=W, join=True, start_method="spawn")
        result = torch.load(os.path.join(outdir, "result.pt"), weights_only=False)
    print(format_table(result))
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {args.json}")
    return 0 if all(r["ok"] for r in result["rows"]) else 1
