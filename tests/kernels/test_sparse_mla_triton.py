"""Triton kernels of ``glm53::sparse_mla`` (``inductor_ext.kernels.sparse_mla``) against the
independent FP64 reference (``tests.support.sparse_mla``) and the CPU reference kernels.

Without CUDA the kernels run on CPU tensors under Triton's interpreter, at small awkward sizes:
``TRITON_INTERPRET=1 pytest tests/kernels/test_sparse_mla_triton.py`` (its own process; otherwise
those tests skip and say so). With CUDA the ``cuda``-marked tests run the compiled kernels through
the ops, at the production geometry too, and inside a CUDA graph.

Contracts checked: out within 2x the BF16 rounding floor of the FP64 result (the CUDA forward
rounds p to BF16 for the value MMA: ~1.1x measured); lse within 1e-5; dq, dkv
within 1e-2 of the FP64 VJP; dkv bitwise equal run to run and across block sizes (int32 fixed-point
atomics with a scale per latent row), also for gradients scaled by 1e30 and 1e-30 (the scales follow
them) and for a row picked once among rows picked by every query (its own scale keeps it precise).
"""


import pytest
import torch

from inductor_ext.ops import sparse_mla_reference as ref
from tests.support.fp64 import assert_rel_l2, rel_l2
from tests.support.sparse_mla import Case, bf16_floor, fp64_vjp, graph_replay, head_major, make_inputs

triton = pytest.importorskip("triton")
tl = pytest.importorskip("triton.language")

GRAD_TOL = 1e-2
FLOOR_RATIO = 2.0
LSE_TOL = 1e-5

INTERP_CASES = [
    Case("H4-D64-W37-pad-anywhere", (13, 11), heads=4, dim=64, d_v=64, width=37, pad_anywhere=True,
         single_id_rows=(3,), empty_rows=(5,)),
    Case("H16-D128-dv80", (20,), heads=16, dim=128, d_v=80, width=24, id_dtype=torch.int32),
    Case("H1-D512", (6,), heads=1, dim=512, d_v=512, width=20),
    Case("H8-D384-dv300-three-chunks", (9,), heads=8, dim=384, d_v=300, width=21),
    Case("H70-D64-two-head-groups", (7,), heads=70, dim=64, d_v=48, width=9),
]
iids = [c.name for c in INTERP_CASES]


@pytest.fixture(scope="module")
def kt():
    """The kernel package in interpreter mode (CPU tensors)."""
    from tests.support.sparse_mla import apply_bf16_rounding_shim
    from tests.support.triton_interpreter import interpreter_kernels

    return interpreter_kernels("inductor_ext.kernels.sparse_mla", "tests/kernels/test_sparse_mla_triton.py",
                               apply_bf16_rounding_shim)


def _forward_checks(name, out, lse, out64, lse64, ratio=FLOOR_RATIO):
    floor = bf16_floor(out64)
    err = rel_l2(out, out64.to(torch.bfloat16).double())
    assert err <= ratio * floor, f"{name} out: relative L2 {err:.3e} > {ratio} x BF16 floor {floor:.3e}"
    finite = torch.isfinite(lse64)
    assert torch.equal(torch.isfinite(lse.cpu()), finite.cpu()), f"{name} lse: -inf rows differ"
    if finite.any():
        assert_rel_l2(f"{name} lse", lse[finite], lse64[finite], LSE_TOL)
    return err / floor


@pytest.mark.parametrize("case", INTERP_CASES, ids=iids)
def test_forward_matches_fp64(kt, case):
    inp = make_inputs(case)
    out64, lse64, _, _ = fp64_vjp(inp["q"], inp["kv"], inp["token_ids"], inp["scale"], inp["d_v"],
                                  inp["dout"], inp["dlse"])
    out, lse = kt.sparse_mla_fwd(inp["q"], inp["kv"], inp["token_ids"], inp["scale"], inp["d_v"], block_n=16)
    _forward_checks("fwd", out, lse, out64, lse64)
    empty = (inp["token_ids"] < 0).all(1)
    assert (out[empty] == 0).all()


def test_forward_variants(kt):
    case = INTERP_CASES[0]
    inp = make_inputs(case, seed=1)
    out64, lse64, _, _ = fp64_vjp(inp["q"], inp["kv"], inp["token_ids"], inp["scale"], inp["d_v"],
                                  inp["dout"], inp["dlse"])
    args = (inp["q"], inp["kv"], inp["token_ids"], inp["scale"], inp["d_v"])
    _forward_checks("chunk32", *kt.sparse_mla_fwd(*args, block_n=32, chunk=32), out64, lse64)
    _forward_checks("no-prefetch-int64", *kt.sparse_mla_fwd(*args, block_n=16, prefetch=False, idx32=False),
                    out64, lse64)


