"""glm53::token_logprobs on CPU against an independent FP64 reference written here (the full
``[T, V]`` log-softmax, which the op never builds): log-probs, entropy and the gradients of hidden
and weight (FP64 autograd VJP), ignored rows, the temperature, opcheck, bad inputs, one graph under
Inductor, batch invariance, and the peak memory of forward + backward against the materialized
``F.linear → log_softmax → gather`` path.

The reference is the contract of docs/DESIGN.md §4: logits = BF16 (hidden's dtype) rounding of the
exact product, cast, divided by τ, log-softmax; the rounding passes the gradient unchanged (a
straight-through rounding in the FP64 graph). Against it the op differs only by FP32 arithmetic
(and, rarely, a logit whose FP32-accumulated product rounds to the other neighbour), so the
tolerances below are FP32-level for the values and, for the gradients (rounded once to the input
dtype), the FP64 VJP rounded to that dtype.
"""

import pytest
import torch
import torch.nn.functional as F
from torch._C._profiler import _EventType
from torch._dynamo.testing import CompileCounterWithBackend
from torch.profiler import ProfilerActivity, profile

from inductor_ext import ops
from inductor_ext.ops import token_logprobs_reference as ref
from tests.support.batch_invariant import check_batch_invariance, planted_linear
from tests.support.fp64 import assert_rel_l2

BF16, FP32 = torch.bfloat16, torch.float32
# relative L2 (and max |Δ| for the values) against the FP64 reference; gradients against the FP64
# VJP rounded to the input dtype (one rounding of an FP32-accurate result: ~ties only)
TOL = {
    "values": {"rel_l2": 5e-6, "max_abs": 5e-5},
    "grad": {BF16: 1e-4, FP32: 1e-5},
}
SHAPE = {"T": 40, "D": 48, "V": 2 * ref.CHUNK_V + 77}  # three vocabulary chunks, the last a 77-row tail


def _inputs(T=SHAPE["T"], D=SHAPE["D"], V=SHAPE["V"], dtype=BF16, seed=0, requires_grad=False):
    g = torch.Generator().manual_seed(seed)
    hidden = (torch.randn(T, D, generator=g) * 1.5).to(dtype)
    weight = (torch.randn(V, D, generator=g) * 0.5).to(dtype)  # logits ~ N(0, 27): peaked rows
    targets = torch.randint(0, V, (T,), generator=g)
    special = [-100, V - 1, min(ref.CHUNK_V, V - 1), min(ref.CHUNK_V - 1, V - 1), 0, -100]  # chunk edges, ignored
    targets[:6] = torch.tensor(special)[:T]
    return hidden.requires_grad_(requires_grad), weight.requires_grad_(requires_grad), targets


def _fp64(hidden, weight, targets, temperature, dtype=BF16):
    """FP64 (logprobs, entropy) of the contract, differentiable in hidden and weight: exact product,
    rounded to ``dtype`` (the op's hidden dtype; straight through for the gradient), divided by τ,
    log-softmax."""
    exact = hidden.double() @ weight.double().t()
    rounded = exact + (exact.to(dtype).double() - exact).detach()
    logp = torch.log_softmax(rounded / temperature, dim=-1)
    valid = targets != -100
    picked = logp.gather(1, targets.clamp(min=0)[:, None])[:, 0]
    entropy = -(logp.exp() * logp).sum(-1)
    zero = torch.zeros((), dtype=torch.float64)
    return torch.where(valid, picked, zero), torch.where(valid, entropy, zero)


