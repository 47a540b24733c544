"""glm53::sparse_mla on CPU (the plain-torch reference kernels) against an independent FP64 per-query
reference (``tests.support.sparse_mla``) and its autograd VJP.

Contracts: BF16 out within 2x the BF16 rounding floor of the FP64 result (measured against that
result rounded to BF16); lse (FP32) within 1e-5; dq, dkv within 1e-2 relative L2 of the FP64 VJP
for BF16 inputs (1e-5 for FP32 inputs: the FP32 intermediates); rows without ids give out = 0,
lse = -inf; bad inputs raise ValueError naming the rule; no [T, S] tensor at T = 32768; one graph
under torch.compile(fullgraph=True).
"""

import os
import subprocess
import sys

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend
from torch.utils._python_dispatch import TorchDispatchMode

from inductor_ext.ops import sparse_mla_reference as ref
from inductor_ext.ops.sparse_mla import sparse_mla
from tests.support.fp64 import assert_rel_l2, rel_l2
from tests.support.sparse_mla import CASES, bf16_floor, fp64_vjp, make_inputs

TOL = {"out_floor_ratio": 2.0, "lse": 1e-5, "grad": {torch.bfloat16: 1e-2, torch.float32: 1e-5},
       "out_fp32": 1e-5}
ids = [c.name for c in CASES]


def _run(inp, requires_grad=True):
    q = inp["q"].clone().requires_grad_(requires_grad)
    kv = inp["kv"].clone().requires_grad_(requires_grad)
    out, lse = sparse_mla(q, kv, inp["token_ids"], scale=inp["scale"], d_v=inp["d_v"], return_lse=True)
    return q, kv, out, lse


def _check_lse(lse, lse64):
    finite = torch.isfinite(lse64)
    assert torch.equal(torch.isfinite(lse), finite), "lse: -inf rows differ from the FP64 reference"
    assert (lse[~finite] == float("-inf")).all(), "lse: rows without ids must be -inf"
    if finite.any():
        assert_rel_l2("lse", lse[finite], lse64[finite], TOL["lse"])


@pytest.mark.parametrize("case", CASES, ids=ids)
def test_forward_matches_fp64_within_bf16_floor(case):
    inp = make_inputs(case)
    _, _, out, lse = _run(inp, requires_grad=False)
    out64, lse64, _, _ = fp64_vjp(inp["q"], inp["kv"], inp["token_ids"], inp["scale"], inp["d_v"],
                                  inp["dout"], inp["dlse"])
    assert out.dtype == torch.bfloat16 and out.shape == (sum(case.docs), case.heads, case.d_v)
    assert lse.dtype == torch.float32
    floor = bf16_floor(out64)
    err = rel_l2(out, out64.to(torch.bfloat16).double())
    assert err <= TOL["out_floor_ratio"] * floor, f"out: relative L2 {err:.3e} > 2 x BF16 floor {floor:.3e}"
    _check_lse(lse, lse64)
    empty = (inp["token_ids"] < 0).all(1)
    assert (out[empty] == 0).all(), "out: rows without ids must be 0"


@pytest.mark.parametrize("case", CASES, ids=ids)
def test_grads_match_fp64_vjp(case):
    inp = make_inputs(case, seed=1)
    q, kv, out, lse = _run(inp)
    loss = (out.float() * inp["dout"].float()).sum() + torch.where(torch.isfinite(lse), lse, 0.0).mul(inp["dlse"]).sum()
    loss.backward()
    _, _, dq64, dkv64 = fp64_vjp(inp["q"], inp["kv"], inp["token_ids"], inp["scale"], inp["d_v"],
                                 inp["dout"], inp["dlse"])
    assert q.grad.dtype == q.dtype and kv.grad.dtype == kv.dtype
    assert_rel_l2("dq", q.grad, dq64, TOL["grad"][torch.bfloat16])
    assert_rel_l2("dkv", kv.grad, dkv64, TOL["grad"][torch.bfloat16])
    empty = (inp["token_ids"] < 0).all(1)
    assert (q.grad[empty] == 0).all(), "dq: rows without ids must be 0"


@pytest.mark.parametrize("case", [CASES[1], CASES[4]], ids=[CASES[1].name, CASES[4].name])
def test_fp32_inputs_give_fp32_precision(case):
    """FP32 in, FP32 out: the intermediates' precision (FP32 scores, softmax, accumulation)."""
    inp = make_inputs(case, dtype=torch.float32, seed=2)
    q, kv, out, lse = _run(inp)
    (out * inp["dout"]).sum().backward()
    out64, lse64, dq64, dkv64 = fp64_vjp(inp["q"], inp["kv"], inp["token_ids"], inp["scale"], inp["d_v"],
                                         inp["dout"], torch.zeros_like(inp["dlse"]))
    assert_rel_l2("out", out, out64, TOL["out_fp32"])
    _check_lse(lse, lse64)
    assert_rel_l2("dq", q.grad, dq64, TOL["grad"][torch.float32])
    assert_rel_l2("dkv", kv.grad, dkv64, TOL["grad"][torch.float32])


