"""Sparse attention benchmark: ``glm53::sparse_mla`` (absorbed MLA, DSA token ids) beside dense causal SDPA.

For each token count T: one document of T tokens, ``heads`` query heads of the absorbed width
``dim`` (values: all ``dim`` columns), a latent ``kv [T, dim]``, and per query ``t`` a causal random
selection of ``min(topk_ids, t + 1)`` distinct keys of ``[0, t]`` in random order, padded with -1
(:func:`causal_random_ids`). Rows (CUDA-graph replay, p50 / max of single replays):

- ``sparse_mla fwd`` and ``sparse_mla fwd+bwd`` (``glm53::sparse_mla`` then ``glm53::sparse_mla_bwd``);
- ``sparse_mla bwd``: the backward alone, deterministic (the default) and with ``deterministic=False``
  (column ``deterministic``), so the price of bitwise-repeatable gradients is read off one table;
- ``sdpa_causal fwd`` and ``fwd+bwd``: dense causal ``scaled_dot_product_attention`` with
  ``dense_heads × dense_dim`` (64 × 256 by default), up to ``dense_max_tokens``.

Rates count the visible work only: sparse forward ``2·H·n·(D + d_v)``, backward ``2·H·n·(3D + 2d_v)``
FLOP for ``n`` non-padding ids; dense causal forward ``2·2·H·d·T(T+1)/2``, backward 2.5 times that.
``peak_mib`` is the allocator's peak above what was allocated before one eager call.
"""

from __future__ import annotations

import torch

import inductor_ext.ops.sparse_mla  # noqa: F401  (defines glm53::sparse_mla)
from inductor_ext.bench import timing
from inductor_ext.bench.progress import Progress

__all__ = ["bench_attn", "causal_random_ids", "sparse_flop"]


def causal_random_ids(T: int, W: int, *, device="cuda", generator=None, chunk: int = 256) -> torch.Tensor:
    """int32 ``[T, W]``: row t holds ``min(W, t+1)`` distinct random keys of ``[0, t]`` (random order),
    then -1. Built ``chunk`` rows at a time (top-W of uniform scores over the visible keys), so memory
    stays ``chunk × max(T, W)``."""
    ids = torch.empty(T, W, dtype=torch.int32, device=device)
    rank = torch.arange(W, device=device)[None, :]
    for t0 in range(0, T, chunk):
        t1 = min(T, t0 + chunk)
        width = max(t1, W)
        scores = torch.rand(t1 - t0, width, device=device, generator=generator)
        t = torch.arange(t0, t1, device=device)[:, None]
        scores.masked_fill_(torch.arange(width, device=device)[None, :] > t, -1.0)
        picked = torch.topk(scores, W, dim=1).indices.to(torch.int32)
        ids[t0:t1] = torch.where(rank <= t, picked, -1)
    return ids


def sparse_flop(n_visible: int, heads: int, dim: int, d_v: int) -> tuple[int, int]:
    """(forward, backward) FLOP of sparse MLA over ``n_visible`` (query, key) pairs."""
    return 2 * heads * n_visible * (dim + d_v), 2 * heads * n_visible * (3 * dim + 2 * d_v)


def _peak_mib(fn) -> float:
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**20


def _row(name, pas, T, stats, peak, flop, **extra) -> dict:
    p50 = stats["p50_us"]
    return {"name": name, "pass": pas, "tokens": T, **extra, "p50_us": p50, "max_us": stats["max_us"],
            "samples": stats["samples"], "peak_mib": peak, "tflop": flop / 1e12,
            "tflops": flop / (p50 * 1e-6) / 1e12}