def _assert_values(name, got, want):
    assert got.dtype == FP32, f"{name}: dtype {got.dtype}"
    assert_rel_l2(name, got, want, TOL["values"]["rel_l2"])
    err = (got.double() - want).abs().max().item()
    assert err <= TOL["values"]["max_abs"], f"{name}: max |Δ| {err:.2e} > {TOL['values']['max_abs']}"


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("dtype", [BF16, FP32], ids=["bf16", "fp32"])
def test_values_and_gradients_match_fp64(dtype, temperature):
    hidden, weight, targets = _inputs(dtype=dtype, requires_grad=True)
    lp, ent = ops.token_logprobs(hidden, weight, targets, temperature=temperature, return_entropy=True)
    h64, w64 = (t.detach().double().requires_grad_(True) for t in (hidden, weight))
    lp64, ent64 = _fp64(h64, w64, targets, temperature, dtype)
    _assert_values("logprobs", lp, lp64.detach())
    _assert_values("entropy", ent, ent64.detach())
    g = torch.Generator().manual_seed(1)
    g_lp, g_ent = torch.randn(lp.shape, generator=g), torch.randn(lp.shape, generator=g)
    torch.autograd.backward((lp, ent), (g_lp, g_ent))
    torch.autograd.backward((lp64, ent64), (g_lp.double(), g_ent.double()))
    for name, leaf, want in (("grad_hidden", hidden, h64.grad), ("grad_weight", weight, w64.grad)):
        assert leaf.grad.dtype == dtype, f"{name} dtype {leaf.grad.dtype}"
        assert_rel_l2(name, leaf.grad, want.to(dtype), TOL["grad"][dtype])


def test_logprobs_alone_and_their_gradient():
    """Without entropy: the same log-probs (bitwise), an empty entropy output of the op, and the
    gradient of the log-probs alone against the FP64 VJP."""
    hidden, weight, targets = _inputs(requires_grad=True)
    lp = ops.token_logprobs(hidden, weight, targets, temperature=0.7)
    lp_e, _ = ops.token_logprobs(hidden, weight, targets, temperature=0.7, return_entropy=True)
    assert torch.equal(lp, lp_e), "log-probs depend on return_entropy"
    assert torch.ops.glm53.token_logprobs(hidden, weight, targets, 0.7, False, False)[1].shape == (0,)
    lp.sum().backward()
    h64, w64 = (t.detach().double().requires_grad_(True) for t in (hidden, weight))
    _fp64(h64, w64, targets, 0.7)[0].sum().backward()
    assert_rel_l2("grad_hidden", hidden.grad, h64.grad.to(BF16), TOL["grad"][BF16])
    assert_rel_l2("grad_weight", weight.grad, w64.grad.to(BF16), TOL["grad"][BF16])


def test_ignored_rows_give_zero_and_no_gradient():
    hidden, weight, targets = _inputs(requires_grad=True)
    ignored = targets == -100
    assert ignored.sum() == 2
    lp, ent = ops.token_logprobs(hidden, weight, targets, return_entropy=True)
    assert torch.equal(lp[ignored], torch.zeros(2)) and torch.equal(ent[ignored], torch.zeros(2))
    (lp.sum() + ent.sum()).backward()
    assert torch.equal(hidden.grad[ignored], torch.zeros(2, hidden.shape[1], dtype=BF16)), "ignored rows' gradient"
    # their hidden rows do not reach the weight's gradient either
    h2 = hidden.detach().clone()
    h2[ignored] = 7.0
    w2 = weight.detach().clone().requires_grad_(True)
    lp2, ent2 = ops.token_logprobs(h2, w2, targets, return_entropy=True)
    (lp2.sum() + ent2.sum()).backward()
    assert torch.equal(lp2, lp) and torch.equal(w2.grad, weight.grad), "ignored rows changed the others' results"
    # every row ignored: zero gradients
    w3 = weight.detach().clone().requires_grad_(True)
    ops.token_logprobs(hidden.detach(), w3, torch.full_like(targets, -100)).sum().backward()
    assert not w3.grad.any()


def test_temperature_divides_the_fp32_logits():
    """τ = 0.7 (not a power of two: dividing the BF16 logits before the cast would round them again)."""
    hidden, weight, targets = _inputs()
    lp, ent = ops.token_logprobs(hidden, weight, targets, temperature=0.7, return_entropy=True)
    lp64, ent64 = _fp64(hidden, weight, targets, 0.7)
    _assert_values("logprobs (τ=0.7)", lp, lp64)
    _assert_values("entropy (τ=0.7)", ent, ent64)
    lp1 = ops.token_logprobs(hidden, weight, targets, temperature=1.0)
    assert (lp1 - lp).abs().max() > 1e-2, "the temperature changed nothing"


