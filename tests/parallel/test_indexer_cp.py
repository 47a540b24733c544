"""The KPool indexer under context parallelism (``inductor_ext.parallel.kpool_indexer_cp``): keys and
gates all-gathered before pooling, local queries, global ids. On 2 and 4 gloo processes, every
local row equals the single-rank ``ops.kpool_indexer`` row of that token, bitwise, for the BF16
(reference and FP32 pooling) and FP8 paths, contiguous and zigzag, with documents (and pools of
documents starting off the 4-token grid) straddling shard boundaries; the CP indexer compiles
with ``fullgraph=True`` into one frame holding its all-gather."""

from __future__ import annotations

import pytest
import torch

from tests.support.parallel import job_result, register

# (kpool, kpool_pooling)
PATHS = (("bf16", "reference"), ("bf16", "fp32"), ("fp8", "reference"))
CASES = {2: [("contiguous", (0, 13, 50, 64)), ("zigzag", (0, 13, 50, 64))],
         4: [("zigzag", (0, 3, 70, 77, 128))]}
TOPK = 16


def _indexer_params():
    from graphs import GLM53Config
    from graphs.dsa_layer import Indexer

    m = Indexer(GLM53Config.tiny(index_topk=TOPK))
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in m.named_parameters():
            std = 1.0 if ("ape" in name or "k_norm" in name) else 0.15
            p.copy_(torch.randn(p.shape, generator=gen) * std)
    m = m.to(torch.bfloat16)
    return (m.wq_b.weight, m.wk.weight, m.k_norm.weight, m.k_norm.bias, m.weights_proj.weight,
            m.index_kpool_compress_gate, m.index_kpool_compress_ape.float())


def indexer_worker(rank: int, world: int, compile_too: bool) -> dict:
    from graphs import GLM53Config
    from inductor_ext import ops
    from inductor_ext.parallel import cp_context, kpool_indexer_cp

    cfg = GLM53Config.tiny()
    params = _indexer_params()
    out = {}
    for layout, cu_list in CASES[world]:
        T = cu_list[-1]
        gen = torch.Generator().manual_seed(T)
        x = torch.randn(T, cfg.hidden_size, generator=gen).bfloat16()
        qr = torch.randn(T, cfg.q_lora_rank, generator=gen).bfloat16()
        cu = torch.tensor(cu_list)
        ctx = cp_context(cu, layout=layout)
        for kpool, pooling in PATHS:
            kw = dict(topk=TOPK, pool_size=4, kpool=kpool, kpool_pooling=pooling)
            want = ops.kpool_indexer(x, qr, *params, cu, **kw).index_select(0, ctx.positions)
            got = kpool_indexer_cp(ctx.shard(x), ctx.shard(qr), *params, ctx, **kw)
            out[(layout, kpool, pooling)] = {"equal": torch.equal(got, want), "shape": tuple(got.shape)}
        if compile_too:
            from torch._dynamo.testing import CompileCounterWithBackend

            torch._dynamo.reset()
            counter = CompileCounterWithBackend("aot_eager")
            kw = dict(topk=TOPK, pool_size=4, kpool="fp8", kpool_pooling="reference")
            def run(a, b, c, kw=kw):
                return kpool_indexer_cp(a, b, *params, c, **kw)

            fn = torch.compile(run, backend=counter, fullgraph=True)
            got = fn(ctx.shard(x), ctx.shard(qr), ctx)
            want = kpool_indexer_cp(ctx.shard(x), ctx.shard(qr), *params, ctx, **kw)
            graph = "\n".join(str(g.graph) for g in counter.graphs)
            out[(layout, "compiled")] = {"equal": torch.equal(got, want), "frames": counter.frame_count,
                                         "all_gathers": graph.count("all_gather_into_tensor")}
    return out


register(2, "indexer", indexer_worker, True)
register(4, "indexer", indexer_worker, False)


@pytest.mark.parametrize("world", [2, 4])
def test_cp_indexer_rows_equal_single_rank(world):
    for rank, res in enumerate(job_result(world, "indexer")):
        for (layout, *path), r in res.items():
            if path == ["compiled"]:
                continue
            assert r["equal"], (world, rank, layout, path, r)
            assert r["shape"][1] == TOPK + 3


def test_cp_indexer_compiles_into_one_frame():
    for rank, res in enumerate(job_result(2, "indexer")):
        for layout in ("contiguous", "zigzag"):
            r = res[(layout, "compiled")]
            assert r["equal"] and r["frames"] == 1 and r["all_gathers"] == 1, (rank, layout, r)
