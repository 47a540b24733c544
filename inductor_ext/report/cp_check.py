"""``python -m inductor_ext cp-check``: context parallel against one rank on spawned processes
(``docs/DESIGN.md`` §8).

Spawns ``--ranks`` processes on 127.0.0.1 (NCCL, one GPU each, when CUDA shows at least that many
GPUs; gloo on CPU otherwise), builds the tiny GLM-5.3 model (``graphs.GLM53Config.tiny``: KDA, DSA with its own indexer,
DSA sharing it) in BF16 under the chosen
:class:`~inductor_ext.PrecisionConfig` preset, and runs one packed batch whose documents cross the
shard boundaries twice: on one rank (the reference, every rank computes it) and with
:func:`~inductor_ext.parallel.cp_context`. Compared (max |difference|, relative L2, bitwise):

- the logits (all-gathered into global order);
- the model's own indexer selections (the ids of every DSA layer with its own indexer, in that
  forward): the rows whose id sets differ from one rank's;
- the KDA final state of every document of the first KDA layer on a random input
  (:func:`~inductor_ext.parallel.collect_document_states`);
- the KPool indexer's token ids of the first DSA layer's indexer on a random input through
  :func:`~inductor_ext.parallel.kpool_indexer_cp` (must be bitwise);
- every parameter gradient of ``Σ logits·W`` (the CP gradients all-reduced, sum), in BF16 and in
  an FP32 copy of the model (``kda="fp32"``, FP32 weights equal to the BF16 ones), the indexer ids
  of every run PINNED to one rank's BF16 selections (a forward hook on each indexer).

Why pinned: the indexer's top-k is discontinuous. CP's hidden states differ from one rank's at
BF16 rounding level (KDA's chunk boundaries, other GEMM row counts), which decides near ties
between two pools the other way in a few rows (4 ranks, reference: row 73 of layer 1, where CP
agrees with FP32 and one rank does not). One flipped row moves the gradient of an ill-conditioned
sum far: ``layers.1.attn_hc.scale`` (3 numbers, Σ_t |c_t| / |Σ_t c_t| ≈ 13 over the tokens)
by 3.7e-2 / 4.9e-2 (contiguous / zigzag) unpinned, 5.4e-3 pinned. The flips are judged by their own
row and the gradients compare the same discrete function.

Tolerances: logits rel L2 <= 2e-2; the model's indexer rows differing <= those where one rank's
BF16 and FP32 selections differ (both are near ties decided by rounding); KDA states <= 1e-2
(BF16 KDA) / 1e-5 (FP32); ids equal. FP32 gradients (``grad fp32 NAME``) <= 1e-4: the defect
detector, at FP32 rounding for every parameter whatever its conditioning (measured <= 1.6e-5,
KDA's ``dt_bias``); a double count, a missing term or a lost halo gradient is O(1) there. BF16
gradients (``grad NAME``): ``3·√2·noise + fp32_gap``, derived: noise = the size of one BF16
rounding of this gradient, measured on ONE rank only (never on the CP path, so a CP defect cannot
widen its own bound), the larger of two estimates: one rank's pinned BF16 gradient's distance to
the pinned FP32 one (``noise_draw``: a single draw, for a 3-number gradient often a lucky small
one), and √(Σ_r ‖e_r‖²) / ‖g‖ (``noise_groups``), e_r = one rank's BF16 minus FP32 gradient of
the loss terms of rank r's tokens (W independent draws). CP's BF16 gradient is another rounding
of the same FP32 value, so the difference of the two is √2 times that, 3 standard deviations;
fp32_gap = what CP and one rank differ by in FP32 (bounded by its own row). Each BF16 row's JSON
carries ``noise``, ``noise_draw``, ``noise_groups``, ``fp32_gap``, ``kappa`` (‖Σ_r |g_r|‖ /
‖Σ_r g_r‖, the cancellation over the ranks' partials) and ``bound``. Exit status 0 when every
row is within tolerance, 1 otherwise.

Self-test: ``--plant NAME:RANK:FACTOR[:both|bf16|fp32]`` scales one rank's partial gradient
before the all-reduce; the check must then fail (``tests/report/test_cp_check.py`` plants one
into each kind of gradient row).
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import socket
import tempfile

import torch

from inductor_ext.cli_args import arg_type, check_output_path, nonempty_path, positive_int

__all__ = ["add_arguments", "run", "format_table", "fp32_copy", "parse_plant", "check_args"]

CONFIGS = ("reference", "serving_aligned")


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The ``cp-check`` options on ``parser`` (for ``inductor_ext.__main__``'s sub-command)."""
    parser.add_argument("--ranks", type=positive_int, default=2, help="processes (default 2)")
    parser.add_argument("--layout", choices=("contiguous", "zigzag"), default="zigzag")
    parser.add_argument("--config", choices=CONFIGS, default="reference", help="PrecisionConfig preset")
    parser.add_argument("--tokens", type=positive_int, default=None,
                        help="global tokens T (default 32·ranks; a multiple of 8·ranks)")
    parser.add_argument("--json", type=nonempty_path, default=None, help="also write the result as JSON here")
    parser.add_argument("--plant", action="append", default=[], metavar="NAME:RANK:FACTOR[:WHICH]",
                        type=arg_type(parse_plant, "plant"),
                        help="self-test: scale rank RANK's partial gradient of parameter NAME by FACTOR before the "
                             "all-reduce, in the BF16 and FP32 CP runs (WHICH: both, bf16 or fp32); the check "
                             "must then fail (repeatable)")
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