@pytest.mark.parametrize("return_entropy", [False, True])
@pytest.mark.parametrize("batch_invariant", [False, True])
def test_opcheck(batch_invariant, return_entropy):
    hidden, weight, targets = _inputs(T=5, D=16, V=70, requires_grad=True)
    torch.library.opcheck(torch.ops.glm53.token_logprobs,
                          (hidden, weight, targets, 0.7, batch_invariant, return_entropy))
    with torch.no_grad():  # the backward op has no backward of its own
        _, ent, lse = torch.ops.glm53.token_logprobs(hidden, weight, targets, 0.7, batch_invariant, return_entropy)
    g = torch.randn(5)
    torch.library.opcheck(torch.ops.glm53.token_logprobs_bwd,
                          (hidden.detach(), weight.detach(), targets, lse, ent, g, g if return_entropy else ent, g,
                           0.7, batch_invariant, return_entropy))


def test_gradient_of_lse_output():
    """The op's third output (lse, saved for the backward) is differentiable too: d lse / dz = p."""
    hidden, weight, targets = _inputs(T=6, D=16, V=70, requires_grad=True)
    _, _, lse = torch.ops.glm53.token_logprobs(hidden, weight, targets, 0.7, False, False)
    lse.sum().backward()
    h64, w64 = (t.detach().double().requires_grad_(True) for t in (hidden, weight))
    exact = h64 @ w64.t()
    rounded = exact + (exact.to(BF16).double() - exact).detach()
    torch.logsumexp(rounded / 0.7, -1).sum().backward()
    assert_rel_l2("grad_hidden (lse)", hidden.grad, h64.grad.to(BF16), TOL["grad"][BF16])


def test_bad_inputs_raise():
    h, w, t = _inputs(T=4, D=8, V=20)
    cases = [
        (dict(hidden=h[0]), "hidden must be \\[T >= 1, D >= 1\\]"),
        (dict(hidden=h[:0]), "hidden must be \\[T >= 1, D >= 1\\]"),
        (dict(weight=w[:, :4]), "weight must be \\[V >= 1, D=8\\]"),
        (dict(hidden=h.to(torch.int32)), "hidden must be bfloat16, float16 or float32"),
        (dict(weight=w.float()), "weight must have hidden's dtype"),
        (dict(targets=t.to(torch.int32)), "targets must be int64 \\[T=4\\]"),
        (dict(targets=t[:3]), "targets must be int64 \\[T=4\\]"),
        (dict(weight=w.to("meta")), "must be on one device"),
        (dict(temperature=torch.tensor(0.7)), "temperature must be a python float, not a tensor"),
        (dict(temperature=0.0), "temperature must be a finite python float > 0"),
        (dict(temperature=-1.0), "temperature must be a finite python float > 0"),
        (dict(temperature=float("inf")), "temperature must be a finite python float > 0"),
        (dict(temperature=float("nan")), "temperature must be a finite python float > 0"),
        (dict(temperature=True), "temperature must be a finite python float > 0"),
        (dict(return_entropy=1), "return_entropy must be a bool"),
        (dict(batch_invariant="yes"), "batch_invariant must be a bool"),
        (dict(targets=torch.tensor([0, 1, 20, 2])), "targets must be in \\[0, V=20\\) or -100.*got 20 at row 2"),
        (dict(targets=torch.tensor([0, -1, 2, 2])), "targets must be in \\[0, V=20\\) or -100.*got -1 at row 1"),
    ]
    for change, match in cases:
        args = {"hidden": h, "weight": w, "targets": t, **change}
        kwargs = {k: args.pop(k) for k in ("temperature", "return_entropy", "batch_invariant") if k in args}
        with pytest.raises(ValueError, match=match):
            ops.token_logprobs(args["hidden"], args["weight"], args["targets"], **kwargs)


def test_compiles_into_one_inductor_graph():
    torch._dynamo.reset()

    def step(hidden, weight, targets):
        return ops.token_logprobs(hidden, weight, targets, temperature=0.7, return_entropy=True)

    counter = CompileCounterWithBackend("inductor")
    compiled = torch.compile(step, backend=counter, fullgraph=True)
    hidden, weight, targets = _inputs(T=24, D=32, V=300, requires_grad=True)
    got = compiled(hidden, weight, targets)
    want = step(hidden, weight, targets)
    g = (torch.randn(24), torch.randn(24))
    got_grads = torch.autograd.grad(got, (hidden, weight), g)
    want_grads = torch.autograd.grad(want, (hidden, weight), g)
    for name, a, b in zip(("logprobs", "entropy", "grad_hidden", "grad_weight"), (*got, *got_grads),
                          (*want, *want_grads)):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=lambda m, n=name: f"{n} (inductor): {m}")
    assert counter.frame_count == 1, f"expected one graph, got {counter.frame_count}"
    torch._dynamo.reset()