def test_duplicate_ids_count_twice():
    inp = make_inputs(CASES[0], seed=3)
    ids_ = inp["token_ids"].clone()
    ids_[10, 1] = ids_[10, 0]  # row 10 lists one key twice
    inp["token_ids"] = ids_
    q, kv, out, lse = _run(inp)
    (out.float() * inp["dout"].float()).sum().backward()
    out64, _, dq64, dkv64 = fp64_vjp(inp["q"], inp["kv"], ids_, inp["scale"], inp["d_v"], inp["dout"],
                                     torch.zeros_like(inp["dlse"]))
    assert rel_l2(out, out64.to(torch.bfloat16).double()) <= TOL["out_floor_ratio"] * bf16_floor(out64)
    assert_rel_l2("dkv", kv.grad, dkv64, TOL["grad"][torch.bfloat16])


def test_int32_and_int64_ids_agree():
    inp = make_inputs(CASES[6], seed=4)
    a = sparse_mla(inp["q"], inp["kv"], inp["token_ids"].int(), scale=inp["scale"], d_v=inp["d_v"])
    b = sparse_mla(inp["q"], inp["kv"], inp["token_ids"].long(), scale=inp["scale"], d_v=inp["d_v"])
    assert torch.equal(a, b)


def test_chunked_reference_equals_one_chunk(monkeypatch):
    """Chunking over query rows changes neither the forward nor the gradients (same order of adds)."""
    inp = make_inputs(CASES[0], seed=5)
    q, kv, out, lse = _run(inp)
    g = torch.autograd.grad((out.float() * inp["dout"].float()).sum(), (q, kv))
    monkeypatch.setattr(ref, "CHUNK_BYTES", 3 * 70 * 64 * 4)  # 3 rows per chunk
    assert ref.reference_chunk_rows(70, 64, 4) == 3
    q2, kv2, out2, lse2 = _run(inp)
    g2 = torch.autograd.grad((out2.float() * inp["dout"].float()).sum(), (q2, kv2))
    assert torch.equal(out, out2) and torch.equal(lse, lse2)
    torch.testing.assert_close(g2, g, rtol=0, atol=0)


def test_backward_is_bitwise_repeatable():
    inp = make_inputs(CASES[4], seed=6)
    args = (inp["q"], inp["kv"], inp["token_ids"])
    out, lse = torch.ops.glm53.sparse_mla(*args, inp["scale"], inp["d_v"], True)
    g1 = torch.ops.glm53.sparse_mla_bwd(*args, out, lse, inp["dout"], inp["dlse"], inp["scale"], inp["d_v"], True)
    g2 = torch.ops.glm53.sparse_mla_bwd(*args, out, lse, inp["dout"], inp["dlse"], inp["scale"], inp["d_v"], True)
    assert all(torch.equal(a, b) for a, b in zip(g1, g2))


@pytest.mark.parametrize("case", [CASES[1], CASES[5]], ids=[CASES[1].name, CASES[5].name])
def test_opcheck(case):
    inp = make_inputs(case)
    q = inp["q"].requires_grad_(True)
    kv = inp["kv"].requires_grad_(True)
    torch.library.opcheck(torch.ops.glm53.sparse_mla, (q, kv, inp["token_ids"], inp["scale"], inp["d_v"], True))
    out, lse = torch.ops.glm53.sparse_mla(inp["q"].detach(), inp["kv"].detach(), inp["token_ids"], inp["scale"],
                                          inp["d_v"], True)
    torch.library.opcheck(torch.ops.glm53.sparse_mla_bwd,
                          (inp["q"].detach(), inp["kv"].detach(), inp["token_ids"], out, lse, inp["dout"],
                           inp["dlse"], inp["scale"], inp["d_v"], True))


def _good():
    return {"q": torch.randn(4, 2, 16).bfloat16(), "kv": torch.randn(6, 16).bfloat16(),
            "token_ids": torch.tensor([[0, 1, -1], [2, 3, 4], [-1, -1, -1], [5, 0, 1]]), "scale": 0.25, "d_v": 16}