def _worker(rank: int, world: int, port: int, backend: str, layout: str, config: str, T: int, outdir: str,
            plants: tuple = ()):
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
        (rows,), meta = _compare(world, device, layout, config, T, (plants,))
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


FP32_GRAD_TOL = 1e-4  # FP32 model, CP against one rank (measured <= 1.6e-5 on 4 ranks: KDA's dt_bias)
SIGMAS = 3.0  # the BF16 bound covers 3 standard deviations of the difference of two BF16 roundings


def parse_plant(text: str) -> tuple:
    """``NAME:RANK:FACTOR[:WHICH]`` → ``(NAME, RANK, FACTOR, WHICH)``; WHICH = ``both`` (default),
    ``bf16`` or ``fp32``: the CP runs whose partial gradient is scaled. ``ValueError`` naming
    ``--plant`` unless RANK is an int >= 0 and FACTOR a finite number (:func:`check_args` checks
    NAME and RANK against the model and ``--ranks``)."""
    parts = text.split(":")
    rule = "cp-check: --plant must be NAME:RANK:FACTOR[:both|bf16|fp32] (RANK an int >= 0, FACTOR a finite number)"
    if len(parts) not in (3, 4) or not parts[0] or (len(parts) == 4 and parts[3] not in ("both", "bf16", "fp32")):
        raise ValueError(f"{rule}, got {text!r}")
    try:
        rank, factor = int(parts[1]), float(parts[2])
    except ValueError:
        raise ValueError(f"{rule}, got {text!r}") from None
    if rank < 0 or not math.isfinite(factor):
        raise ValueError(f"{rule}, got {text!r}")
    return parts[0], rank, factor, parts[3] if len(parts) == 4 else "both"


def _planted(g: torch.Tensor, name: str, rank: int, plants, which: str) -> torch.Tensor:
    """This rank's partial gradient of ``name``, scaled by every plant aimed at it (a self-test)."""
    g = g.clone()
    for n, r, factor, target in plants:
        if n == name and r == rank and target in ("both", which):
            g.mul_(factor)
    return g


def _selection_hooks(model, ctx, parallel: bool, record: dict | None = None, pin: dict | None = None) -> list:
    """Forward hooks on every DSA layer's own indexer: ``record[i]`` its ids (global rows, CP
    all-gathered), or with ``pin`` its output replaced by ``pin[i]`` (the local rows under CP; a
    shared-indexer layer reuses them). The removable handles."""
    handles = []
    for i, layer in enumerate(model.layers):
        indexer = getattr(layer.self_attn, "indexer", None)
        if indexer is None:
            continue

        def hook(module, args, out, i=i):
            if pin is not None:
                return pin[i].index_select(0, ctx.positions) if parallel else pin[i]
            record[i] = (ctx.unshard(out.contiguous()) if parallel else out).detach().clone()
            return None

        handles.append(indexer.register_forward_hook(hook))
    return handles


