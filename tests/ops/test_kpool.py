"""KPool indexer (BF16 path) on CPU: parity with transformers ``Glm5NextTextIndexer``, selection
invariants, FP64 logits accuracy, workspace chunking, compile and opcheck.
"""

import pytest
import torch

import inductor_ext
from inductor_ext import ops, workspace
from inductor_ext.ops import kpool_reference as ref
from tests.support.kpool import (
    HEADS,
    NEAR_TIE,
    D,
    P,
    kp_check_selection,
    kp_indexer,
    kp_inputs,
    kp_params,
    kp_run,
    kp_scores_fp64,
)

# ---------------------------------------------------------------------------------------------
# transformers parity
# ---------------------------------------------------------------------------------------------


def _transformers_packed(m, x, qr, cu):
    """Run the transformers indexer document by document; global ids (-1 stays -1)."""
    rows = []
    for bos, eos in zip(cu[:-1].tolist(), cu[1:].tolist()):
        L = eos - bos
        if L == 0:
            continue
        out = m(x[None, bos:eos], qr[None, bos:eos], torch.ones(1, L, dtype=torch.bool), None)[0]
        rows.append(torch.where(out >= 0, out + bos, out))
    return torch.cat(rows)


def _near_ties(scores, cu, K):
    """Rows whose K-th and (K+1)-th best visible pools are within NEAR_TIE (relative)."""
    _, q_lo, q_n, _, _ = ref.layout_reference(cu, scores.shape[0], P)
    ties = set()
    for t in range(scores.shape[0]):
        n = int(q_n[t])
        if n <= K:
            continue
        s = scores[t, int(q_lo[t]): int(q_lo[t]) + n].sort(descending=True).values
        if (s[K - 1] - s[K]).abs() <= NEAR_TIE * s.abs().max().clamp_min(1e-30):
            ties.add(t)
    return ties


PARITY_CASES = {
    "one-doc-T150": ([150], 32),
    "one-doc-T640-topk64": ([640], 64),
    "shorter-than-pool": ([3], 16),
    "packed-7docs": ([5, 64, 2, 1, 97, 0, 40], 16),
    "topk-exceeds-pools": ([33, 18], 2048),
}


