"""Triton forward of ``glm53::token_logprobs`` (``inductor_ext.kernels.token_logprobs``) against the
CPU reference kernel (``inductor_ext.ops.token_logprobs_reference``).

Without CUDA the kernel runs on CPU tensors under Triton's interpreter (its own process:
``TRITON_INTERPRET=1 pytest tests/kernels/test_token_logprobs_triton.py``; otherwise those tests
skip and say so), at awkward sizes: row blocks with a tail, vocabulary chunks with a tail, tiles
with a tail, ignored rows, targets at chunk edges. The kernel reduces per ``BLOCK_V`` tile where
the reference reduces per chunk, so they agree within FP32 rounding: ``INTERP_TOL``. With CUDA the
``cuda``-marked tests run the op on the GPU (cuBLAS or ``glm53::bi_linear`` logits, the compiled
Triton kernel; the backward is the chunked reference on CUDA) against the CPU op within
``GPU_TOL``, bitwise batch invariance of the ``batch_invariant`` path, and one graph under Inductor.
"""

import pytest
import torch

from inductor_ext.ops import token_logprobs_reference as ref
from tests.support.batch_invariant import check_batch_invariance, rel_l2
from tests.support.triton_interpreter import interpreter_kernels

pytest.importorskip("triton")

BF16, FP32 = torch.bfloat16, torch.float32
INTERP_TOL = {"rel_l2": 1e-6, "max_abs": 4e-6}  # tile-wise vs chunk-wise FP32 reductions, numpy vs torch exp/log
# GPU vs the CPU op: logits from another GEMM (a BF16 logit may round to the other neighbour),
# hardware exp/log; gradients rounded to BF16 once
GPU_TOL = {"rel_l2": 1e-4, "grad": 1e-2}


