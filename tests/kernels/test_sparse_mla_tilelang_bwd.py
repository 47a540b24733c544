"""TileLang backward of ``glm53::sparse_mla`` (``inductor_ext.kernels.sparse_mla.tilelang_backward``).

Its geometries and the op's routing are checked beside the forward's (``test_sparse_mla_tilelang.py``).
``cuda``: dq and dkv against the FP64 VJP (relative L2 <= 1e-2) at awkward cases (padding anywhere,
an empty row, a row of one id, duplicate ids, H 64 / 128, D 256 / 512, int32 / int64 ids), bitwise
equal run to run and with head-major q and dout read in place, the int64 and FP32-atomic variants
within the same bound, a rarely picked latent row as precise as a popular one, the op routed to the
kernel and captured in a CUDA graph; these skip unless an sm_90 GPU and tilelang are present. On
any machine: an unknown accumulator is refused.
"""

import pytest
import torch

from inductor_ext.kernels.sparse_mla import tilelang_backward as tlb
from inductor_ext.kernels.sparse_mla import tilelang_forward as tlf
from tests.support.fp64 import assert_rel_l2
from tests.support.sparse_mla import awkward_ids_inputs, fp64_vjp, graph_replay, head_major, tilelang_gpu

pytest.importorskip("triton")

GRAD_TOL = 1e-2
CUDA_CASES = [  # (name, T, H, D, S, W, id dtype)
    ("H64-D512-W200-pad-anywhere", 300, 64, 512, 300, 200, torch.int32),
    ("H128-D512-W130-int64", 120, 128, 512, 500, 130, torch.int64),
    ("H64-D256-W2051-duplicates", 70, 64, 256, 90, 2051, torch.int32),
    ("T1-W5", 1, 64, 512, 7, 5, torch.int32),
]


def _grad_inputs(T, H, D, S, W, id_dtype):
    q, kv, ids = awkward_ids_inputs(T, H, D, S, W, id_dtype)
    gen = torch.Generator().manual_seed(1)
    dout = torch.randn(T, H, D, generator=gen).bfloat16()
    dlse = torch.randn(T, H, generator=gen) * 0.1
    return q, kv, ids, dout, dlse


@pytest.mark.cuda
@tilelang_gpu
@pytest.mark.parametrize("case", CUDA_CASES, ids=[c[0] for c in CUDA_CASES])
def test_backward_matches_fp64_and_repeats(case):
    _, T, H, D, S, W, id_dtype = case
    q, kv, ids, dout, dlse = _grad_inputs(T, H, D, S, W, id_dtype)
    scale = D ** -0.5
    _, _, dq64, dkv64 = fp64_vjp(q, kv, ids, scale, D, dout, dlse)
    qc, kvc, idc, gc, lc = (x.cuda() for x in (q, kv, ids, dout, dlse))
    out, lse = tlf.sparse_mla_fwd_tilelang(qc, kvc, idc, scale, D)
    args = (qc, kvc, idc, out, lse, gc, lc, scale)
    dq, dkv = tlb.sparse_mla_bwd_tilelang(*args)
    assert_rel_l2("dq", dq.cpu(), dq64, GRAD_TOL)
    assert_rel_l2("dkv", dkv.cpu(), dkv64, GRAD_TOL)
    dq2, dkv2 = tlb.sparse_mla_bwd_tilelang(*args)
    assert torch.equal(dq, dq2) and torch.equal(dkv, dkv2), "not bitwise repeatable"
    dq_h, dkv_h = tlb.sparse_mla_bwd_tilelang(head_major(qc), kvc, idc, out, lse, head_major(gc), lc, scale)
    assert torch.equal(dq, dq_h) and torch.equal(dkv, dkv_h), "head-major q, dout read in place"
    _, dkv_f = tlb.sparse_mla_bwd_tilelang(*args, deterministic=False)
    assert_rel_l2("dkv (fp32 atomics)", dkv_f.cpu(), dkv64, GRAD_TOL)
    dq64b, dkv_64 = tlb.sparse_mla_bwd_tilelang(*args, accumulator="fixed64")
    assert torch.equal(dq, dq64b), "dq depends on the dkv accumulator"
    assert_rel_l2("dkv (int64, one scale)", dkv_64.cpu(), dkv64, GRAD_TOL)


@pytest.mark.cuda
@tilelang_gpu
def test_op_routes_backward_to_tilelang_and_captures():
    import inductor_ext.ops.sparse_mla  # noqa: F401

    q, kv, ids, dout, dlse = (x.cuda() for x in _grad_inputs(128, 64, 512, 300, 300, torch.int32))
    scale = 512 ** -0.5
    out, lse = torch.ops.glm53.sparse_mla(q, kv, ids, scale, 512, True)
    direct = tlb.sparse_mla_bwd_tilelang(q, kv, ids, out, lse, dout, dlse, scale)

    def step():
        return torch.ops.glm53.sparse_mla_bwd(q, kv, ids, out, lse, dout, dlse, scale, 512, True)

    eager = step()
    assert all(torch.equal(a, b) for a, b in zip(direct, eager)), "the op did not run the TileLang backward"
    captured = graph_replay(step)
    assert all(torch.equal(a, b) for a, b in zip(captured, eager)), "graph replay differs from eager"


@pytest.mark.cuda
@tilelang_gpu
@pytest.mark.parametrize("accumulator", ["fixed32x2", "fixed64"])
def test_rarely_picked_row_keeps_its_precision(accumulator):
    """Latent row 1 is listed by one query, row 0 by every query with gradients ~1e6 times larger.
    One int32 scale for the whole tensor would quantize row 1 at 2^-29 of row 0's bound (~2^-5 of
    row 1); its own scale (``fixed32x2``) or 60 bits (``fixed64``) keep it at the BF16 rounding."""
    T, H, D = 24, 64, 256
    gen = torch.Generator().manual_seed(7)
    q = torch.randn(T, H, D, generator=gen).bfloat16()
    kv = torch.randn(3, D, generator=gen).bfloat16()
    ids = torch.tensor([[0, 2, -1]] * T, dtype=torch.int32)
    ids[5, 2] = 1
    dout = torch.randn(T, H, D, generator=gen) * 1e3
    dout[5] *= 1e-6
    dout = dout.bfloat16()
    dlse = torch.zeros(T, H)
    _, _, _, dkv64 = fp64_vjp(q, kv, ids, D ** -0.5, D, dout, dlse)
    qc, kvc, idc = q.cuda(), kv.cuda(), ids.cuda()
    out, lse = tlf.sparse_mla_fwd_tilelang(qc, kvc, idc, D ** -0.5, D)
    _, dkv = tlb.sparse_mla_bwd_tilelang(qc, kvc, idc, out, lse, dout.cuda(), dlse.cuda(), D ** -0.5,
                                         accumulator=accumulator)
    for row in (0, 1):
        assert_rel_l2(f"dkv row {row}", dkv[row].cpu(), dkv64[row], 5e-3)


def test_unknown_accumulator_is_refused():
    q, kv, ids, dout, dlse = _grad_inputs(2, 64, 256, 3, 2, torch.int32)
    out, lse = torch.zeros_like(q), torch.zeros(2, 64)
    with pytest.raises(ValueError, match="fixed64"):
        tlb.sparse_mla_bwd_tilelang(q, kv, ids, out, lse, dout, dlse, 0.1, accumulator="fixed16")
