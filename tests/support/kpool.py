"""KPool indexer test helpers: a random transformers indexer, packed inputs, the selection
invariants every indexer output keeps, FP64 pool scores and DeepGEMM's normalized difference."""

import torch
from transformers.models.glm5_next.configuration_glm5_next import Glm5NextTextConfig
from transformers.models.glm5_next.modeling_glm5_next import Glm5NextTextIndexer

from inductor_ext import ops

__all__ = ["HIDDEN", "QR", "HEADS", "D", "P", "NEAR_TIE", "calc_diff", "kp_indexer", "kp_params", "kp_inputs",
           "kp_run", "kp_check_selection", "kp_scores_fp64"]

HIDDEN, QR, HEADS, D, P = 64, 32, 32, 128, 4
NEAR_TIE = 1e-5  # relative gap between the K-th and (K+1)-th best FP64 pool score


def kp_indexer(topk: int, seed: int = 0) -> Glm5NextTextIndexer:
    """A bf16 transformers indexer with random weights (zeros/ones by default would tie scores)."""
    cfg = Glm5NextTextConfig(hidden_size=HIDDEN, q_lora_rank=QR, index_n_heads=HEADS, index_head_dim=D,
                             index_topk=topk, index_kpool=P, qk_rope_head_dim=0, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=4)
    m = Glm5NextTextIndexer(cfg, 0)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in m.named_parameters():
            std = 1.0 if ("ape" in name or "k_norm" in name) else 0.15
            p.copy_(torch.randn(p.shape, generator=g) * std)
    return m.to(torch.bfloat16).eval()


def kp_params(m: Glm5NextTextIndexer):
    return (m.wq_b.weight, m.wk.weight, m.k_norm.weight, m.k_norm.bias, m.weights_proj.weight,
            m.index_kpool_compress_gate, m.index_kpool_compress_ape)


def kp_inputs(lengths, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    T = sum(lengths)
    x = torch.randn(T, HIDDEN, generator=g).bfloat16()
    qr = torch.randn(T, QR, generator=g).bfloat16()
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int64)
    return x, qr, cu


def kp_run(m, x, qr, cu, **kw):
    return ops.kpool_indexer(x, qr, *kp_params(m), cu, topk=m.index_topk, pool_size=P, **kw)


def kp_check_selection(out, cu, topk, tail="compact"):
    """Every row: causal, same document, no duplicates, complete aligned pools, the tail is exactly
    the visible incomplete pool, -1 only as padding (compact: only at the end)."""
    cu = cu.tolist()
    T = cu[-1]
    K = min(topk // P, T // P)
    assert out.dtype == torch.int32 and out.shape == (T, topk + P - 1), f"out: {out.dtype} {tuple(out.shape)}"
    for d, (bos, eos) in enumerate(zip(cu[:-1], cu[1:])):
        for t in range(bos, eos):
            row = out[t].tolist()
            pos = t - bos
            nsel = min((pos + 1) // P, K)
            tail_start = bos + P * ((pos + 1) // P)
            where = f"doc {d} token {t} (pos {pos}): {row}"
            ids = [i for i in row if i >= 0]
            assert all(bos <= i <= t for i in ids), f"future/other-document token, {where}"
            assert len(set(ids)) == len(ids), f"duplicate token, {where}"
            pools = row[: nsel * P]
            for j in range(nsel):
                grp = pools[P * j: P * j + P]
                assert (grp[0] - bos) % P == 0 and grp == list(range(grp[0], grp[0] + P)), f"pool {j}, {where}"
                assert grp[-1] < tail_start, f"pool {j} not complete before the tail, {where}"
            tail_ids = list(range(tail_start, t + 1))
            at = nsel * P if tail == "compact" else topk
            assert row[at: at + len(tail_ids)] == tail_ids, f"tail {tail_ids} not at column {at}, {where}"
            rest = row[nsel * P: at] + row[at + len(tail_ids):]
            assert all(i == -1 for i in rest), f"-1 padding expected outside pools/tail, {where}"


def kp_scores_fp64(m, x, qr, cu):
    """FP64 pool scores ``[T, S]`` from the (transformers-identical) bf16 pools, q and w."""
    k, gate, w = ops.kpool_project(x, *kp_params(m)[1:6], head_proj="model")
    pool_token = ops.kpool_layout(cu, x.shape[0], P)[0]
    pool, _ = ops.kpool_compress(k, gate, m.index_kpool_compress_ape, pool_token, mode="bf16_reference")
    q = torch.nn.functional.linear(qr, m.wq_b.weight).view(-1, HEADS, D)
    s = torch.relu(torch.einsum("thd,pd->thp", q.double(), pool.double()) * D**-0.5)
    return torch.einsum("th,thp->tp", w.double(), s)


def calc_diff(x: torch.Tensor, y: torch.Tensor) -> float:
    """DeepGEMM's normalized difference: 1 - 2·Σxy / Σ(x² + y²)."""
    x, y = x.double(), y.double()
    return (1 - 2 * (x * y).sum() / (x * x + y * y).sum()).item()
