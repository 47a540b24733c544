"""``inductor_ext.parallel.cp_context`` on 2 and 4 gloo processes: the metadata against a per-token
derivation written here, ``shard``/``unshard`` (round trip and the all-gather's backward), the
short convolution's halo exchange (bitwise, zero at document starts, its gradient) and bad input
(``ValueError`` on every rank, none left waiting in a collective)."""

from __future__ import annotations

import pytest
import torch

from tests.support.parallel import bitwise, job_result, register

# (layout, cu_seqlens) per world size; T divisible by 2·W·4
CASES = {
    2: [("contiguous", (0, 5, 40, 41, 64)), ("zigzag", (0, 5, 40, 41, 64)), ("zigzag", (0, 0, 16, 16, 64))],
    4: [("contiguous", (0, 70, 128)), ("zigzag", (0, 3, 9, 100, 128))],
}


def _expected(cu: list[int], world: int, rank: int, layout: str) -> dict:
    """Per-token derivation of the local metadata (independent of the context's interval code)."""
    T = cu[-1]
    S = world if layout == "contiguous" else 2 * world
    L = T // S
    shards = [rank] if layout == "contiguous" else [rank, 2 * world - 1 - rank]
    doc = [next(d for d in range(len(cu) - 1) if cu[d] <= t < cu[d + 1]) for t in range(T)]
    pos = [t for j in shards for t in range(j * L, (j + 1) * L)]
    starts, cont = [], []
    for i, t in enumerate(pos):
        if i % L == 0 or doc[t] != doc[pos[i - 1]]:  # a shard start or a document start
            starts.append(i)
            cont.append(t > cu[doc[t]])
    return {"positions": pos, "doc_ids": [doc[t] for t in pos], "doc_positions": [t - cu[doc[t]] for t in pos],
            "seg_starts": starts, "seg_continues": cont, "shards": tuple(shards), "L": L}


def context_worker(rank: int, world: int) -> dict:
    from graphs import GLM53Config
    from graphs.kda_layer import LinearAttention
    from inductor_ext.ops.packing import document_positions
    from inductor_ext.parallel import cp_context, halo_exchange

    out = {}
    conv = LinearAttention(GLM53Config.tiny())
    for n, (layout, cu_list) in enumerate(CASES[world]):
        cu = torch.tensor(cu_list)
        T = cu_list[-1]
        ctx = cp_context(cu, layout=layout)
        exp = _expected(list(cu_list), world, rank, layout)
        M = ctx.num_segments
        segs = len(exp["seg_starts"])
        local_cu = exp["seg_starts"] + [ctx.local_tokens] * (M - segs + 1)
        res = {
            "positions": ctx.positions.tolist() == exp["positions"],
            "doc_ids": ctx.doc_ids.tolist() == exp["doc_ids"],
            "doc_positions": ctx.doc_positions.tolist() == exp["doc_positions"],
            "local_cu": ctx.local_cu_seqlens.tolist() == local_cu,
            "continues": ctx.seg_continues.tolist()[:segs] == exp["seg_continues"] and not any(
                ctx.seg_continues.tolist()[segs:]),
            "shards": ctx.shards == exp["shards"] and ctx.shard_len == exp["L"],
        }
        gen = torch.Generator().manual_seed(n)
        x = torch.randn(T, 3, 5, generator=gen)
        local = ctx.shard(x).clone().requires_grad_(True)
        full = ctx.unshard(local)
        xt = x.transpose(0, 1)
        res["roundtrip"] = bitwise(full, x) and bitwise(ctx.unshard(ctx.shard(xt, 1), 1), xt)
        w = torch.randn(T, 3, 5, generator=gen)
        (grad,) = torch.autograd.grad((full * w).sum(), local)  # every rank's loss reads the whole tensor
        res["unshard_grad"] = bitwise(grad, world * ctx.shard(w))
        # halo: the 3 rows before each local shard, zero before the document of its first token
        C = 3 * conv.num_heads * conv.head_dim
        raw = torch.randn(T, C, generator=gen)
        raw_local = ctx.shard(raw).clone().requires_grad_(True)
        halo = halo_exchange(raw_local, ctx, 3)
        want = torch.zeros_like(halo)
        for i, j in enumerate(ctx.shards):
            s = j * ctx.shard_len
            d0 = cu_list[exp["doc_ids"][i * ctx.shard_len]]
            for r in range(3):
                if s - 3 + r >= d0:
                    want[i, r] = raw[s - 3 + r]
        res["halo"] = bitwise(halo, want)
        # the halo's gradient lands on the rows it copied, on the rank that owns them
        wh = torch.randn(ctx.num_shards, 3, C, generator=gen)  # one weight per (global shard, row)
        (g_local,) = torch.autograd.grad((halo * wh.index_select(0, ctx.shard_global)).sum(), raw_local)
        g_want = torch.zeros(T, C)
        for j in range(ctx.num_shards):
            s = j * ctx.shard_len
            d0 = cu_list[max(d for d in range(len(cu_list) - 1) if cu_list[d] <= s)]
            for r in range(3):
                if s - 3 + r >= d0:
                    g_want[s - 3 + r] += wh[j, r]
        res["halo_grad"] = bitwise(ctx.unshard(g_local), g_want)
        # the conv with the halo equals the single-rank conv, bitwise
        with torch.no_grad():
            whole = conv.short_conv(raw, document_positions(cu, T, raw.device))
            mine = conv.short_conv(ctx.shard(raw), ctx.doc_positions, halo_exchange(ctx.shard(raw), ctx, 3))
        res["conv"] = bitwise(mine, ctx.shard(whole))
        out[n] = res
    return out