BAD = [  # (name, change to the good inputs, message fragment)
    ("q-2d", {"q": torch.randn(4, 16).bfloat16()}, "q must be 3-D"),
    ("kv-3d", {"kv": torch.randn(1, 6, 16).bfloat16()}, "kv must be 2-D"),
    ("ids-1d", {"token_ids": torch.tensor([0, 1, 2, 3])}, "token_ids must be 2-D"),
    ("q-int", {"q": torch.ones(4, 2, 16, dtype=torch.int32)}, "q must be bfloat16, float16 or float32"),
    ("kv-dtype", {"kv": torch.randn(6, 16)}, "kv must have q's dtype"),
    ("ids-float", {"token_ids": torch.zeros(4, 3)}, "token_ids must be int32 or int64"),
    ("ids-int16", {"token_ids": torch.zeros(4, 3, dtype=torch.int16)}, "token_ids must be int32 or int64"),
    ("H0", {"q": torch.randn(4, 0, 16).bfloat16()}, "H >= 1"),
    ("D-mismatch", {"kv": torch.randn(6, 8).bfloat16()}, r"kv must be \[S, D=16\]"),
    ("S0", {"kv": torch.randn(0, 16).bfloat16()}, "S >= 1"),
    ("ids-T", {"token_ids": torch.zeros(3, 3, dtype=torch.int64)}, r"token_ids must be \[T=4, W\]"),
    ("W0", {"token_ids": torch.zeros(4, 0, dtype=torch.int64)}, "W >= 1"),
    ("dv0", {"d_v": 0}, "1 <= d_v <= D=16"),
    ("dv-big", {"d_v": 17}, "1 <= d_v <= D=16"),
    ("dv-float", {"d_v": 8.0}, "d_v must be an int"),
    ("scale-inf", {"scale": float("inf")}, "scale must be a finite number"),
    ("scale-none", {"scale": None}, "scale must be a finite number"),
    ("device", {"kv": torch.randn(6, 16, device="meta").bfloat16()}, "one device"),
    ("id-too-large", {"token_ids": torch.tensor([[0, 6, -1]] * 4)}, r"token_ids must be -1 or in \[0, S=6\)"),
    ("id-below-minus-one", {"token_ids": torch.tensor([[0, -2, -1]] * 4)}, r"token_ids must be -1 or in"),
]


@pytest.mark.parametrize("change,match", [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_bad_inputs_raise(change, match):
    args = {**_good(), **change}
    with pytest.raises(ValueError, match=match):
        sparse_mla(args["q"], args["kv"], args["token_ids"], scale=args["scale"], d_v=args["d_v"])


def test_good_inputs_pass():
    args = _good()
    assert sparse_mla(args["q"], args["kv"], args["token_ids"], scale=args["scale"]).shape == (4, 2, 16)


class _LargestTensor(TorchDispatchMode):
    """Records the largest number of elements of any tensor an op returns."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


def _long_inputs(T=32768, H=2, D=16, W=8):
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(T, H, D, generator=gen).bfloat16()
    kv = torch.randn(T, D, generator=gen).bfloat16()
    t = torch.arange(T)[:, None]
    ids = (t - torch.randint(0, 64, (T, W), generator=gen)).clamp_min(-1)  # causal, -1 before the start
    return q, kv, ids


def test_reference_builds_no_t_by_t_tensor():
    T = 32768
    q, kv, ids = _long_inputs(T)
    with _LargestTensor() as mode:
        out, lse = ref.sparse_mla_reference(q, kv, ids, 0.25, 16)
        dout = torch.ones_like(out)
        ref.sparse_mla_bwd_reference(q, kv, ids, out, lse, dout, torch.zeros_like(lse), 0.25, 16)
    assert mode.largest < T * T // 64, f"largest intermediate has {mode.largest} elements (T*T = {T * T})"


_RSS_SCRIPT = r"""
import resource, torch
from tests.ops.test_sparse_mla import _long_inputs
from inductor_ext.ops import sparse_mla_reference as ref
q, kv, ids = _long_inputs()
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
out, lse = ref.sparse_mla_reference(q, kv, ids, 0.25, 16)
ref.sparse_mla_bwd_reference(q, kv, ids, out, lse, torch.ones_like(out), torch.zeros_like(lse), 0.25, 16)
print((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) * 1024)
"""


def test_reference_peak_rss_far_below_t_by_t():
    """Peak resident memory of forward + backward at T = 32768, in a fresh process (ru_maxrss)."""
    T = 32768
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    res = subprocess.run([sys.executable, "-c", _RSS_SCRIPT], cwd=root, capture_output=True, text=True, timeout=300,
                         env={**os.environ, "PYTHONPATH": root})
    assert res.returncode == 0, res.stderr[-2000:]
    delta = int(res.stdout.strip().splitlines()[-1])
    assert delta < T * T * 4 // 16, f"peak RSS grew by {delta / 2**20:.0f} MiB (T*T*4 = {T * T * 4 / 2**20:.0f} MiB)"


def test_compile_forward_backward_one_graph():
    torch._dynamo.reset()
    inp = make_inputs(CASES[1], seed=7)

    def loss(q, kv, ids_):
        out, lse = sparse_mla(q, kv, ids_, scale=inp["scale"], d_v=inp["d_v"], return_lse=True)
        return out.float().square().mean() + torch.where(torch.isfinite(lse), lse, 0.0).mean()

    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(loss, backend=counter, fullgraph=True)
    q = inp["q"].clone().requires_grad_(True)
    kv = inp["kv"].clone().requires_grad_(True)
    got = torch.autograd.grad(compiled(q, kv, inp["token_ids"]), (q, kv))
    want = torch.autograd.grad(loss(q, kv, inp["token_ids"]), (q, kv))
    for name, a, e in zip(("dq", "dkv"), got, want):
        torch.testing.assert_close(a, e, rtol=0, atol=0, msg=lambda m, n=name: f"{n} (compiled): {m}")
    assert counter.frame_count == 1, f"expected one graph, got {counter.frame_count}"
    torch._dynamo.reset()