def _sparse_rows(T, heads, dim, d_v, topk_ids, samples, gen):
    sparse_fwd, sparse_bwd = torch.ops.glm53.sparse_mla, torch.ops.glm53.sparse_mla_bwd
    q = torch.randn(T, heads, dim, device="cuda", generator=gen).to(torch.bfloat16)
    kv = torch.randn(T, dim, device="cuda", generator=gen).to(torch.bfloat16)
    ids = causal_random_ids(T, topk_ids, generator=gen)
    n_vis = int((ids >= 0).sum())
    fl_f, fl_b = sparse_flop(n_vis, heads, dim, d_v)
    meta = {"heads": heads, "dim": dim, "d_v": d_v, "topk_ids": topk_ids, "visible_pairs": n_vis,
            "deterministic": True}
    scale = dim ** -0.5
    o, lse = sparse_fwd(q, kv, ids, scale, d_v, True)
    dout = torch.randn(o.shape, device="cuda", generator=gen).to(o.dtype)
    dlse = torch.zeros_like(lse)

    def fwd():
        return sparse_fwd(q, kv, ids, scale, d_v, True)

    def fwd_bwd():
        o_, l_ = sparse_fwd(q, kv, ids, scale, d_v, True)
        return sparse_bwd(q, kv, ids, o_, l_, dout, dlse, scale, d_v, True)

    rows = [_row("sparse_mla", "fwd", T, timing.replay_stats(fwd, samples), _peak_mib(fwd), fl_f, **meta),
            _row("sparse_mla", "fwd+bwd", T, timing.replay_stats(fwd_bwd, samples), _peak_mib(fwd_bwd),
                 fl_f + fl_b, **meta)]
    for deterministic in (True, False):
        def bwd(deterministic=deterministic):
            return sparse_bwd(q, kv, ids, o, lse, dout, dlse, scale, d_v, deterministic)

        rows.append(_row("sparse_mla", "bwd", T, timing.replay_stats(bwd, samples), _peak_mib(bwd), fl_b,
                         **{**meta, "deterministic": deterministic}))
    return rows


def _dense_rows(T, heads, dim, samples, gen):
    qd, kd, vd = (torch.randn(1, heads, T, dim, device="cuda", generator=gen).to(torch.bfloat16).requires_grad_()
                  for _ in range(3))
    gd = torch.randn(qd.shape, device="cuda", generator=gen).to(torch.bfloat16)
    sdpa = torch.nn.functional.scaled_dot_product_attention
    flop = 2 * 2 * heads * dim * T * (T + 1) // 2
    meta = {"heads": heads, "dim": dim, "d_v": dim, "topk_ids": None, "visible_pairs": T * (T + 1) // 2,
            "deterministic": None}

    def fwd():
        with torch.no_grad():
            return sdpa(qd, kd, vd, is_causal=True)

    def fwd_bwd():
        return torch.autograd.grad(sdpa(qd, kd, vd, is_causal=True), (qd, kd, vd), gd)

    return [_row("sdpa_causal", "fwd", T, timing.replay_stats(fwd, samples), _peak_mib(fwd), flop, **meta),
            _row("sdpa_causal", "fwd+bwd", T, timing.replay_stats(fwd_bwd, samples), _peak_mib(fwd_bwd),
                 3.5 * flop, **meta)]


def bench_attn(tokens=(8192, 32768, 65536), heads=64, dim=512, topk_ids=2051, *, d_v=None,
               dense_heads=64, dense_dim=256, dense_max_tokens=32768, samples=20, seed=0, progress=None) -> list[dict]:
    """Time sparse MLA (``glm53::sparse_mla`` forward, forward + backward) and dense causal SDPA;
    return the rows (module docstring). ``progress``: a message callable or None (a tqdm bar shows
    either way when tqdm is installed)."""
    if not torch.cuda.is_available():
        raise ValueError("bench attn needs a CUDA device")
    d_v = dim if d_v is None else int(d_v)
    tokens = [int(t) for t in ((tokens,) if isinstance(tokens, int) else tokens)]
    total = sum(6 if T <= dense_max_tokens else 4 for T in tokens)
    dev = torch.cuda.get_device_name()
    rows = []
    gen = torch.Generator(device="cuda").manual_seed(seed)
    with Progress(progress, total=total, desc="bench attn") as prog:
        for T in tokens:
            batch = list(_sparse_rows(T, heads, dim, d_v, topk_ids, samples, gen))
            torch.cuda.empty_cache()
            if T <= dense_max_tokens:
                batch += _dense_rows(T, dense_heads, dense_dim, samples, gen)
                torch.cuda.empty_cache()
            for row in batch:
                row["device"] = dev
                rows.append(row)
                flag = " nondeterministic" if row["deterministic"] is False else ""
                prog(f"{row['name']} {row['pass']}{flag} T={row['tokens']}: {row['p50_us'] / 1e3:.2f} ms")
    return rows
