"""TileLang forward of ``glm53::sparse_mla`` (``inductor_ext.kernels.sparse_mla.tilelang_forward``).

CPU: which geometries the kernel takes and how the op routes (TileLang where supported and
installed, else the Triton forward, the missing extra logged once). ``cuda``: the kernel against the
independent FP64 reference (out within 2x the BF16 floor, lse within 1e-5) at awkward cases, the op
routed to it (bitwise the direct call), the Triton forward beside it, and CUDA-graph capture; these
skip unless an sm_90 GPU and tilelang are present.
"""

import importlib
import logging

import pytest
import torch

from inductor_ext import backends
from inductor_ext.kernels.sparse_mla import tilelang_forward as tlf
from tests.support.fp64 import assert_rel_l2, rel_l2
from tests.support.sparse_mla import awkward_ids_inputs, bf16_floor, fp64_sparse_mla

pytest.importorskip("triton")

FLOOR_RATIO = 2.0
LSE_TOL = 1e-5
H200 = (9, 0)


def _meta(T=4, H=64, D=512, S=8, W=5, dtype=torch.bfloat16, ids=torch.int32):
    return (torch.empty(T, H, D, dtype=dtype, device="meta"), torch.empty(S, D, dtype=dtype, device="meta"),
            torch.empty(T, W, dtype=ids, device="meta"))


def test_supported_geometries():
    q, kv, ids = _meta()
    assert tlf.supports(q, kv, ids, 512, H200) and tlf.supports(*_meta(H=128, ids=torch.int64), 512, H200)
    assert tlf.supports(*_meta(D=256), 256, H200) and not tlf.supports(*_meta(D=128), 128, H200)
    assert not tlf.supports(q, kv, ids, 512, (10, 0))  # sm_90a code only
    assert not tlf.supports(q, kv, ids, 448, H200)  # d_v < D
    assert not tlf.supports(*_meta(H=32), 512, H200) and not tlf.supports(*_meta(H=96), 512, H200)
    assert not tlf.supports(*_meta(D=576), 576, H200) and not tlf.supports(*_meta(D=384), 384, H200)
    assert not tlf.supports(*_meta(dtype=torch.float16), 512, H200)


def test_route_prefers_tilelang_and_logs_a_missing_extra(monkeypatch, caplog):
    op = importlib.import_module("inductor_ext.ops.sparse_mla")  # the package exports the wrapper by that name

    q, kv, ids = _meta()
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: H200)
    monkeypatch.setattr(backends, "_import", lambda name: (object(), None))
    assert op._fwd_route(q, kv, ids, 0.1, 512, True)[0] == "tilelang"
    assert op._fwd_route(q, kv, ids, 0.1, 448, True)[0] == "triton"
    monkeypatch.setattr(backends, "_import", lambda name: (None, "ImportError: no tilelang") if name == "tilelang"
                        else (object(), None))
    backends._log_fallback.cache_clear()
    with caplog.at_level(logging.WARNING, logger="inductor_ext"):
        assert op._fwd_route(q, kv, ids, 0.1, 512, True)[0] == "triton"
        assert op._fwd_route(q, kv, ids, 0.1, 512, True)[0] == "triton"
    said = [r.getMessage() for r in caplog.records if "tilelang" in r.getMessage()]
    assert len(said) == 1 and "the Triton kernel" in said[0], said


def _gpu_ready() -> bool:
    return (torch.cuda.is_available() and torch.cuda.get_device_capability() == H200
            and backends.available("tilelang"))


gpu = pytest.mark.skipif(not _gpu_ready(), reason="needs an sm_90 GPU and the tilelang extra")

CUDA_CASES = [  # (name, T, H, D, S, W, id dtype)
    ("H64-D512-W200-pad-anywhere", 300, 64, 512, 300, 200, torch.int32),
    ("H128-D512-W130-int64", 120, 128, 512, 500, 130, torch.int64),
    ("H64-D256-W2051", 70, 64, 256, 90, 2051, torch.int32),
    ("T1-W5", 1, 64, 512, 7, 5, torch.int32),
]


@pytest.mark.cuda
@gpu
@pytest.mark.parametrize("case", CUDA_CASES, ids=[c[0] for c in CUDA_CASES])
def test_forward_matches_fp64(case):
    from inductor_ext.kernels.sparse_mla import sparse_mla_fwd

    _, T, H, D, S, W, id_dtype = case
    q, kv, ids = awkward_ids_inputs(T, H, D, S, W, id_dtype)
    scale = D ** -0.5
    out64, lse64 = fp64_sparse_mla(q.double(), kv.double(), ids, scale, D)
    out, lse = (x.cpu() for x in tlf.sparse_mla_fwd_tilelang(q.cuda(), kv.cuda(), ids.cuda(), scale, D))
    floor = bf16_floor(out64)
    err = rel_l2(out, out64.to(torch.bfloat16).double())
    assert err <= FLOOR_RATIO * max(floor, 1e-30) or floor == 0, f"out: {err:.3e} vs floor {floor:.3e}"
    finite = torch.isfinite(lse64)
    assert torch.equal(torch.isfinite(lse), finite)
    if finite.any():
        assert_rel_l2("lse", lse[finite], lse64[finite], LSE_TOL)
    empty = (ids < 0).all(1)
    assert (out[empty] == 0).all()
    again = tlf.sparse_mla_fwd_tilelang(q.cuda(), kv.cuda(), ids.cuda(), scale, D)[0].cpu()
    assert torch.equal(out, again), "not bitwise repeatable"
    tri = sparse_mla_fwd(q.cuda(), kv.cuda(), ids.cuda(), scale, D)[0].cpu()
    assert (out.float() - tri.float()).abs().max() <= 2 ** -6 * out64.abs().max(), "vs the Triton forward"


@pytest.mark.cuda
@gpu
def test_op_routes_to_tilelang_and_captures():
    import inductor_ext.ops.sparse_mla  # noqa: F401

    q, kv, ids = (x.cuda() for x in awkward_ids_inputs(128, 64, 512, 300, 300, torch.int32))
    scale = 512 ** -0.5
    direct = tlf.sparse_mla_fwd_tilelang(q, kv, ids, scale, 512)
    eager = torch.ops.glm53.sparse_mla(q, kv, ids, scale, 512, True)
    assert all(torch.equal(a, b) for a, b in zip(direct, eager)), "the op did not run the TileLang kernel"
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        torch.ops.glm53.sparse_mla(q, kv, ids, scale, 512, True)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = torch.ops.glm53.sparse_mla(q, kv, ids, scale, 512, True)
    graph.replay()
    torch.cuda.synchronize()
    assert all(torch.equal(a, b) for a, b in zip(captured, eager)), "graph replay differs from eager"