def _message(fn):
    try:
        fn()
    except ValueError as e:
        return str(e)
    return None


def errors_worker(rank: int, world: int) -> dict:
    from inductor_ext.parallel import cp_context

    L4 = 8 * world  # a T every layout divides
    return {
        "indivisible_contiguous": _message(lambda: cp_context(torch.tensor([0, 3, 4 * world + 2]))),
        "indivisible_zigzag": _message(lambda: cp_context(torch.tensor([0, 4 * world]), layout="zigzag")),
        "differ": _message(lambda: cp_context(torch.tensor([0, 5 + rank, L4]))),
        "one_rank_bad": _message(lambda: cp_context(torch.tensor([0, L4 + (2 if rank == world - 1 else 0)]))),
        "layout": _message(lambda: cp_context(torch.tensor([0, L4]), layout="ring")),
        "dtype": _message(lambda: cp_context(torch.tensor([0.0, L4]))),
        "unsorted": _message(lambda: cp_context(torch.tensor([0, L4, L4 - 4, L4]))),
        "after_errors_ok": cp_context(torch.tensor([0, 3, L4]), layout="zigzag").num_segments,  # nobody hung
    }


for _w in (2, 4):
    register(_w, "context", context_worker)
    register(_w, "context-errors", errors_worker)

CHECKS = ("positions", "doc_ids", "doc_positions", "local_cu", "continues", "shards", "roundtrip", "unshard_grad",
          "halo", "halo_grad", "conv")


@pytest.mark.parametrize("world", [2, 4])
def test_metadata_shard_unshard_and_halo(world):
    for rank, per_case in enumerate(job_result(world, "context")):
        for n, res in per_case.items():
            bad = [c for c in CHECKS if not res[c]]
            assert not bad, f"world {world}, rank {rank}, case {CASES[world][n]}: {bad}"


@pytest.mark.parametrize("world", [2, 4])
def test_bad_input_raises_on_every_rank(world):
    expect = {
        "indivisible_contiguous": "divisible by",
        "indivisible_zigzag": "divisible by",
        "differ": "equal on every rank",
        "one_rank_bad": "divisible by",
        "layout": "layout must be one of",
        "dtype": "int64",
        "unsorted": "non-decreasing",
    }
    for rank, res in enumerate(job_result(world, "context-errors")):
        for key, words in expect.items():
            assert res[key] is not None and words in res[key], (world, rank, key, res[key])
        assert res["after_errors_ok"] >= 1
    # the rank whose T is indivisible names itself; the others name it
    assert "(on rank" in job_result(world, "context-errors")[0]["one_rank_bad"]


def test_uninitialized_process_group_raises():
    import torch.distributed as dist

    from inductor_ext.parallel import cp_context

    assert not dist.is_initialized()
    with pytest.raises(ValueError, match="not initialized"):
        cp_context(torch.tensor([0, 8]))
