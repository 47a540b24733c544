"""TileLang forward of ``glm53::sparse_mla`` (``inductor_ext.kernels.sparse_mla.tilelang_forward``).

CPU: which geometries the TileLang kernels take (one ``supports`` for forward and backward, and the
reason when not), which inputs they read in place (``row_major_inputs``) and which back-end the
registry selects for both (TileLang where supported and installed, else Triton, the reason logged once). ``cuda``: the kernel against
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
from inductor_ext.kernels.sparse_mla.tilelang_common import unsupported
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


OPS = [  # (op name, its arguments after q, kv, token_ids by name for a given d_v)
    ("glm53::sparse_mla", lambda d_v: dict(scale=0.1, d_v=d_v, deterministic=True)),
    ("glm53::sparse_mla_bwd", lambda d_v: dict(out=None, lse=None, dout=None, dlse=None, scale=0.1, d_v=d_v,
                                               deterministic=True)),
]


@pytest.mark.parametrize("op_name,rest", OPS, ids=[o[0] for o in OPS])
def test_registry_prefers_tilelang_and_logs_a_missing_extra(monkeypatch, caplog, op_name, rest):
    """The forward and the backward select alike: TileLang where supported, else Triton with one log line
    saying why."""
    importlib.import_module("inductor_ext.ops.sparse_mla")  # the package exports the wrapper by that name
    q, kv, ids = meta_inputs()

    def select(d_v):
        return backends.select(op_name, q=q, kv=kv, token_ids=ids, **rest(d_v)).name

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: H200)
    monkeypatch.setattr(backends, "_import", lambda name: (object(), None))
    monkeypatch.setattr(backends, "_LOGGED", set())
    assert [b.name for b in backends.REGISTRY[op_name].order()] == ["tilelang", "triton", "reference"]
    assert select(512) == "tilelang"
    with caplog.at_level(logging.WARNING, logger="inductor_ext"):
        assert select(448) == "triton"
    said = [r.getMessage() for r in caplog.records]
    assert said == [f"{op_name}: back-end 'tilelang' (the TileLang kernels) skipped: needs D = d_v of 256 or 512, "
                    "got D=512, d_v=448; using 'triton' (the Triton kernels)"], said
    caplog.clear()
    monkeypatch.setattr(backends, "_import", lambda name: (None, "ImportError: no tilelang") if name == "tilelang"
                        else (object(), None))
    with caplog.at_level(logging.WARNING, logger="inductor_ext"):
        assert select(512) == "triton"
        assert select(512) == "triton"
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 1 and said[0].startswith(f"{op_name}: back-end 'tilelang'"), said
    assert "tilelang does not import (ImportError: no tilelang); install it: pip install tilelang" in said[0]


def test_unsupported_says_why():
    q, kv, ids = meta_inputs()
    assert unsupported(q, kv, ids, 512, H200) is None
    assert unsupported(q, kv, ids, 512, (10, 0)) == "needs an sm_90 device, got compute capability (10, 0)"
    assert unsupported(*meta_inputs(H=32), 512, H200) == "needs the head count to be a multiple of 64, got H=32"
    assert unsupported(*meta_inputs(dtype=torch.float16), 512, H200) == (
        "needs bfloat16 q and kv, got torch.float16 and torch.float16")
    assert unsupported(*meta_inputs(D=128), 128, H200) == "needs D = d_v of 256 or 512, got D=128, d_v=128"


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