def test_batch_invariant_rows(monkeypatch):
    """With ``batch_invariant=True`` every row's (logprob, entropy) is bitwise the row computed
    alone, for 1..64 rows and inside a shuffled 4096-row call. Chunks of 128 rows so V = 300 takes
    three (a tail included) at a small cost; the model test covers the real chunk."""
    monkeypatch.setattr(ref, "CHUNK_V", 128)
    V = 300
    hidden, weight, targets = _inputs(T=64, D=32, V=V)

    def rows(h, u):  # u: the targets as FP32 (the checker's filler rows are random floats)
        t = u.abs().floor().long().clamp(max=V - 1)
        return torch.stack(ops.token_logprobs(h, weight, t, temperature=0.7, return_entropy=True,
                                              batch_invariant=True), 1)

    u = targets.clamp(min=0).float()
    failures = check_batch_invariance(rows, (hidden, u))
    assert not failures, failures
    # the checker catches a batch-variant product (K block chosen from M) in the same composition
    # (FP32 operands: a BF16 rounding of the logits would hide most of its reordering)
    def planted_rows(h, u):
        t = u.abs().floor().long().clamp(max=V - 1)
        out = ref.token_logprobs_reference(h, weight.float(), t, 0.7, True, True, matmul=planted_linear)
        return torch.stack(out[:2], 1)

    assert check_batch_invariance(planted_rows, (hidden.float(), u), sizes=(1, 40), big=0), "planted product passed"


def _peak_bytes(fn) -> int:
    """Peak of the CPU bytes allocated (and not yet freed) while ``fn`` runs: the running sum of the
    profiler's allocation events (``profile_memory=True``) in time order."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events, stack = [], list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        node = stack.pop()
        if node.tag == _EventType.Allocation:
            events.append((node.start_time_ns, node.extra_fields.alloc_size))
        stack.extend(node.children)
    current = peak = 0
    for _, size in sorted(events):
        current += size
        peak = max(peak, current)
    return peak


@pytest.mark.parametrize("T", [512, pytest.param(8192, marks=pytest.mark.slow)])
def test_peak_memory_against_the_materialized_path(T):
    """Forward + backward at V = 65536, D = 64 (BF16): the chunked op holds a few ``[T, CHUNK_V]``
    FP32 tensors, the materialized path several ``[T, V]`` ones."""
    V, D = 65536, 64
    hidden, weight, targets = _inputs(T=T, D=D, V=V, requires_grad=True)

    def chunked():
        ops.token_logprobs(hidden, weight, targets, temperature=0.7).sum().backward()

    def materialized():
        logits = F.linear(hidden, weight).float() / 0.7
        lp = torch.log_softmax(logits, -1).gather(1, targets.clamp(min=0)[:, None])[:, 0]
        torch.where(targets != -100, lp, 0.0).sum().backward()

    peaks = {}
    for name, fn in (("chunked", chunked), ("materialized", materialized)):
        hidden.grad = weight.grad = None
        peaks[name] = _peak_bytes(fn)
    mib = {k: v / 2**20 for k, v in peaks.items()}
    print(f"\npeak memory, forward + backward, T={T} V={V} D={D} bf16: chunked {mib['chunked']:.1f} MiB, "
          f"materialized {mib['materialized']:.1f} MiB ({peaks['chunked'] / peaks['materialized']:.3f})")
    chunk_bytes = T * ref.CHUNK_V * 4  # one FP32 [T, CHUNK_V] tensor
    assert peaks["chunked"] <= 5 * chunk_bytes + 4 * (V + T) * D * 4, f"chunked peak {mib} above O(T·chunk + V·D)"
    assert peaks["materialized"] >= 2 * T * V * 4, f"the materialized path's peak {mib} is implausibly small"
    assert peaks["chunked"] <= peaks["materialized"] / 8, f"chunked peak not a small fraction: {mib}"