@pytest.mark.parametrize("case", INTERP_CASES, ids=iids)
def test_backward_matches_fp64_and_repeats(kt, case):
    inp = make_inputs(case, seed=2)
    args = (inp["q"], inp["kv"], inp["token_ids"])
    out, lse = kt.sparse_mla_fwd(*args, inp["scale"], inp["d_v"], block_n=16)
    _, _, dq64, dkv64 = fp64_vjp(*args, inp["scale"], inp["d_v"], inp["dout"], inp["dlse"])
    small = dict(dq_config=dict(block_n=16), dkv_config=dict(block_n=16))
    dq, dkv = kt.sparse_mla_bwd(*args, out, lse, inp["dout"], inp["dlse"], inp["scale"], inp["d_v"], **small)
    assert dq.dtype == inp["q"].dtype and dkv.dtype == inp["kv"].dtype
    assert_rel_l2("dq", dq, dq64, GRAD_TOL)
    assert_rel_l2("dkv", dkv, dkv64, GRAD_TOL)
    dq2, dkv2 = kt.sparse_mla_bwd(*args, out, lse, inp["dout"], inp["dlse"], inp["scale"], inp["d_v"], **small)
    assert torch.equal(dq, dq2) and torch.equal(dkv, dkv2), "backward not bitwise repeatable"
    dq3, dkv3 = kt.sparse_mla_bwd(*args, out, lse, inp["dout"], inp["dlse"], inp["scale"], inp["d_v"],
                                  dq_config=dict(block_n=32), dkv_config=dict(block_n=32))
    assert torch.equal(dkv, dkv3), "dkv depends on the block order of the backward"
    _, dkv4 = kt.sparse_mla_bwd(*args, out, lse, inp["dout"], inp["dlse"], inp["scale"], inp["d_v"],
                                deterministic=False, **small)
    assert_rel_l2("dkv (fp32 atomics)", dkv4, dkv64, GRAD_TOL)


@pytest.mark.parametrize("grad_scale", [1e30, 1e-30])
def test_fixed_point_scale_follows_the_gradients(kt, grad_scale):
    """dO scaled by 1e30 / 1e-30: the fixed-point accumulators neither overflow nor lose the gradient."""
    case = INTERP_CASES[1]
    inp = make_inputs(case, dtype=torch.float32, seed=3)
    args = (inp["q"], inp["kv"], inp["token_ids"])
    dout = inp["dout"] * grad_scale
    dlse = torch.zeros_like(inp["dlse"])
    out, lse = kt.sparse_mla_fwd(*args, inp["scale"], inp["d_v"], block_n=16)
    _, _, dq64, dkv64 = fp64_vjp(*args, inp["scale"], inp["d_v"], dout, dlse)
    dq, dkv = kt.sparse_mla_bwd(*args, out, lse, dout, dlse, inp["scale"], inp["d_v"],
                                dq_config=dict(block_n=16), dkv_config=dict(block_n=16))
    assert_rel_l2("dq", dq, dq64, 1e-5)
    assert_rel_l2("dkv", dkv, dkv64, 1e-5)


def test_rarely_picked_row_keeps_its_precision(kt):
    """Latent row 1 is listed by one query, row 0 by every query with gradients ~1e6 times larger.
    With one scale for the whole tensor, row 1 would be quantized at row 0's scale (relative L2 0.16
    planted); its own scale keeps it within 1e-5 of FP64."""
    T, H, D = 24, 4, 64
    gen = torch.Generator().manual_seed(7)
    q = torch.randn(T, H, D, generator=gen)
    kv = torch.randn(3, D, generator=gen)
    ids = torch.tensor([[0, 2, -1]] * T)
    ids[5, 2] = 1
    dout = torch.randn(T, H, D, generator=gen) * 1e3
    dout[5] *= 1e-6
    dlse = torch.zeros(T, H)
    out, lse = kt.sparse_mla_fwd(q, kv, ids, D ** -0.5, D, block_n=16)
    _, _, _, dkv64 = fp64_vjp(q, kv, ids, D ** -0.5, D, dout, dlse)
    _, dkv = kt.sparse_mla_bwd(q, kv, ids, out, lse, dout, dlse, D ** -0.5, D,
                               dq_config=dict(block_n=16), dkv_config=dict(block_n=16))
    assert_rel_l2("dkv row 0", dkv[0], dkv64[0], 1e-5)
    assert_rel_l2("dkv row 1 (picked once)", dkv[1], dkv64[1], 1e-5)