def _differing_rows(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Rows whose selected id SETS differ (the order inside a row carries no meaning)."""
    return (a.sort(-1).values != b.sort(-1).values).any(-1).nonzero().flatten()


def _selection_row(layer: int, got: torch.Tensor, want: torch.Tensor, fp32: torch.Tensor) -> dict:
    """The model's own indexer selections, CP against one rank: the share of rows whose ids differ,
    within the share that one rank's BF16 and FP32 runs differ in (near ties decided by rounding)."""
    T = want.shape[0]
    flips, bound = _differing_rows(got, want), _differing_rows(want, fp32)
    return {"name": f"model indexer ids, layer {layer} (rows differing)", "max_abs_diff": float(len(flips)),
            "rel_l2": len(flips) / T, "bitwise": bool(torch.equal(got, want)), "tolerance": len(bound) / T,
            "ok": len(flips) <= len(bound), "rows": flips.tolist(), "rows_one_rank_vs_fp32": bound.tolist(),
            "bound": "rows where one rank's BF16 and FP32 selections differ"}


def _grad_row(name, got, want, got32, want32, abs_sum: float, group_sq: float) -> dict:
    """A BF16 gradient row: CP within ``SIGMAS·√2·noise + fp32_gap`` of one rank (relative L2).

    ``noise`` = the size of one BF16 rounding of this gradient, the larger of two one-rank
    estimates: ``noise_draw``, one rank's BF16 gradient's distance to the same pinned model in
    FP32 (one draw: for a 3-number gradient a lucky small one is likely), and ``noise_groups``,
    √(Σ_r ‖e_r‖²) from the W token groups (``group_sq``). CP's rounding is another draw, so the
    difference of the two is √2 times that; ``fp32_gap`` = what CP and one rank differ by in FP32
    (its own row bounds it). ``kappa`` = ‖Σ_r |g_r|‖ / ‖Σ_r g_r‖: how much the per-rank partials
    cancel (reported, not used)."""
    ref_norm = want.double().norm().item()
    draw = _row("", want, want32, 1.0)["rel_l2"]
    groups = math.sqrt(group_sq) / ref_norm if ref_norm > 0 else math.sqrt(group_sq)
    noise = max(draw, groups)
    gap = (got32.double() - want32.double()).norm().item() / ref_norm if ref_norm > 0 else 0.0
    tol = SIGMAS * math.sqrt(2.0) * noise + gap
    row = _row(f"grad {name}", got, want, tol)
    total = got.double().norm().item()
    row.update(noise=noise, noise_draw=draw, noise_groups=groups, fp32_gap=gap,
               kappa=abs_sum / total if total > 0 else 0.0,
               bound=f"{SIGMAS:g}·√2·noise + fp32_gap")
    return row


def _compare(world, device, layout, config, T, plant_sets=((),)):
    """The rows of one check on this rank (equal on every rank): one list per entry of
    ``plant_sets`` (each a tuple of :func:`parse_plant` tuples; ``()`` = the plain check), the
    forward rows shared, the gradient rows from the same runs with those partials planted."""

    import torch.distributed as dist

    from graphs import GLM53Config, GLM53Model
    from inductor_ext import PrecisionConfig, ops
    from inductor_ext.ops.packing import document_positions
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

    def grads_of(m, parallel: bool, pinned: dict, w=weight) -> dict:
        """Gradients of Σ logits·w, the indexer ids ``pinned``: one rank (``parallel`` False) or
        this rank's CP share (its partial, before any all-reduce)."""
        handles = _selection_hooks(m, ctx, parallel, pin=pinned)
        try:
            loss = (m(ctx.shard(ids), cp=ctx).float() * ctx.shard(w)).sum() if parallel else \
                (m(ids, cu).float() * w).sum()
            loss.backward()
        finally:
            for h in handles:
                h.remove()
        out = {n: p.grad.detach().clone() for n, p in m.named_parameters() if p.grad is not None}
        m.zero_grad(set_to_none=True)
        return out

    pin, sel_cp, sel32 = {}, {}, {}  # indexer ids per DSA layer: one rank BF16 (the pin), CP, one rank FP32
    with torch.no_grad():
        handles = _selection_hooks(model, ctx, False, record=pin)
        logits_ref = model(ids, cu)
        for h in handles:
            h.remove()
        handles = _selection_hooks(model, ctx, True, record=sel_cp)
        logits_cp = ctx.unshard(model(ctx.shard(ids), cp=ctx))
        for h in handles:
            h.remove()
        m32 = fp32_copy(model)
        m32.precision = m32.precision.replace(kda="fp32")
        handles = _selection_hooks(m32, ctx, False, record=sel32)
        m32(ids, cu)
        for h in handles:
            h.remove()
        del m32
    rows.append(_row("logits", logits_cp, logits_ref, 2e-2))
    for i in sorted(pin):
        rows.append(_selection_row(i, sel_cp[i], pin[i], sel32[i]))

    # KDA final states of the first KDA layer on a random input
    attn = model.layers[cfg.first_layer("kda")].self_attn
    x = torch.randn(T, cfg.hidden_size, generator=gen).to(device=device, dtype=torch.bfloat16)
    with torch.no_grad():
        qkv = attn.short_conv(attn.qkv_proj(x, prec), document_positions(cu, T, device))
        _, states_ref = attn.mix(x, qkv, cu, prec, False)
        xl = ctx.shard(x)
        raw = attn.qkv_proj(xl, prec)
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

    # parameter gradients, the selections pinned (see the module docstring): one rank BF16 (the
    # reference; its indexer ids are the pin), CP BF16, and the same pinned runs in FP32
    model32 = fp32_copy(model)
    model32.precision = model32.precision.replace(kda="fp32")
    grads_ref = grads_of(model, False, pin)
    grads32 = grads_of(model32, False, pin)
    local_cp, local32_cp = grads_of(model, True, pin), grads_of(model32, True, pin)
    # W more draws of one rank's BF16 rounding noise, none from the CP path: rank r's one-rank
    # gradient of the loss terms of its own tokens, BF16 against FP32; Σ_r ‖e_r‖² estimates the
    # variance of the whole gradient's rounding error (independent groups)
    mine = torch.zeros(T, 1, device=device).index_fill_(0, ctx.positions, 1.0)
    part = grads_of(model, False, pin, weight * mine)
    part32 = grads_of(model32, False, pin, weight * mine)
    group_sq = {}
    for n, g in grads_ref.items():
        e = (part.get(n, torch.zeros_like(g)).double() - part32.get(n, torch.zeros_like(g)).double()).square().sum()
        dist.all_reduce(e)
        group_sq[n] = e.item()
    rank = dist.get_rank()
    kappa = {}
    for n, g in grads_ref.items():  # Σ_r |g_r| against |Σ_r g_r|: the cancellation over ranks
        a = local_cp.get(n, torch.zeros_like(g)).abs()
        dist.all_reduce(a)
        kappa[n] = a.norm().item()
    row_sets = []
    for plants in plant_sets:
        rows_p = list(rows)
        for n in grads_ref:
            g = _planted(local_cp.get(n, torch.zeros_like(grads_ref[n])), n, rank, plants, "bf16")
            g32 = _planted(local32_cp.get(n, torch.zeros_like(grads32[n])), n, rank, plants, "fp32")
            dist.all_reduce(g)
            dist.all_reduce(g32)
            rows_p.append(_grad_row(n, g, grads_ref[n], g32, grads32[n], kappa.get(n, 0.0), group_sq[n]))
            rows_p.append(_row(f"grad fp32 {n}", g32, grads32[n], FP32_GRAD_TOL))
        row_sets.append(rows_p)
    meta = {"ranks": world, "backend": "nccl" if device.type == "cuda" else "gloo", "device": device.type,
            "layout": layout, "config": config, "tokens": T, "cu_seqlens": cu_list,
            "model": "tiny", "indexer": "the model's first DSA layer's",
            "gradients": "selections pinned to one rank's BF16 indexer ids; BF16 bound 3·√2·noise + fp32_gap, "
                         f"FP32 bound {FP32_GRAD_TOL:g}",
            "plants": [[f"{n}:{r}:{f:g}:{w}" for n, r, f, w in plants] for plants in plant_sets]}
    return row_sets, meta


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
    lines += ["", f"{len(result['rows']) - bad} of {len(result['rows'])} within tolerance", "",
              "Tolerances (docs/DESIGN.md §8): gradients with every DSA layer's indexer ids pinned to one rank's "
              f"BF16 selections; grad NAME (BF16) <= {SIGMAS:g}·√2·noise + fp32_gap, noise = one rank's BF16 "
              "rounding of that gradient (the larger of its distance to the FP32 model and the W token groups' "
              "estimate), fp32_gap = CP against one rank in FP32; grad fp32 NAME <= "
              f"{FP32_GRAD_TOL:g}; model indexer ids: rows differing <= rows where one rank's BF16 and FP32 "
              "selections differ (near ties)."]
    for r in result["rows"]:
        if "rows_one_rank_vs_fp32" in r:
            lines.append(f"{r['name']}: CP against one rank {r['rows']}; one rank BF16 against FP32 "
                         f"{r['rows_one_rank_vs_fp32']}")
    plants = [p for ps in m.get("plants", []) for p in ps]
    if plants:
        lines.append(f"PLANTED (self-test, the check must fail): {', '.join(plants)}")
    return "\n".join(lines)


def check_args(args: argparse.Namespace) -> tuple[int, int, tuple]:
    """Every ``cp-check`` argument, before any process starts: ``(ranks, tokens, plants)``, or
    ``ValueError`` naming the option (``--plant`` entries may be strings or parsed tuples)."""
    from graphs import GLM53Config, GLM53Model
    from inductor_ext import validation as v

    W = v.integer(1)("cp-check: --ranks", args.ranks)
    T = v.integer(1)("cp-check: --tokens", 32 * W if args.tokens is None else args.tokens)
    if T % (8 * W):
        raise ValueError(f"cp-check: --tokens must be a multiple of 8·ranks = {8 * W}, got {T}")
    if args.layout not in ("contiguous", "zigzag") or args.config not in CONFIGS:
        raise ValueError(f"cp-check: --layout must be contiguous or zigzag and --config one of {CONFIGS}, "
                         f"got {args.layout!r}, {args.config!r}")
    plants = tuple(parse_plant(p) if isinstance(p, str) else p for p in args.plant)
    if plants:
        with torch.device("meta"):  # the parameter names only
            names = {n for n, _ in GLM53Model(GLM53Config.tiny()).named_parameters()}
        for name, rank, _, _ in plants:
            if name not in names:
                raise ValueError(f"cp-check: --plant names no parameter of the tiny model: {name!r} "
                                 f"(e.g. layers.1.attn_hc.scale)")
            if rank >= W:
                raise ValueError(f"cp-check: --plant rank {rank} must be below --ranks {W}")
    if args.json is not None:
        check_output_path(args.json, "--json", kind="file")
    return W, T, plants


def run(args: argparse.Namespace) -> int:
    """Run the check for parsed ``cp-check`` arguments; print the table (and write ``--json``)."""
    import torch.multiprocessing as mp

    W, T, plants = check_args(args)
    backend = "nccl" if torch.cuda.is_available() and torch.cuda.device_count() >= W else "gloo"
    with tempfile.TemporaryDirectory() as outdir:
        mp.start_processes(_worker, args=(W, _free_port(), backend, args.layout, args.config, T, outdir, plants),
                           nprocs=W, join=True, start_method="spawn")
        result = torch.load(os.path.join(outdir, "result.pt"), weights_only=False)
    print(format_table(result))
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {args.json}")
    return 0 if all(r["ok"] for r in result["rows"]) else 1
