"""Triton kernel of ``glm53::bi_mhc_coefficients`` (``inductor_ext.kernels.batch_invariant.mhc``)
under Triton's interpreter (CPU tensors; ``TRITON_INTERPRET=1 pytest
tests/kernels/test_mhc_batch_invariant_triton.py``, own process, otherwise the tests skip and say so).

Contracts: every row bitwise the row computed alone (M = 1..8 and inside a shuffled 300-row call);
within ``TOL`` of the CPU ordered-chain kernel (numpy's exp against torch's: FP32 ulps) for N = 4
(GLM-5.3) and N = 2, with 1 and 20 Sinkhorn iterations (with the Sinkhorn order planted wrong,
rows first, the comparison fails); a width that is not (2+N)·N with N a power of two raises. The CUDA run goes through the op (``tests/ops/test_mhc_batch_invariant.py``).
"""

import importlib
import os

import pytest
import torch

from inductor_ext.ops.mhc_reference import coefficients_from_projection
from tests.support.batch_invariant import check_batch_invariance, rel_l2
from tests.support.triton_interpreter import apply_interpreter_shims

pytest.importorskip("triton")

TOL = 1e-6  # relative L2


@pytest.fixture(scope="module")
def km():
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("interpreter tests: run `TRITON_INTERPRET=1 pytest tests/kernels/test_mhc_batch_invariant_triton.py` "
                    "(own process)")
    apply_interpreter_shims()
    return importlib.import_module("inductor_ext.kernels.batch_invariant.mhc")


def _inputs(N, R, seed=0):
    g = torch.Generator().manual_seed(seed)
    W = (2 + N) * N
    return torch.randn(R, W, generator=g) * 2, torch.randn(W, generator=g), torch.rand(3, generator=g) + 0.5


def _stacked(outs):
    pre, post, comb = outs
    return torch.cat([pre, post, comb.flatten(1)], 1)


@pytest.mark.parametrize("N,iters", [(4, 20), (4, 1), (2, 20)], ids=["N4", "N4-one-iter", "N2"])
def test_close_to_the_ordered_chain_reference(km, N, iters):
    proj, base, scale = _inputs(N, 70)
    got = km.bi_mhc_coefficients_rows(proj, base, scale, 1e-6, iters)
    want = coefficients_from_projection(proj, base, scale, 1e-6, iters, invariant=True)[:3]
    for name, a, b in zip(("pre", "post", "comb"), got, want):
        assert a.shape == b.shape and a.dtype == torch.float32
        assert rel_l2(a, b) <= TOL, f"{name}: relative L2 {rel_l2(a, b):.2e}"


def test_rows_are_batch_invariant(km):
    proj, base, scale = _inputs(4, 8)
    fn = lambda p: _stacked(km.bi_mhc_coefficients_rows(p, base, scale, 1e-6, 20))  # noqa: E731
    assert check_batch_invariance(fn, proj, sizes=range(1, 9), big=300) == []


def test_bad_width_raises(km):
    with pytest.raises(ValueError, match="power of two"):
        km.bi_mhc_coefficients_rows(torch.zeros(2, 15), torch.zeros(15), torch.ones(3), 1e-6, 2)  # N = 3