@triton.jit
def _add_packed(lo_ptr, hi_ptr, acc_ptr, N, pack: tl.constexpr, BLOCK: tl.constexpr):
    """acc[i % 2] += pack(lo[i], hi[i]): the dkv pass's word adds, on given fields."""
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = i < N
    lo = tl.load(lo_ptr + i, mask=m, other=0)
    hi = tl.load(hi_ptr + i, mask=m, other=0)
    tl.atomic_add(acc_ptr + (i % 2), pack(lo, hi), mask=m)


def test_packed_words_sum_each_field_exactly(kt):
    """Two int32 fields per int64 word, added as one integer: the decode gives each field's exact
    sum (the low field's carries and borrows, from either sign, are undone)."""
    gen = torch.Generator().manual_seed(0)
    n = 1000
    lo, hi = (torch.randint(-2**14, 2**14, (n,), generator=gen, dtype=torch.int32) for _ in range(2))
    acc = torch.zeros(2, 1, 1, dtype=torch.int64)  # [S = 2 rows, 1 word pair, DC = 1]
    _add_packed[(triton.cdiv(n, 256),)](lo, hi, acc, n, pack=kt.backward._pack, BLOCK=256)
    out = torch.empty(2, 2)
    kt.backward._fixed_to_float_kernel[(1,)](acc, out, torch.ones(2, 2), 4, D=2, DC=1, NP=1, BLOCK=4)
    want = torch.tensor([[lo[r::2].sum(), hi[r::2].sum()] for r in (0, 1)], dtype=torch.float32)
    assert torch.equal(out, want), f"decoded {out.tolist()} != field sums {want.tolist()}"


def test_softmax_delta_reads_any_layout(kt):
    """delta of head-major out / dout (read in place through their strides) is bitwise the
    contiguous inputs' and matches the FP64 sum; d_v = 24 is masked inside a 32-wide block."""
    gen = torch.Generator().manual_seed(3)
    out, dout = (torch.randn(5, 3, 24, generator=gen).bfloat16() for _ in range(2))
    dlse = torch.randn(5, 3, generator=gen)
    delta = kt.backward.softmax_delta(out, dout, dlse)
    assert torch.equal(kt.backward.softmax_delta(head_major(out), head_major(dout), dlse), delta)
    assert torch.equal(kt.backward.softmax_delta(out, head_major(dout), dlse), delta)
    want = (out.double() * dout.double()).sum(-1) - dlse.double()
    assert_rel_l2("delta", delta, want, 1e-6)


def test_head_major_query_and_gradient_give_the_same_bits(kt):
    """The Triton kernels read q and dout through their strides: head-major inputs give bitwise the
    contiguous inputs' out, lse, dq and dkv."""
    inp = make_inputs(INTERP_CASES[0], seed=4)
    q, kv, ids, dout = inp["q"], inp["kv"], inp["token_ids"], inp["dout"]
    fwd_args, small = (inp["scale"], inp["d_v"]), dict(dq_config=dict(block_n=16), dkv_config=dict(block_n=16))
    out, lse = kt.sparse_mla_fwd(q, kv, ids, *fwd_args, block_n=16)
    out_h, lse_h = kt.sparse_mla_fwd(head_major(q), kv, ids, *fwd_args, block_n=16)
    assert torch.equal(out, out_h) and torch.equal(lse, lse_h)
    grads = kt.sparse_mla_bwd(q, kv, ids, out, lse, dout, inp["dlse"], *fwd_args, **small)
    grads_h = kt.sparse_mla_bwd(head_major(q), kv, ids, out, lse, head_major(dout), inp["dlse"], *fwd_args, **small)
    assert all(torch.equal(a, b) for a, b in zip(grads, grads_h))


