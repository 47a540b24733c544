"""``glm53::bi_mhc_coefficients`` and the batch-invariant mHC (``inductor_ext.ops.mhc_batch_invariant``).

CPU: the coefficients of a row alone are bitwise its coefficients inside any call (M = 1..64 and a
shuffled 4096-row call; a planted batch-variant Sinkhorn fails the check); they are bitwise the
ordered-chain formulas of ``mhc_pre_batch_invariant`` before this op existed (the reference
function ``coefficients_from_projection(..., invariant=True)``) and within FP32 rounding of FP64;
gradients match the FP64 VJP; opcheck; bad inputs raise. CUDA: the Triton kernel through the op is
batch-invariant, within ``GPU_TOL`` of the CPU kernel, and captures in a CUDA graph.
"""

import pytest
import torch

import inductor_ext.ops as ops
from inductor_ext.ops.mhc_reference import coefficients_from_projection
from tests.support.batch_invariant import check_batch_invariance, rel_l2

N = 4
W = (2 + N) * N
GPU_TOL = 2e-6  # Triton's approximate exp / sigmoid (ex2.approx) against torch's, relative L2


def _inputs(R=64, seed=0, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    proj = torch.randn(R, W, generator=g) * 2
    base, scale = torch.randn(W, generator=g), torch.rand(3, generator=g) + 0.5
    return proj.to(device), base.to(device), scale.to(device)


def _stacked(proj, base, scale):
    pre, post, comb = ops.bi_mhc_coefficients(proj, base, scale)
    return torch.cat([pre, post, comb.flatten(1)], 1)


def test_rows_are_batch_invariant_and_a_planted_split_is_caught():
    proj, base, scale = _inputs()
    assert check_batch_invariance(lambda p: _stacked(p, base, scale), proj) == []

    def planted(p):  # the plain formulas (torch reductions, sigmoid, softmax) when more than 8 rows share the call
        if p.shape[0] <= 8:
            return _stacked(p, base, scale)
        pre, post, comb, saved = coefficients_from_projection(p, base, scale, 1e-6, 20)
        return torch.cat([pre, post, comb.flatten(1)], 1)

    assert check_batch_invariance(planted, proj) != []


def test_equals_the_ordered_chain_formulas_and_fp64():
    proj, base, scale = _inputs(R=32)
    got = ops.bi_mhc_coefficients(proj, base, scale, hc_eps=1e-6, sinkhorn_iters=20)
    want = coefficients_from_projection(proj, base, scale, 1e-6, 20, invariant=True)[:3]
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    f64 = coefficients_from_projection(proj.double(), base.double(), scale.double(), 1e-6, 20)[:3]
    for name, a, b in zip(("pre", "post", "comb"), got, f64):
        assert rel_l2(a, b) <= 1e-6, name


def test_gradients_match_fp64_vjp():
    proj, base, scale = _inputs(R=16, seed=1)
    g = torch.Generator().manual_seed(2)
    cot = (torch.randn(16, N, generator=g), torch.randn(16, N, generator=g), torch.randn(16, N, N, generator=g))
    leaves = [t.clone().requires_grad_() for t in (proj, base, scale)]
    got = torch.autograd.grad(ops.bi_mhc_coefficients(*leaves), leaves, cot)
    leaves64 = [t.double().requires_grad_() for t in (proj, base, scale)]
    want = torch.autograd.grad(coefficients_from_projection(*leaves64, 1e-6, 20)[:3], leaves64,
                               [c.double() for c in cot])
    for name, a, b in zip(("dproj", "dbase", "dscale"), got, want):
        assert rel_l2(a, b) <= 1e-5, name


def test_opcheck():
    proj, base, scale = _inputs(R=5)
    torch.library.opcheck(torch.ops.glm53.bi_mhc_coefficients, (proj, base, scale, 1e-6, 3))


def test_bad_inputs_raise():
    proj, base, scale = _inputs(R=3)
    with pytest.raises(ValueError, match="float32"):
        ops.bi_mhc_coefficients(proj.bfloat16(), base, scale)
    with pytest.raises(ValueError, match=r"base must be \[24\]"):
        ops.bi_mhc_coefficients(proj, base[:-1], scale)
    with pytest.raises(ValueError, match="sinkhorn_iters"):
        ops.bi_mhc_coefficients(proj, base, scale, sinkhorn_iters=0)
    with pytest.raises(ValueError, match=r"\(2\+N\)\*N"):
        ops.bi_mhc_coefficients(proj[:, :23], base[:23], scale)


@pytest.mark.cuda
def test_cuda_kernel_invariant_close_and_captured():
    proj, base, scale = _inputs(device="cuda")
    assert check_batch_invariance(lambda p: _stacked(p, base, scale), proj) == []
    got = ops.bi_mhc_coefficients(proj, base, scale)
    want = ops.bi_mhc_coefficients(proj.cpu(), base.cpu(), scale.cpu())
    for name, a, b in zip(("pre", "post", "comb"), got, want):
        assert rel_l2(a.cpu(), b) <= GPU_TOL, name
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = ops.bi_mhc_coefficients(proj, base, scale)
    graph.replay()
    torch.cuda.synchronize()
    assert all(torch.equal(a, b) for a, b in zip(captured, got))