def _inputs(T, D, V, dtype=BF16, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = (torch.randn(T, D, generator=g) * 1.5).to(dtype)
    weight = (torch.randn(V, D, generator=g) * 0.5).to(dtype)
    targets = torch.randint(0, V, (T,), generator=g)
    targets[:4] = torch.tensor([-100, V - 1, 0, -100])
    return hidden, weight, targets


def _close(name, got, want, tol):
    assert got.shape == want.shape and got.dtype == want.dtype, f"{name}: {got.dtype}{tuple(got.shape)}"
    if got.numel() == 0:
        return
    err, mx = rel_l2(got, want), (got.double() - want.double()).abs().max().item()
    assert err <= tol["rel_l2"] and mx <= tol["max_abs"], f"{name}: relative L2 {err:.2e}, max |Δ| {mx:.2e} > {tol}"


# ---------------------------------------------------------------------------------------------
# interpreter (CPU)
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def kt():
    return interpreter_kernels("inductor_ext.kernels.token_logprobs", "tests/kernels/test_token_logprobs_triton.py")


def _run(kt, hidden, weight, targets, temperature, return_entropy, batch_invariant, chunk, block_t, block_v):
    matmul = lambda h, w: ref.raw_logits(h, w, batch_invariant)  # noqa: E731
    return kt.token_logprobs_fwd(hidden, weight, targets, temperature, return_entropy, matmul, chunk, block_t,
                                 block_v, ref.IGNORE_INDEX)


@pytest.mark.parametrize("batch_invariant", [False, True], ids=["plain", "bi"])
@pytest.mark.parametrize("return_entropy", [True, False], ids=["entropy", "no-entropy"])
@pytest.mark.parametrize("dtype", [BF16, FP32], ids=["bf16", "fp32"])
def test_matches_reference_small_tiles(kt, dtype, return_entropy, batch_invariant):
    """T = 37 (row blocks of 16: a 5-row tail), V = 1000 in chunks of 384 (a 232-row tail), tiles of
    128 columns (each chunk's last tile partial); the reference runs the same chunks."""
    hidden, weight, targets = _inputs(37, 32, 1000, dtype)
    targets[4:6] = torch.tensor([384, 383])  # the first row of the second chunk, the last of the first
    got = _run(kt, hidden, weight, targets, 0.7, return_entropy, batch_invariant, 384, 16, 128)
    want = ref.token_logprobs_reference(hidden, weight, targets, 0.7, batch_invariant, return_entropy, chunk=384)
    for name, a, b in zip(("logprobs", "entropy", "lse"), got, want):
        _close(name, a, b, INTERP_TOL)
    assert torch.equal(got[0][targets == -100], torch.zeros(2)), "ignored rows"


def test_matches_reference_at_the_real_sizes(kt):
    """CHUNK_V, BLOCK_T, BLOCK_V of the leaf: V = CHUNK_V + 100 (two chunks), T = 20."""
    hidden, weight, targets = _inputs(20, 16, ref.CHUNK_V + 100)
    targets[4] = ref.CHUNK_V
    got = _run(kt, hidden, weight, targets, 1.0, True, False, ref.CHUNK_V, ref.BLOCK_T, ref.BLOCK_V)
    want = ref.token_logprobs_reference(hidden, weight, targets, 1.0, False, True)
    for name, a, b in zip(("logprobs", "entropy", "lse"), got, want):
        _close(name, a, b, INTERP_TOL)


def test_out_of_range_target_gives_nan(kt):
    """A target outside [0, V) (the wrapper rejects it in eager mode only) is never found: NaN."""
    hidden, weight, targets = _inputs(5, 16, 100)
    targets[2] = 100
    lp = _run(kt, hidden, weight, targets, 1.0, False, False, 64, 16, 32)[0]
    assert torch.isnan(lp[2]) and torch.isfinite(torch.cat([lp[:2], lp[3:]])).all()


def test_batch_invariant_in_the_interpreter(kt):
    """Each row of the Triton kernel (with the batch-invariant reference product) is bitwise the row
    alone: row blocks of 16 hold rows of other calls at other positions."""
    V = 200
    hidden, weight, targets = _inputs(40, 32, V)

    def rows(h, u):
        t = u.abs().floor().long().clamp(max=V - 1)
        return torch.stack(_run(kt, h, weight, t, 0.7, True, True, 128, 16, 64)[:2], 1)

    failures = check_batch_invariance(rows, (hidden, targets.clamp(min=0).float()), sizes=(1, 2, 5, 17, 40), big=96)
    assert not failures, failures


# ---------------------------------------------------------------------------------------------
# CUDA (compiled kernels through the op)
# ---------------------------------------------------------------------------------------------


@pytest.mark.cuda
@pytest.mark.parametrize("batch_invariant", [False, True], ids=["plain", "bi"])
def test_cuda_op_matches_the_cpu_op(batch_invariant):
    from inductor_ext import ops

    hidden, weight, targets = _inputs(300, 128, 2 * ref.CHUNK_V + 300)
    outs, grads = {}, {}
    for device in ("cpu", "cuda"):
        h, w = (x.to(device).requires_grad_(True) for x in (hidden, weight))
        lp, ent = ops.token_logprobs(h, w, targets.to(device), temperature=0.7, return_entropy=True,
                                     batch_invariant=batch_invariant)
        g = torch.Generator().manual_seed(1)
        dlp, dent = (torch.randn(300, generator=g).to(device) for _ in range(2))
        grads[device] = [x.cpu() for x in torch.autograd.grad((lp, ent), (h, w), (dlp, dent))]
        outs[device] = (lp.detach().cpu(), ent.detach().cpu())
    for name, a, b in zip(("logprobs", "entropy"), outs["cuda"], outs["cpu"]):
        assert rel_l2(a, b) <= GPU_TOL["rel_l2"], f"{name}: {rel_l2(a, b):.2e}"
    for name, a, b in zip(("grad_hidden", "grad_weight"), grads["cuda"], grads["cpu"]):
        assert rel_l2(a, b) <= GPU_TOL["grad"], f"{name}: {rel_l2(a, b):.2e}"


@pytest.mark.cuda
def test_cuda_batch_invariant_rows():
    from inductor_ext import ops

    V = ref.CHUNK_V + 500
    hidden, weight, targets = (x.cuda() for x in _inputs(64, 256, V))

    def rows(h, u):
        t = u.abs().floor().long().clamp(max=V - 1)
        return torch.stack(ops.token_logprobs(h, weight, t, temperature=0.7, return_entropy=True,
                                              batch_invariant=True), 1)

    failures = check_batch_invariance(rows, (hidden, targets.clamp(min=0).float()))
    assert not failures, failures


@pytest.mark.cuda
def test_cuda_compiles_into_one_graph():
    from torch._dynamo.testing import CompileCounterWithBackend

    from inductor_ext import ops

    torch._dynamo.reset()
    hidden, weight, targets = (x.cuda() for x in _inputs(128, 64, ref.CHUNK_V + 7))
    hidden.requires_grad_(True)
    counter = CompileCounterWithBackend("inductor")

    def step(h):
        return ops.token_logprobs(h, weight, targets, temperature=0.7, return_entropy=True)

    got = torch.compile(step, backend=counter, fullgraph=True)(hidden)
    want = step(hidden)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert counter.frame_count == 1
    torch._dynamo.reset()