def test_nan_propagates_as_in_the_reference(kt):
    """A NaN in q or in a listed kv row gives NaN out and lse where the reference gives them (never the
    zero of a row without ids, which stays out = 0, lse = -inf)."""
    case = INTERP_CASES[0]
    inp = make_inputs(case, seed=5)
    q, kv, ids = inp["q"].clone(), inp["kv"].clone(), inp["token_ids"]
    q[0, 1, 5] = float("nan")
    kv[int(ids[2][ids[2] >= 0][0]), 3] = float("nan")
    out, lse = kt.sparse_mla_fwd(q, kv, ids, inp["scale"], inp["d_v"], block_n=16)
    want_out, want_lse = ref.sparse_mla_reference(q, kv, ids, inp["scale"], inp["d_v"])
    assert out[0, 1].isnan().all() and lse[0, 1].isnan() and out[2].isnan().all() and lse[2].isnan().all()
    assert torch.equal(out.isnan(), want_out.isnan()) and torch.equal(lse.isnan(), want_lse.isnan())
    empty = (ids < 0).all(1)
    assert (out[empty] == 0).all() and (lse[empty] == float("-inf")).all()


def test_unsupported_dim_raises(kt):
    with pytest.raises(ValueError, match="D <= 1024"):
        kt.forward.chunking(2048)


# ---------------------------------------------------------------------------------------------
# CUDA (compiled kernels through the ops)
# ---------------------------------------------------------------------------------------------

CUDA_CASES = [  # (heads, dim, d_v, width)
    (16, 64, 64, 100), (32, 128, 96, 130), (64, 256, 256, 257), (64, 512, 512, 300), (128, 512, 448, 70),
]


def _cuda_inputs(H, D, dv, W, T=257, S=400, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = (torch.randn(T, H, D, generator=gen) * 2).bfloat16()
    kv = torch.randn(S, D, generator=gen).bfloat16()
    ids = torch.stack([torch.randperm(S, generator=gen)[:W] for _ in range(T)])
    ids[torch.rand(T, W, generator=gen) < 0.2] = -1
    ids[3] = -1
    dout = torch.randn(T, H, dv, generator=gen).bfloat16()
    dlse = torch.randn(T, H, generator=gen) * 0.1
    return q, kv, ids, dout, dlse


@pytest.mark.cuda
@pytest.mark.parametrize("H,D,dv,W", CUDA_CASES, ids=[f"H{c[0]}-D{c[1]}-dv{c[2]}" for c in CUDA_CASES])
def test_cuda_op_matches_fp64_and_is_deterministic(H, D, dv, W):
    from inductor_ext.ops.sparse_mla import sparse_mla

    q, kv, ids, dout, dlse = _cuda_inputs(H, D, dv, W)
    scale = D ** -0.5
    out64, lse64, dq64, dkv64 = fp64_vjp(q, kv, ids, scale, dv, dout, dlse)
    qc, kvc = q.cuda().requires_grad_(True), kv.cuda().requires_grad_(True)
    out, lse = sparse_mla(qc, kvc, ids.cuda(), scale=scale, d_v=dv, return_lse=True)
    _forward_checks("cuda fwd", out.detach().cpu(), lse.detach().cpu(), out64, lse64)
    grads = torch.autograd.grad((out, lse), (qc, kvc), (dout.cuda(), dlse.cuda()))
    assert_rel_l2("cuda dq", grads[0].cpu(), dq64, GRAD_TOL)
    assert_rel_l2("cuda dkv", grads[1].cpu(), dkv64, GRAD_TOL)
    out2, lse2 = sparse_mla(qc, kvc, ids.cuda(), scale=scale, d_v=dv, return_lse=True)
    grads2 = torch.autograd.grad((out2, lse2), (qc, kvc), (dout.cuda(), dlse.cuda()))
    assert torch.equal(out, out2) and all(torch.equal(a, b) for a, b in zip(grads, grads2)), "not bitwise repeatable"
    ro, rl = ref.sparse_mla_reference(q, kv, ids, scale, dv)
    assert (out.detach().cpu().float() - ro.float()).abs().max() <= 2 ** -6 * ro.float().abs().max(), "vs CPU reference"


@pytest.mark.cuda
def test_cuda_graph_capture_forward_backward():
    q, kv, ids, dout, dlse = (x.cuda() for x in _cuda_inputs(64, 512, 512, 300, T=128))
    scale = 512 ** -0.5

    def step():
        out, lse = torch.ops.glm53.sparse_mla(q, kv, ids, scale, 512, True)
        return (out, lse, *torch.ops.glm53.sparse_mla_bwd(q, kv, ids, out, lse, dout, dlse, scale, 512, True))

    import inductor_ext.ops.sparse_mla  # noqa: F401

    eager = step()
    captured = graph_replay(step)
    for name, a, b in zip(("out", "lse", "dq", "dkv"), captured, eager):
        assert torch.equal(a, b), f"{name}: graph replay differs from eager"