@pytest.mark.parametrize("tail", ["compact", "fixed"])
@pytest.mark.parametrize("case", list(PARITY_CASES), ids=list(PARITY_CASES))
def test_matches_transformers_reference(case, tail, record_property):
    lengths, topk = PARITY_CASES[case]
    m = kp_indexer(topk)
    x, qr, cu = kp_inputs(lengths)
    with inductor_ext.precision(inductor_ext.PrecisionConfig.reference()):
        ours = kp_run(m, x, qr, cu, tail=tail)
    theirs = _transformers_packed(m, x, qr, cu)
    assert ours.shape == theirs.shape, f"{tuple(ours.shape)} vs transformers {tuple(theirs.shape)}"
    differ = {t for t in range(ours.shape[0]) if sorted(ours[t].tolist()) != sorted(theirs[t].tolist())}
    ties = _near_ties(kp_scores_fp64(m, x, qr, cu), cu, topk // P)
    record_property("near_ties", len(ties))
    record_property("differing_rows", len(differ))
    assert differ <= ties, f"rows {sorted(differ - ties)} differ from transformers without a near tie"
    kp_check_selection(ours, cu, topk, tail)


def test_pools_bitwise_equal_transformers():
    m = kp_indexer(32)
    x, qr, cu = kp_inputs([61])
    k, gate, _ = ops.kpool_project(x, *kp_params(m)[1:6], head_proj="model")
    pool_token = ops.kpool_layout(cu, 61, P)[0]
    pool, scale = ops.kpool_compress(k, gate, m.index_kpool_compress_ape, pool_token, mode="bf16_reference")
    with torch.no_grad():
        k_hf = m.k_norm(m.wk(x[None]))
        gate_hf = torch.nn.functional.linear(x[None], m.index_kpool_compress_gate)
        packed = torch.cat([k_hf, gate_hf, torch.ones(1, 61, 1, dtype=k_hf.dtype)], dim=-1)
        pool_hf, _, _ = m.get_pooled_states(packed)
    assert torch.equal(k, k_hf[0]), "k differs from transformers k_norm(wk(x))"
    assert torch.equal(pool, pool_hf[0]), "bf16_reference pool differs from transformers get_pooled_states"
    assert torch.equal(scale, torch.ones(15)), "bf16 pool scale must be 1"


# ---------------------------------------------------------------------------------------------
# numerics of the BF16 path
# ---------------------------------------------------------------------------------------------


def test_bf16_logits_vs_fp64(record_property):
    g = torch.Generator().manual_seed(3)
    q = torch.randn(40, HEADS, D, generator=g).bfloat16()
    w = torch.randn(40, HEADS, generator=g)
    pool = torch.randn(23, D, generator=g).bfloat16()
    logits = ops.kpool_logits(q, w, pool, torch.ones(23), precision="bf16")
    exp = torch.einsum("th,thp->tp", w.double(), torch.relu(torch.einsum("thd,pd->thp", q.double(),
                                                                         pool.double()) * D**-0.5))
    err = ((logits.double() - exp).norm() / exp.norm()).item()
    record_property("bf16_logits_rel_l2", err)
    assert err <= 1e-6, f"logits: relative L2 {err:.3e} vs FP64 > 1e-6"


def test_fp32_pooling_vs_fp64(record_property):
    # "bf16_fp32" rounds once: it must sit within half a bf16 ulp of the FP64 pool
    g = torch.Generator().manual_seed(4)
    k = torch.randn(64, D, generator=g).bfloat16()
    gate = (torch.randn(64, D, generator=g) * 3).bfloat16()
    ape = torch.randn(P, D, generator=g)
    pool_token = torch.arange(0, 64, P)
    pool32, _ = ops.kpool_compress(k, gate, ape, pool_token, mode="bf16_fp32")
    pool16, _ = ops.kpool_compress(k, gate, ape, pool_token, mode="bf16_reference")
    probs = (gate.double().view(16, P, D) + ape.double()).softmax(dim=1)
    exact = (probs * k.double().view(16, P, D)).sum(1)
    best = exact.to(torch.bfloat16).double()
    e32 = ((pool32.double() - exact).norm() / exact.norm()).item()
    e16 = ((pool16.double() - exact).norm() / exact.norm()).item()
    eb = ((best - exact).norm() / exact.norm()).item()
    record_property("pool_rel_l2", {"fp32_pooling": e32, "reference": e16, "bf16_rounding": eb})
    assert e32 <= 1.05 * eb, f"pool (bf16_fp32): relative L2 {e32:.3e} vs bf16 rounding {eb:.3e}"
    assert e16 > e32, f"pool (bf16_reference) {e16:.3e} should be further from FP64 than fp32 pooling {e32:.3e}"


def test_head_proj_fp32():
    m = kp_indexer(32)
    x, _, _ = kp_inputs([50])
    args = kp_params(m)[1:6]
    k32, gate32, w32 = ops.kpool_project(x, *args, head_proj="fp32")
    kmod, gatem, wmod = ops.kpool_project(x, *args, head_proj="model")
    assert torch.equal(gate32, gatem), "gate must not depend on head_proj"
    kp = torch.nn.functional.linear(x, m.wk.weight).double()
    k64 = torch.nn.functional.layer_norm(kp, (D,), m.k_norm.weight.double(), m.k_norm.bias.double(), 1e-6)
    # the best a bf16 key can be is FP64 LayerNorm rounded once (CPU's bf16 LayerNorm also
    # accumulates in FP32, so "model" matches here; GPU kernels are where the modes differ)
    same = (k32 == k64.to(torch.bfloat16)).float().mean().item()
    assert k32.dtype == torch.bfloat16 and same >= 0.999, f"k (fp32 LayerNorm): only {same:.4f} equal bf16(FP64)"
    w64 = x.double() @ m.weights_proj.weight.double().t() * HEADS**-0.5
    err = ((w32.double() - w64).norm() / w64.norm()).item()
    err_model = ((wmod.double() - w64).norm() / w64.norm()).item()
    assert w32.dtype == torch.float32 and err <= 1e-6, f"w (fp32 head_proj): relative L2 {err:.3e}"
    assert err_model > 100 * err, f"w (model head_proj) {err_model:.3e} should carry bf16 rounding"
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert torch.equal(ops.kpool_project(x, *args, head_proj="fp32")[2], w32), "autocast changed w"


# ---------------------------------------------------------------------------------------------
# selection
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kpool", ["bf16", "fp8"])
def test_selection_invariants_and_tail_layouts(kpool):
    lengths, topk = [9, 1, 0, 130, 6, 47], 24
    m = kp_indexer(topk, seed=5)
    x, qr, cu = kp_inputs(lengths, seed=6)
    compact = kp_run(m, x, qr, cu, kpool=kpool, tail="compact")
    fixed = kp_run(m, x, qr, cu, kpool=kpool, tail="fixed")
    kp_check_selection(compact, cu, topk, "compact")
    kp_check_selection(fixed, cu, topk, "fixed")
    for t in range(compact.shape[0]):
        assert sorted(compact[t].tolist()) == sorted(fixed[t].tolist()), f"token {t}: compact/fixed sets differ"


def test_selected_pools_are_the_top_scoring():
    lengths, topk = [70, 90], 32
    T, K = sum(lengths), topk // P
    g = torch.Generator().manual_seed(7)
    logits = torch.randn(T, T // P, generator=g)
    cu = torch.tensor([0, 70, 160])
    pool_token, q_lo, q_n, ts, tl = ops.kpool_layout(cu, T, P)
    out = ops.kpool_select(logits, q_lo, q_n, ts, tl, topk=topk, pool_size=P)
    for t in range(T):
        lo, n = int(q_lo[t]), int(q_n[t])
        row = out[t, : min(n, K) * P].view(-1, P)[:, 0]
        slots = {lo + (int(i) - int(ts[t] - P * q_n[t])) // P for i in row}
        assert all(lo <= s < lo + n for s in slots), f"token {t}: slot outside its visible range"
        rest = [s for s in range(lo, lo + n) if s not in slots]
        if slots and rest:
            assert min(logits[t, sorted(slots)]) >= max(logits[t, rest]), f"token {t}: a better pool was skipped"
        assert torch.equal(pool_token[sorted(slots)], row.sort().values.long()), f"token {t}: pool_token"


def test_chunked_scoring_equals_one_chunk():
    # legacy 1 MiB with 512 pools and 32 heads → 340-row chunks: 7 chunks over 2048 tokens
    m = kp_indexer(64, seed=8)
    x, qr, cu = kp_inputs([2048], seed=9)
    assert workspace.LogitsPlan(2048, 512, HEADS, "legacy", 2**20).chunk_rows == 340
    small = kp_run(m, x, qr, cu, mqa_layout="legacy", logits_budget_mb=1)
    big = kp_run(m, x, qr, cu, mqa_layout="compact", logits_budget_mb=256)
    assert torch.equal(small, big), "chunked (1 MiB legacy) selection differs from one chunk"


# ---------------------------------------------------------------------------------------------
# bad input, compile, opcheck
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("change,match", [
    (dict(topk=30), "divisible by pool_size"),
    (dict(kpool="int8"), "kpool must be one of"),
    (dict(mqa_layout="paged"), "mqa_layout must be one of"),
    (dict(tail="middle"), "tail must be one of"),
    (dict(scale_fmt="e8m0"), "scale_fmt must be one of"),
    (dict(logits_budget_mb=0), "logits_budget_mb must be a positive int"),
    (dict(cu_seqlens=torch.tensor([0, 5, 3, 20])), "non-decreasing"),
    (dict(cu_seqlens=torch.tensor([0, 20], dtype=torch.int32)), "cu_seqlens must have dtype"),
    (dict(heads=16), "heads must be one of"),
])
def test_bad_input_raises(change, match):
    m = kp_indexer(16)
    x, qr, cu = kp_inputs([20])
    params = list(kp_params(m))
    if change.pop("heads", None):
        params[0], params[4] = params[0][: 16 * D], params[4][:16]
    cu = change.pop("cu_seqlens", cu)
    kw = dict(topk=16, pool_size=P) | change
    with pytest.raises(ValueError, match=match):
        ops.kpool_indexer(x, qr, *params, cu, **kw)


def test_compile_one_frame_per_precision():
    from torch._dynamo.testing import CompileCounterWithBackend

    m = kp_indexer(16, seed=10)
    x, qr, cu = kp_inputs([30, 41], seed=11)
    params = kp_params(m)
    torch._dynamo.reset()
    cnt = CompileCounterWithBackend("aot_eager")

    @torch.compile(backend=cnt, fullgraph=True)
    def indexer(x, qr, cu):
        return ops.kpool_indexer(x, qr, *params, cu, topk=16)

    configs = {"bf16": inductor_ext.PrecisionConfig.reference(),
               "fp8": inductor_ext.PrecisionConfig.serving_aligned()}
    for i, (name, cfg) in enumerate(configs.items(), start=1):
        with inductor_ext.precision(cfg):
            eager = ops.kpool_indexer(x, qr, *params, cu, topk=16)
            out = indexer(x, qr, cu)
            again = indexer(x, qr, cu)
        assert cnt.frame_count == i, f"{name}: {cnt.frame_count} frames, expected one per precision"
        assert torch.equal(out, eager) and torch.equal(again, eager), f"{name}: compiled differs from eager"
    torch._dynamo.reset()


def _op_args():
    m = kp_indexer(16, seed=12)
    x, qr, cu = kp_inputs([9, 14], seed=13)
    wq_b, wk, lw, lb, wp, cg, ape = (p.detach() for p in kp_params(m))
    k, gate, w = ops.kpool_project(x, wk, lw, lb, wp, cg)
    layout = ops.kpool_layout(cu, 23, P)
    q = torch.nn.functional.linear(qr, wq_b).view(23, HEADS, D)
    pool, scale = ops.kpool_compress(k, gate, ape, layout[0], mode="bf16_reference")
    pool8, scale8 = ops.kpool_compress(k, gate, ape, layout[0], mode="fp8_ue8m0")
    q8, w8 = ops.kpool_quant_query(q, w)
    logits = ops.kpool_logits(q, w, pool, scale, precision="bf16")
    return {
        "kpool_project": [(x, wk, lw, lb, wp, cg, 1e-6, hp) for hp in ("model", "fp32")],
        "kpool_compress": [(k, gate, ape, layout[0], mode) for mode in ref.COMPRESS_MODES],
        "kpool_quant_query": [(q, w, fmt) for fmt in ref.SCALE_FMTS],
        "kpool_logits": [(q, w, pool, scale, "bf16", "compact"), (q8, w8, pool8, scale8, "fp8", "legacy")],
        "kpool_select": [(logits, *layout[1:], 16, P, tail) for tail in ("compact", "fixed")],
    }


@pytest.mark.parametrize("op", ["kpool_project", "kpool_compress", "kpool_quant_query", "kpool_logits",
                                "kpool_select"])
def test_opcheck(op):
    # the indexer is frozen (no autograd formulas): parameters enter detached, as in the layer
    for args in _op_args()[op]:
        args = tuple(a.detach() if isinstance(a, torch.Tensor) else a for a in args)
        fp8_in = any(isinstance(a, torch.Tensor) and a.dtype == torch.float8_e4m3fn for a in args)
        # torch's SchemaCheckMode cannot compare float8 CPU inputs ("mul_cpu_reduced_float" not
        # implemented for Float8_e4m3fn), so an op taking fp8 tensors skips only test_schema
        utils = ("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic") if fp8_in else "ALL"
        torch.library.opcheck(getattr(torch.ops.glm53, op), args, test_utils=utils)


def test_logits_fake_reproduces_workspace_strides():
    from torch._subclasses.fake_tensor import FakeTensorMode

    args = _op_args()["kpool_logits"][1]
    real = torch.ops.glm53.kpool_logits(*args)
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        fake = torch.ops.glm53.kpool_logits(*(mode.from_tensor(a) if isinstance(a, torch.Tensor) else a
                                                for a in args))
    assert real.stride() == fake.stride() == (workspace.mqa_logits_stride(5, "legacy"), 1), \
        f"logits strides: real {real.stride()} fake {fake.stride()}"
    assert real.untyped_storage().nbytes() == workspace.mqa_logits_bytes(23, 5, HEADS, "legacy")


def test_select_reference_never_picks_invisible_slots_even_at_minus_inf():
    """Visible pools whose scores are all -inf still beat the invisible slots (a -inf mask would tie
    with them), and equal scores go to the lowest slot first."""
    from inductor_ext.ops.kpool_reference import select_reference

    P, S = 4, 8
    logits = torch.full((2, S), float("-inf"))
    logits[1] = 0.0
    q_lo, q_n = torch.tensor([2, 2]), torch.tensor([3, 5])
    tail_start = 100 + P * q_n  # document start 100
    out = select_reference(logits, q_lo, q_n, tail_start, torch.zeros(2, dtype=torch.int64), 4 * P, P, "compact")
    first = out[:, ::P][:, :4]
    assert first[0].tolist() == [100, 104, 108, -1]  # the 3 visible pools, then padding
    assert first[1].tolist() == [100, 104, 108, 112]  # 4 of 5 visible pools, lowest slots first
