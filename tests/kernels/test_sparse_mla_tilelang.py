"""TileLang forward of ``glm53::sparse_mla`` (``inductor_ext.kernels.sparse_mla.tilelang_forward``).

CPU: which geometries the TileLang kernels take (one ``supports`` for forward and backward), which
inputs they read in place (``row_major_inputs``) and how the op routes both (TileLang where
supported and installed, else Triton, the missing extra logged once). ``cuda``: the kernel against
the independent FP64 reference (out within 2x the BF16 floor, lse within 1e-5) at awkward cases, a
head-major q read in place (bitwise the contiguous q's result), the op routed to it (bitwise the
direct call), the Triton forward beside it, and CUDA-graph capture; these skip unless an sm_90 GPU
and tilelang are present.
"""

import importlib
import logging

import pytest
import torch

from inductor_ext import backends
from inductor_ext.kernels.sparse_mla import tilelang_backward as tlb
from inductor_ext.kernels.sparse_mla import tilelang_forward as tlf
from tests.support.fp64 import assert_rel_l2, rel_l2
from tests.support.sparse_mla import (
    H200,
    awkward_ids_inputs,
    bf16_floor,
    fp64_sparse_mla,
    graph_replay,
    head_major,
    meta_inputs,
    tilelang_gpu,
)

pytest.importorskip("triton")

FLOOR_RATIO = 2.0
LSE_TOL = 1e-5


def test_supported_geometries():
    q, kv, ids = meta_inputs()
    assert tlf.supports(q, kv, ids, 512, H200) and tlf.supports(*meta_inputs(H=128, ids=torch.int64), 512, H200)
    assert tlf.supports(*meta_inputs(D=256), 256, H200) and not tlf.supports(*meta_inputs(D=128), 128, H200)
    assert not tlf.supports(q, kv, ids, 512, (10, 0))  # sm_90a code only
    assert not tlf.supports(q, kv, ids, 448, H200)  # d_v < D
    assert not tlf.supports(*meta_inputs(H=32), 512, H200) and not tlf.supports(*meta_inputs(H=96), 512, H200)
    assert not tlf.supports(*meta_inputs(D=576), 576, H200) and not tlf.supports(*meta_inputs(D=384), 384, H200)
    assert not tlf.supports(*meta_inputs(dtype=torch.float16), 512, H200)


def test_row_major_inputs_passes_readable_strides_in_place():
    from inductor_ext.kernels.sparse_mla.tilelang_common import row_major_inputs

    q = torch.randn(6, 64, 512).bfloat16()
    hm = head_major(q)
    (same,), strided = row_major_inputs(hm)
    assert strided and same is hm
    (plain,), strided = row_major_inputs(q)  # contiguous: the plain kernel
    assert not strided and plain is q
    odd = torch.randn(3, 6, 64, 516).bfloat16()[1, :, :, 4:]  # 516-wide rows: strides not multiples of 8
    assert odd.stride(-1) == 1 and not odd.is_contiguous()
    (fixed, other), strided = row_major_inputs(odd, hm)
    assert not strided and fixed.is_contiguous() and other.is_contiguous() and torch.equal(other, q)


ROUTES = [  # (router, op name, the router's arguments after q, kv, ids for a given d_v)
    ("_fwd_route", "glm53::sparse_mla", lambda d_v: (0.1, d_v, True)),
    ("_bwd_route", "glm53::sparse_mla_bwd", lambda d_v: (None, None, None, None, 0.1, d_v, True)),
]


@pytest.mark.parametrize("route,op_name,rest", ROUTES, ids=[r[0] for r in ROUTES])
def test_route_prefers_tilelang_and_logs_a_missing_extra(monkeypatch, caplog, route, op_name, rest):
    """The forward and the backward route alike: TileLang where supported, one log line without it."""
    op = importlib.import_module("inductor_ext.ops.sparse_mla")  # the package exports the wrapper by that name

    router = getattr(op, route)
    q, kv, ids = meta_inputs()
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: H200)
    monkeypatch.setattr(backends, "_import", lambda name: (object(), None))
    assert router(q, kv, ids, *rest(512))[0] == "tilelang"
    assert router(q, kv, ids, *rest(448))[0] == "triton"
    monkeypatch.setattr(backends, "_import", lambda name: (None, "ImportError: no tilelang") if name == "tilelang"
                        else (object(), None))
    backends._log_fallback.cache_clear()
    with caplog.at_level(logging.WARNING, logger="inductor_ext"):
        assert router(q, kv, ids, *rest(512))[0] == "triton"
        assert router(q, kv, ids, *rest(512))[0] == "triton"
    said = [r.getMessage() for r in caplog.records if "tilelang" in r.getMessage()]
    assert len(said) == 1 and said[0].startswith(f"{op_name}: ") and "the Triton kernel" in said[0], said


def test_backward_takes_the_forward_geometries():
    assert tlb.supports is tlf.supports


CUDA_CASES = [  # (name, T, H, D, S, W, id dtype)
    ("H64-D512-W200-pad-anywhere", 300, 64, 512, 300, 200, torch.int32),
    ("H128-D512-W130-int64", 120, 128, 512, 500, 130, torch.int64),
    ("H64-D256-W2051", 70, 64, 256, 90, 2051, torch.int32),
    ("T1-W5", 1, 64, 512, 7, 5, torch.int32),
]


@pytest.mark.cuda
@tilelang_gpu
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
    in_place = tlf.sparse_mla_fwd_tilelang(head_major(q.cuda()), kv.cuda(), ids.cuda(), scale, D)
    assert torch.equal(out, in_place[0].cpu()) and torch.equal(lse, in_place[1].cpu()), "head-major q read in place"
    tri = sparse_mla_fwd(q.cuda(), kv.cuda(), ids.cuda(), scale, D)[0].cpu()
    assert (out.float() - tri.float()).abs().max() <= 2 ** -6 * out64.abs().max(), "vs the Triton forward"


@pytest.mark.cuda
@tilelang_gpu
def test_op_routes_to_tilelang_and_captures():
    import inductor_ext.ops.sparse_mla  # noqa: F401

    q, kv, ids = (x.cuda() for x in awkward_ids_inputs(128, 64, 512, 300, 300, torch.int32))
    scale = 512 ** -0.5
    direct = tlf.sparse_mla_fwd_tilelang(q, kv, ids, scale, 512)
    eager = torch.ops.glm53.sparse_mla(q, kv, ids, scale, 512, True)
    assert all(torch.equal(a, b) for a, b in zip(direct, eager)), "the op did not run the TileLang kernel"
    captured = graph_replay(lambda: torch.ops.glm53.sparse_mla(q, kv, ids, scale, 512, True))
    assert all(torch.equal(a, b) for a, b in zip(captured, eager)), "graph replay differs from eager"
