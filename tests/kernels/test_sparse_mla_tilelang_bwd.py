"""TileLang backward of ``glm53::sparse_mla`` (``inductor_ext.kernels.sparse_mla.tilelang_backward``).

CPU: the kernel takes the forward's geometries and the op routes its backward like its forward
(TileLang where supported and installed, else Triton, the missing extra logged once). ``cuda``: dq
and dkv against the FP64 VJP (relative L2 <= 1e-2) at awkward cases (padding anywhere, an empty
row, a row of one id, duplicate ids, H 64 / 128, D 256 / 512, int32 / int64 ids), bitwise equal run
to run, the int64 and FP32-atomic variants within the same bound, a rarely picked latent row as
precise as a popular one, the op routed to the kernel and captured in
a CUDA graph; these skip unless an sm_90 GPU and tilelang are present.
"""

import importlib
import itertools
import logging

import pytest
import torch

from inductor_ext import backends
from inductor_ext.kernels.sparse_mla import tilelang_backward as tlb
from inductor_ext.kernels.sparse_mla import tilelang_forward as tlf
from tests.support.fp64 import assert_rel_l2
from tests.support.sparse_mla import awkward_ids_inputs, fp64_vjp

pytest.importorskip("triton")

GRAD_TOL = 1e-2
H200 = (9, 0)


def _meta(T=4, H=64, D=512, S=8, W=5, dtype=torch.bfloat16, ids=torch.int32):
    return (torch.empty(T, H, D, dtype=dtype, device="meta"), torch.empty(S, D, dtype=dtype, device="meta"),
            torch.empty(T, W, dtype=ids, device="meta"))


def test_backward_takes_the_forward_geometries():
    grid = itertools.product((16, 64, 96, 128), (128, 256, 384, 512, 576), (torch.bfloat16, torch.float16),
                             (torch.int32, torch.int64), ((9, 0), (10, 0)))
    for H, D, dtype, ids, cap in grid:
        for d_v in (D, D - 64):
            args = (*_meta(H=H, D=D, dtype=dtype, ids=ids), d_v, cap)
            assert tlb.supports(*args) == tlf.supports(*args), (H, D, d_v, dtype, ids, cap)
    assert tlb.supports(*_meta(), 512, H200)


def test_backward_route_prefers_tilelang_and_logs_a_missing_extra(monkeypatch, caplog):
    op = importlib.import_module("inductor_ext.ops.sparse_mla")

    q, kv, ids = _meta()
    rest = (None, None, None, None, 0.1)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: H200)
    monkeypatch.setattr(backends, "_import", lambda name: (object(), None))
    assert op._bwd_route(q, kv, ids, *rest, 512, True)[0] == "tilelang"
    assert op._bwd_route(q, kv, ids, *rest, 448, True)[0] == "triton"
    monkeypatch.setattr(backends, "_import", lambda name: (None, "ImportError: no tilelang") if name == "tilelang"
                        else (object(), None))
    backends._log_fallback.cache_clear()
    with caplog.at_level(logging.WARNING, logger="inductor_ext"):
        assert op._bwd_route(q, kv, ids, *rest, 512, True)[0] == "triton"
        assert op._bwd_route(q, kv, ids, *rest, 512, True)[0] == "triton"
    said = [r.getMessage() for r in caplog.records if "tilelang" in r.getMessage()]
    assert len(said) == 1 and "glm53::sparse_mla_bwd" in said[0] and "the Triton kernel" in said[0], said


def _gpu_ready() -> bool:
    return (torch.cuda.is_available() and torch.cuda.get_device_capability() == H200
            and backends.available("tilelang"))


gpu = pytest.mark.skipif(not _gpu_ready(), reason="needs an sm_90 GPU and the tilelang extra")

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
@gpu
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
    _, dkv_f = tlb.sparse_mla_bwd_tilelang(*args, deterministic=False)
    assert_rel_l2("dkv (fp32 atomics)", dkv_f.cpu(), dkv64, GRAD_TOL)
    dq64b, dkv_64 = tlb.sparse_mla_bwd_tilelang(*args, accumulator="fixed64")
    assert torch.equal(dq, dq64b), "dq depends on the dkv accumulator"
    assert_rel_l2("dkv (int64, one scale)", dkv_64.cpu(), dkv64, GRAD_TOL)


@pytest.mark.cuda
@gpu
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
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()
    graph.replay()
    torch.cuda.synchronize()
    assert all(torch.equal(a, b) for a, b in zip(captured, eager)), "graph replay differs from eager"


@pytest.mark.cuda
@gpu
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
